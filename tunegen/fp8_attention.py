"""FP8 prefill attention behind `tunegen.attention`: float8 e4m3 q, k, v with FlashAttention-3's
descale factors, or float16/bfloat16 inputs rotated and quantized on the way in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tunegen import checks, fp8_quantize
from tunegen.eager import backend_for
from tunegen.kernels import dispatch, fp8
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem, bucket
from tunegen.kernels.reference import attention_reference

PRECISIONS = (None, "fp8")
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def requested(q: object, precision: object, hadamard: object, descales: Sequence[object]) -> bool:
    """Whether a call asks for FP8: precision, hadamard or a descale given, or e4m3 q."""
    q_descale, k_descale, v_descale = descales
    return (
        precision is not None
        or hadamard is not None
        or q_descale is not None
        or k_descale is not None
        or v_descale is not None
        or getattr(q, "dtype", None) == fp8.E4M3
    )


def _check_no_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(
            "precision: 'fp8' attention is not differentiable, and q, k or v requires grad; "
            "run it under torch.no_grad() or pass detached tensors"
        )


def check_fp8(q, k, v, precision, hadamard, descales) -> list[torch.Tensor] | None:
    """Check an FP8 call's arguments: for float8_e4m3fn q, k, v, their descales (None given as
    ones); for 16-bit inputs, which are quantized on the way in, None."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected None or 'fp8', got {precision!r}")
    if getattr(q, "dtype", None) == fp8.E4M3:
        checks.check_attention(q, k, v, (fp8.E4M3,), k_major_v=True)
        _check_no_grad(q, k, v)
        if hadamard:
            raise ValueError(
                "hadamard: q, k and v are float8_e4m3fn already; rotate before quantizing "
                "(tunegen.quantize_fp8 does both)"
            )
        batch, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
        blocks = {n: -(-x.shape[2] // fp8.SCALE_BLOCK) for n, x in (("q_descale", q), ("k_descale", k))}
        shapes = {
            "q_descale": [(batch, hkv), (batch, hq, blocks["q_descale"])],
            "k_descale": [(batch, hkv), (batch, hkv, blocks["k_descale"])],
            "v_descale": [(batch, hkv)],
        }
        ones = torch.ones((batch, hkv), device=q.device, dtype=torch.float32)
        return [
            ones if d is None else checks.descale_arg(name, d, shapes[name], q.device)
            for name, d in zip(DESCALE_NAMES, descales, strict=True)
        ]
    for name, d in zip(DESCALE_NAMES, descales, strict=True):
        if d is not None:
            raise ValueError(
                f"{name}: descales come with float8_e4m3fn q, k, v; 16-bit inputs are quantized here"
            )
    if precision is None:
        raise ValueError("hadamard: the rotation applies to precision='fp8' only")
    checks.check_attention(q, k, v, (torch.float16, torch.bfloat16))
    _check_no_grad(q, k, v)
    return None


def _inputs(q, k, v, precision, hadamard, descales) -> tuple[fp8.Fp8Inputs, torch.dtype]:
    """The e4m3 inputs with their descales, and the output dtype, after checking the arguments."""
    checked = check_fp8(q, k, v, precision, hadamard, descales)
    if checked is not None:
        return fp8.Fp8Inputs(q, k, v, *checked), torch.bfloat16
    rotate = True if hadamard is None else bool(hadamard)
    return fp8_quantize.quantize_fp8(q, k, v, hadamard=rotate), q.dtype


def fp8_problem(x: fp8.Fp8Inputs, out: torch.Tensor, causal: bool, return_lse: bool) -> Problem:
    """The Problem an FP8 call on e4m3 inputs `x` into bf16 `out` is dispatched under."""
    batch, heads, seqlen_q, head_dim = x.q.shape
    return Problem(
        family="prefill",
        dtype="bfloat16",
        head_dim=head_dim,
        causal=bool(causal),
        num_heads_q=heads,
        num_heads_kv=x.k.shape[1],
        batch=bucket(batch, floor=1),
        seqlen_q=bucket(seqlen_q),
        seqlen_k=bucket(x.k.shape[2]),
        fp8=True,
        return_lse=bool(return_lse),
        aligned=checks.is_aligned16(x.q, x.k, out, x.v.transpose(2, 3) if fp8.is_k_major(x.v) else x.v),
    )


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    return_lse: bool,
    strict: bool | None,
    precision: str | None,
    hadamard: bool | None,
    descales: Sequence[torch.Tensor | None],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`tunegen.attention` for FP8 calls: check, quantize if needed, dispatch the fp8 Problem."""
    x, out_dtype = _inputs(q, k, v, precision, hadamard, descales)
    scale = checks.check_scale(scale, q.shape[-1])
    if backend_for(q.device, strict) == "torch":
        values = [fp8.dequantize(t, s, torch.float32) for t, s in zip(x[:3], x[3:], strict=True)]
        out, lse = attention_reference(*values, causal=causal, scale=scale, compute_dtype=torch.float32)
    else:
        batch, heads, seqlen_q = q.shape[:3]
        out = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16)
        lse = (
            torch.empty((batch, heads, seqlen_q), device=q.device, dtype=torch.float32)
            if return_lse
            else None
        )
        problem = fp8_problem(x, out, causal, return_lse)
        kernel = dispatch.kernel_for(problem, gpu_of(q.device))
        kernel.launch(x.q, x.k, x.v, out, lse, scale, *x[3:])
    out = out.to(out_dtype)
    return (out, lse) if return_lse else out
