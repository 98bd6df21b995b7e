"""Gradients of `attention` and `attention_varlen`.

The eager path wraps each in a torch.autograd.Function that keeps q, k, v, the output and the
log-sum-exp; the custom ops (tunegen.ops) register the same backward bodies for torch.compile.
A backward body dispatches the backward family's kernel like the forward does (Winner, nearest
bucket, default), or, where no Triton kernel runs, differentiates the PyTorch reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tunegen import checks, eager
from tunegen.kernels import dispatch
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import DTYPE_NAMES, Problem, bucket
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def problem_for(
    q: torch.Tensor, k: torch.Tensor, causal: bool, batch: int, seqlen_q: int, seqlen_k: int, varlen: bool
) -> Problem:
    """The backward Problem of a call, taken as aligned (the call's gradients may say otherwise:
    see `descriptor_ready`); whether the forward returned its log-sum-exp leaves it unchanged."""
    return Problem(
        family="backward",
        dtype=DTYPE_NAMES[q.dtype],
        head_dim=q.shape[-1],
        causal=bool(causal),
        num_heads_q=q.shape[1],
        num_heads_kv=k.shape[1],
        batch=bucket(batch, floor=1),
        seqlen_q=bucket(seqlen_q),
        seqlen_k=bucket(seqlen_k),
        varlen=varlen,
    )


def descriptor_ready(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors (TMA) can read `tensors` row by row: 16-byte aligned bases and
    strides, and no stride of zero (a broadcast dout) but the last."""
    return checks.is_aligned16(*tensors) and all(0 not in t.stride()[:-1] for t in tensors)


def _check_grads(
    dout: object, dlse: object, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The incoming gradients, ready for the kernels: dout like the output with a unit last
    stride (zeros when only the log-sum-exp was used), dlse like the log-sum-exp or None."""
    if dout is None:
        dout = torch.zeros_like(out)
    if not isinstance(dout, torch.Tensor) or dout.shape != out.shape or dout.device != out.device:
        what = f"shape {tuple(dout.shape)} on {dout.device}" if isinstance(dout, torch.Tensor) else type(dout)
        raise ValueError(f"dout: expected the output's shape {tuple(out.shape)} on {out.device}, got {what}")
    expected = tuple(out.shape[:3]) if out.dim() == 4 else (out.shape[1], out.shape[0])
    if lse.shape != expected:
        raise ValueError(f"lse: expected the forward's log-sum-exp, shape {expected}, got {tuple(lse.shape)}")
    if dlse is not None and (not isinstance(dlse, torch.Tensor) or dlse.shape != lse.shape):
        raise ValueError(f"dlse: expected None or a tensor of the log-sum-exp's shape {tuple(lse.shape)}")
    dout = dout.to(out.dtype)
    return (dout if dout.stride(-1) == 1 else dout.contiguous()), dlse


def _reference_grads(
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> Grads:
    """Differentiate the PyTorch reference (float32 compute) at `inputs`: the fallback's backward."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out, lse = forward(*leaves, compute_dtype=eager.fallback_dtype(leaves[0].dtype))
        pairs = [(o, g) for o, g in ((out.to(leaves[0].dtype), dout), (lse.float(), dlse)) if g is not None]
        dq, dk, dv = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])
    return dq, dk, dv


def _grads(
    dout: torch.Tensor | None,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dlse: torch.Tensor | None,
    scale: float,
    strict: bool | None,
    problem: Problem,
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    sizes: tuple = (),
) -> Grads:
    """The body both entry points share: the kernel dispatched for `problem` on (q, k, v, out,
    lse) = `inputs`, or where no Triton kernel runs, autograd through `reference`."""
    q, k, v, out, lse = inputs
    dout, dlse = _check_grads(dout, dlse, out, lse)
    if eager.backend_for(q.device, strict) == "torch":
        return _reference_grads(reference, (q, k, v), dout, dlse)
    if not descriptor_ready(q, k, v, dout):
        problem = dataclasses.replace(problem, aligned=False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kernel = dispatch.kernel_for(problem, gpu_of(q.device))
    kernel.launch(q, k, v, out, dout, lse, dlse, dq, dk, dv, scale, *sizes)
    return dq, dk, dv


def attention_backward_eager(
    dout: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
    strict: bool | None = None,
) -> Grads:
    """dq, dk, dv of `attention(q, k, v)` given the gradient of its output (`dout`) and of its
    log-sum-exp (`dlse`, or None); `out` and `lse` are what the forward returned."""
    checks.check_attention(q, k, v)
    problem = problem_for(q, k, causal, q.shape[0], q.shape[2], k.shape[2], varlen=False)
    reference = lambda q, k, v, compute_dtype: attention_reference(
        q, k, v, causal=causal, scale=scale, compute_dtype=compute_dtype
    )
    return _grads(dout, (q, k, v, out, lse), dlse, scale, strict, problem, reference)


def attention_varlen_backward_eager(
    dout: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    scale: float,
    strict: bool | None = None,
) -> Grads:
    """dq, dk, dv of `attention_varlen` over packed sequences, as `attention_backward_eager`."""
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    checks.check_attention_varlen(q, k, v, *sizes, read_lengths=False)
    problem = problem_for(q, k, causal, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, varlen=True)
    reference = lambda q, k, v, compute_dtype: attention_varlen_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, compute_dtype=compute_dtype
    )
    return _grads(dout, (q, k, v, out, lse), dlse, scale, strict, problem, reference, sizes)


class AttentionFunction(torch.autograd.Function):
    """`attention` with gradients, for the eager path: returns (out, lse) and keeps both."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, strict):
        out, lse = eager.attention_eager(q, k, v, causal=causal, scale=scale, return_lse=True, strict=strict)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.strict = causal, checks.check_scale(scale, q.shape[-1]), strict
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = attention_backward_eager(
            dout, q, k, v, out, lse, dlse, causal=ctx.causal, scale=ctx.scale, strict=ctx.strict
        )
        return (*grads, None, None, None)


class AttentionVarlenFunction(torch.autograd.Function):
    """`attention_varlen` with gradients, for the eager path: returns (out, lse) and keeps both."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, strict):
        sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = eager.attention_varlen_eager(
            q, k, v, *sizes, causal=causal, scale=scale, return_lse=True, strict=strict
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.causal, ctx.scale, ctx.strict = causal, checks.check_scale(scale, q.shape[-1]), strict
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        sizes = (cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens)
        grads = attention_varlen_backward_eager(
            dout, q, k, v, out, lse, dlse, *sizes, causal=ctx.causal, scale=ctx.scale, strict=ctx.strict
        )
        return (*grads, *(None,) * 7)
