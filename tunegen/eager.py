"""What the public attention calls share: which path runs (`backend_for`, strict mode), the
Problem key of a call, and the eager bodies (checks, dispatch, launch) that `attention`,
`attention_varlen`, their autograd Functions and their custom ops all run."""

from __future__ import annotations

import os

import torch

from tunegen import checks
from tunegen.kernels import dispatch, launcher
from tunegen.kernels.gpu import gpu_of, interpreting
from tunegen.kernels.problem import DTYPE_NAMES, Problem, bucket
from tunegen.kernels.reference import attention_reference, attention_varlen_reference


class FallbackError(RuntimeError):
    """Raised in strict mode when a call would not run a Triton kernel."""


def backend_for(device: torch.device, strict: bool | None = None) -> str:
    """Which path runs on `device`: "cuda" (compiled Triton), "interpreter" (Triton's interpreter
    on CPU tensors, with TRITON_INTERPRET=1) or "torch" (the PyTorch reference, refused when strict)."""
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu" and interpreting():
        return "interpreter"
    if strict is None:
        strict = os.environ.get("TUNEGEN_STRICT", "0").lower() in ("1", "true", "on", "yes")
    if strict:
        raise FallbackError(
            f"strict mode: no Triton kernel runs on {device.type} tensors "
            "(use CUDA tensors, or CPU tensors with TRITON_INTERPRET=1)"
        )
    return "torch"


def fallback_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the PyTorch fallback computes in: float32, or float64 for float64 inputs."""
    return torch.float32 if dtype != torch.float64 else torch.float64


def wants_grad(q: object, k: object, v: object) -> bool:
    """Whether autograd records and q, k or v requires grad (about 0.3 µs; arguments that are not
    tensors are left to the checks)."""
    try:
        return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:
        return False


def attention_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The eager body of `attention`: checks, dispatch, launch.

    On CUDA, a call whose tensors match an earlier call's in everything the checks, the Problem
    and the launch depend on (shapes, strides, dtypes, devices, 16-byte alignment, flags) skips
    all three and goes from one dict lookup to the compiled kernel's launch.
    """
    try:
        key = (launcher.key_of(q, k, v), bool(causal), bool(return_lse))
        call = dispatch.fast_calls.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        key = call = None
    if call is not None:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
        call(q, k, v, out, lse, checks.check_scale(scale, q.shape[-1]))
        return (out, lse) if return_lse else out
    checks.check_attention(q, k, v)
    scale = checks.check_scale(scale, q.shape[-1])
    backend = backend_for(q.device, strict)
    batch, heads, seqlen_q, _ = q.shape
    if backend == "torch":
        out, lse = attention_reference(
            q, k, v, causal=causal, scale=scale, compute_dtype=fallback_dtype(q.dtype)
        )
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seqlen_q), device=q.device, dtype=torch.float32) if return_lse else None
    kernel = dispatch.kernel_for(attention_problem(q, k, v, out, causal, return_lse), gpu_of(q.device))
    if backend == "cuda" and key is not None:
        call = dispatch.fast_calls[key] = kernel.bind(q, k, v, out, lse, scale)
        call(q, k, v, out, lse, scale)
    else:
        kernel.launch(q, k, v, out, lse, scale)
    return (out, lse) if return_lse else out


def attention_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool, return_lse: bool
) -> Problem:
    """The Problem a call of `attention` on these tensors is dispatched under (sizes bucketed)."""
    return Problem(
        family="prefill",
        dtype=DTYPE_NAMES[q.dtype],
        head_dim=q.shape[3],
        causal=bool(causal),
        num_heads_q=q.shape[1],
        num_heads_kv=k.shape[1],
        batch=bucket(q.shape[0], floor=1),
        seqlen_q=bucket(q.shape[2]),
        seqlen_k=bucket(k.shape[2]),
        return_lse=bool(return_lse),
        aligned=checks.is_aligned16(q, k, v, out),
    )


def varlen_problem(q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse) -> Problem:
    """The Problem a call of `attention_varlen` is dispatched under (batch and maxima bucketed)."""
    return Problem(
        family="prefill",
        dtype=DTYPE_NAMES[q.dtype],
        head_dim=q.shape[-1],
        causal=bool(causal),
        num_heads_q=q.shape[1],
        num_heads_kv=k.shape[1],
        batch=bucket(cu_seqlens_q.shape[0] - 1, floor=1),
        seqlen_q=bucket(max_seqlen_q),
        seqlen_k=bucket(max_seqlen_k),
        varlen=True,
        return_lse=bool(return_lse),
        aligned=checks.is_aligned16(q, k, v, out),
    )


def attention_varlen_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The eager body of `attention_varlen`: checks, dispatch, launch."""
    capturing = (
        q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if isinstance(q, torch.Tensor)
        else False
    )
    checks.check_attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, read_lengths=not capturing
    )
    scale = checks.check_scale(scale, q.shape[-1])
    backend = backend_for(q.device, strict)
    if backend == "torch":
        out, lse = attention_varlen_reference(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            causal=causal,
            scale=scale,
            compute_dtype=fallback_dtype(q.dtype),
        )
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32) if return_lse else None
    problem = varlen_problem(q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse)
    kernel = dispatch.kernel_for(problem, gpu_of(q.device))
    kernel.launch(q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    return (out, lse) if return_lse else out
