"""tunegen's functions as PyTorch custom ops (`torch.ops.tunegen.*`), with fake-tensor shapes,
so `torch.compile(fullgraph=True)` traces a call as one opaque op instead of breaking the graph
on its Python checks and dispatch; each forward op registers its backward op for autograd.

An op takes tensors and plain values only; its body rebuilds the checked call
(tunegen.calls.prefill) from them and runs the eager body; `through_op` calls the op for a call."""

from __future__ import annotations

import torch

from tunegen import backward, eager
from tunegen.backends import capturing
from tunegen.calls.backward import BackwardCall
from tunegen.calls.prefill import PrefillCall


@torch.library.custom_op("tunegen::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    return_lse: bool,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention(); the log-sum-exp is a 0-element tensor unless asked for (`deterministic` is
    the backward's)."""
    local = _local(window_left, window_right, attention_chunk, softcap, sinks)
    out, lse = eager.run(
        PrefillCall.dense(q, k, v, causal=causal, scale=scale, return_lse=return_lse, **local)
    )
    return out, lse if lse is not None else q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _(q, k, v, causal, scale, return_lse, *_):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tunegen::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    return_lse: bool,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_varlen(); the log-sum-exp is a 0-element tensor unless asked for."""
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    call = PrefillCall.packed(
        q,
        k,
        v,
        *sizes,
        causal=causal,
        scale=scale,
        return_lse=return_lse,
        read_lengths=not capturing(q),
        **_local(window_left, window_right, attention_chunk, softcap, sinks),
    )
    out, lse = eager.run(call)
    return out, lse if lse is not None else q.new_empty(0, dtype=torch.float32)


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, *_):
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tunegen::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of attention() from its output's and log-sum-exp's gradients."""
    forward = PrefillCall.dense(
        q, k, v, causal=causal, scale=scale, return_lse=True, deterministic=deterministic
    )
    return backward.gradients(BackwardCall.checked(forward, out, lse, dout, dlse))


@attention_backward_op.register_fake
def _(dout, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("tunegen::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    dout: torch.Tensor,
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
    causal: bool,
    scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of attention_varlen()."""
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    forward = PrefillCall.packed(
        q, k, v, *sizes, causal=causal, scale=scale, return_lse=True, deterministic=deterministic
    )
    return backward.gradients(BackwardCall.checked(forward, out, lse, dout, dlse))


@attention_varlen_backward_op.register_fake
def _(dout, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _local(window_left: int, window_right: int, attention_chunk: int, softcap: float, sinks) -> dict:
    """An op's feature arguments as the public call's."""
    window = (window_left, window_right)
    return {"window_size": window, "attention_chunk": attention_chunk, "softcap": softcap, "sinks": sinks}


def through_op(call: PrefillCall) -> tuple[torch.Tensor, torch.Tensor]:
    """`call` (checked, as traced) through its custom op: the output and log-sum-exp (a 0-element
    tensor unless `call.return_lse`)."""
    x = call.local
    local = (x.window_left, x.window_right, x.attention_chunk, x.softcap, x.sinks)
    flags = (call.causal, call.scale, call.return_lse, call.deterministic, *local)
    if call.varlen is None:
        return torch.ops.tunegen.attention(call.q, call.k, call.v, *flags)
    x = call.varlen
    return torch.ops.tunegen.attention_varlen(
        call.q,
        call.k,
        call.v,
        x.cu_seqlens_q,
        x.cu_seqlens_k,
        x.max_seqlen_q,
        x.max_seqlen_k,
        *flags,
    )


def _keep_for_backward(ctx, inputs, output) -> None:
    """Save q, k, v (and the varlen offsets), the output and the log-sum-exp; the rest as is, and
    how many inputs follow q, k, v (none of which gets a gradient)."""
    q, k, v, *rest = inputs
    out, lse = output
    tensors = [t for t in rest if isinstance(t, torch.Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.rest = [a for a in rest if not isinstance(a, torch.Tensor)]
    ctx.inputs_past_qkv = len(rest)
    window_left, window_right, chunk, softcap, sinks = inputs[-5:]
    ctx.local = (window_left, window_right) != (-1, -1) or chunk != 0 or softcap != 0 or sinks is not None


def _refuse_local(ctx) -> None:
    """A ValueError where the forward had a window, chunks, a cap or sinks: the backward renders
    none of them in this release (the public calls refuse before; the ops may be called directly)."""
    if ctx.local:
        raise ValueError(
            "window_size: the backward renders no window_size, attention_chunk, softcap or sinks in "
            "this release"
        )


def _attention_grads(ctx, dout, dlse):
    _refuse_local(ctx)
    q, k, v, out, lse, *_ = ctx.saved_tensors
    causal, scale, _, deterministic, *_ = ctx.rest
    if lse.numel() == 0:  # called without the log-sum-exp (return_lse=False): compute it again
        out, lse = attention_op(q, k, v, causal, scale, True)
        dlse = None
    grads = attention_backward_op(dout, q, k, v, out, lse, dlse, causal, scale, deterministic)
    return (*grads, *(None,) * ctx.inputs_past_qkv)


def _attention_varlen_grads(ctx, dout, dlse):
    _refuse_local(ctx)
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *_ = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, causal, scale, _, deterministic, *_ = ctx.rest
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if lse.numel() == 0:  # called without the log-sum-exp (return_lse=False): compute it again
        out, lse = attention_varlen_op(q, k, v, *sizes, causal, scale, True)
        dlse = None
    grads = attention_varlen_backward_op(dout, q, k, v, out, lse, dlse, *sizes, causal, scale, deterministic)
    return (*grads, *(None,) * ctx.inputs_past_qkv)


attention_op.register_autograd(_attention_grads, setup_context=_keep_for_backward)
attention_varlen_op.register_autograd(_attention_varlen_grads, setup_context=_keep_for_backward)
