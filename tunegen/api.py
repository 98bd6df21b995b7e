"""The public attention functions: SDPA's layout, FlashAttention's varlen conventions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from tunegen import checks, fp8_attention
from tunegen.backward import AttentionFunction, AttentionVarlenFunction
from tunegen.eager import (
    attention_eager,
    attention_problem,
    attention_varlen_eager,
    backend_for,
    varlen_problem,
    wants_grad,
)
from tunegen.kernels import dispatch, fp8, quantize
from tunegen.kernels.families import get
from tunegen.kernels.families.base import applicable
from tunegen.kernels.gpu import gpu_of


def _bound(q: object, k: object, v: object, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable, dict]:
    """The public function a call with these arguments is, and its arguments by name (defaults
    filled in), as Python would bind them: an argument it does not take is a ValueError."""
    varlen = isinstance(q, torch.Tensor) and q.dim() == 3
    target = attention_varlen if varlen else attention
    signature = inspect.signature(target)
    unknown = sorted(set(kwargs) - set(signature.parameters))
    if unknown:
        raise ValueError(
            f"{unknown[0]}: tunegen.{target.__name__} takes no such argument "
            f"(it takes {', '.join(signature.parameters)})"
        )
    try:
        call = signature.bind(q, k, v, *args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"explain: {exc}, as tunegen.{target.__name__}{signature} would be") from None
    call.apply_defaults()
    return target, call.arguments


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Which kernel a call with these arguments runs, and why: the Problem, the Gpu, the source
    ("winner", "nearest" bucket, "default", or "torch" for the PyTorch fallback), the Variant's
    knobs that apply to the Problem on that Gpu (`base.applicable`; the others keep their
    defaults) and the Winner's provenance. Takes the arguments of `attention` (FP8 ones too), or
    of `attention_varlen` when q is packed (3-D), and refuses any other; explains the forward
    kernel that call runs (with its log-sum-exp where autograd records, as the call keeps it for
    the backward). Builds the kernel if this is the first call for the Problem; runs none."""
    target, a = _bound(q, k, v, args, kwargs)
    varlen = target is attention_varlen
    causal = bool(a["causal"])
    return_lse = bool(a["return_lse"]) or wants_grad(q, k, v)
    descales = () if varlen else (a["q_descale"], a["k_descale"], a["v_descale"])
    if not varlen and fp8_attention.requested(q, a["precision"], a["hadamard"], descales):
        checked = fp8_attention.check_fp8(q, k, v, a["precision"], a["hadamard"], descales)
        # 16-bit inputs: the layout tunegen.quantize_fp8 writes (allocated, not computed)
        x = quantize.outputs(q, k, per_block=True) if checked is None else fp8.Fp8Inputs(q, k, v, *checked)
        out = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16)
        problem = fp8_attention.fp8_problem(x, out, causal, bool(a["return_lse"]))
    elif varlen:
        sizes = [a[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
        checks.check_attention_varlen(q, k, v, *sizes, read_lengths=False)
        problem = varlen_problem(q, k, v, q, sizes[0], sizes[2], sizes[3], causal, return_lse)
    else:
        checks.check_attention(q, k, v)
        problem = attention_problem(q, k, v, q, causal, return_lse)
    checks.check_scale(a["scale"], q.shape[-1])
    backend = backend_for(q.device, a["strict"])
    if backend == "torch":
        return {
            "problem": problem.as_dict(),
            "gpu": None,
            "source": "torch",
            "variant": None,
            "winner": None,
            "reason": f"no Triton kernel runs on {q.device.type} tensors without TRITON_INTERPRET=1",
        }
    gpu = gpu_of(q.device)
    choice = dispatch.choice_for(problem, gpu)
    winner = None
    if choice.winner is not None:
        w = choice.winner
        winner = {
            "gpu": w.gpu.name,
            "median_ms": w.median_ms,
            "tflops": w.tflops,
            "rel_err": w.rel_err,
            "peer": w.peer_name,
            "peer_ms": w.peer_ms,
            "triton_version": w.triton_version,
            "created_at": w.created_at.isoformat(),
            "problem": w.problem,
        }
    return {
        "problem": problem.as_dict(),
        "gpu": gpu.name,
        "source": choice.source,
        "variant": applicable(get(problem.family), choice.kernel.variant, problem, gpu),
        "winner": winner,
        "stale": choice.stale,
        "reason": choice.reason,
    }


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
    precision: str | None = None,
    hadamard: bool | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention over (batch, heads, seqlen, head_dim) tensors.

    The layout and meaning of `torch.nn.functional.scaled_dot_product_attention`; k and v may
    have fewer heads than q (GQA/MQA, the query head count a multiple of theirs). `causal`
    aligns the mask bottom-right when the lengths differ, as FlashAttention does. `scale`
    defaults to 1/sqrt(head_dim). With `return_lse`, also returns the natural-log
    log-sum-exp (batch, heads, seqlen_q) in float32. `strict` (default: TUNEGEN_STRICT)
    makes any path other than a Triton kernel an error. Under torch.compile the call is the
    custom op `torch.ops.tunegen.attention`. Differentiable: when autograd records and q, k or v
    requires grad, the backward family's kernels give their gradients (and the log-sum-exp's).

    FP8 (not differentiable): `precision="fp8"` quantizes float16/bfloat16 q, k, v to float8
    e4m3 with per-block scales, first rotating q and k by a Walsh-Hadamard matrix along head_dim
    (`hadamard`, default True: QKᵀ is unchanged and outlier features spread out), and returns the
    inputs' dtype. float8_e4m3fn q, k, v run as given, with FlashAttention-3's float32
    `q_descale`, `k_descale`, `v_descale` (batch, kv_heads), None meaning 1 (q and k may also
    take one per 128 rows, see `tunegen.quantize_fp8`), and return bfloat16.
    """
    if fp8_attention.requested(q, precision, hadamard, (q_descale, k_descale, v_descale)):
        return fp8_attention.attention_fp8(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            return_lse=return_lse,
            strict=strict,
            precision=precision,
            hadamard=hadamard,
            descales=(q_descale, k_descale, v_descale),
        )
    if torch.compiler.is_compiling():
        checks.check_attention(q, k, v)
        resolved = checks.check_scale(scale, q.shape[-1])
        keep_lse = bool(return_lse) or wants_grad(q, k, v)
        out, lse = torch.ops.tunegen.attention(q, k, v, bool(causal), resolved, keep_lse)
        return (out, lse) if return_lse else out
    if wants_grad(q, k, v):
        out, lse = AttentionFunction.apply(q, k, v, bool(causal), scale, strict)
        return (out, lse) if return_lse else out
    return attention_eager(q, k, v, causal=causal, scale=scale, return_lse=return_lse, strict=strict)


def attention_varlen(
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
    """Attention over packed (total_tokens, heads, head_dim) sequences, as `flash_attn_varlen_func`.

    `cu_seqlens_q`/`cu_seqlens_k` are int32 offsets (batch + 1) of each sequence in the packed
    tensors; `max_seqlen_q`/`max_seqlen_k` bound their lengths. The offsets are read once to be
    checked (a device-to-host copy on GPU), except while a CUDA graph is being captured. With
    `return_lse`, also returns the log-sum-exp (heads, total_q) in float32. Under torch.compile
    the call is the custom op `torch.ops.tunegen.attention_varlen`. Differentiable, as `attention`.
    """
    if torch.compiler.is_compiling():
        checks.check_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, read_lengths=False
        )
        resolved = checks.check_scale(scale, q.shape[-1])
        out, lse = torch.ops.tunegen.attention_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            bool(causal),
            resolved,
            bool(return_lse) or wants_grad(q, k, v),
        )
        return (out, lse) if return_lse else out
    if wants_grad(q, k, v):
        sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = AttentionVarlenFunction.apply(q, k, v, *sizes, bool(causal), scale, strict)
        return (out, lse) if return_lse else out
    return attention_varlen_eager(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        scale=scale,
        return_lse=return_lse,
        strict=strict,
    )
