"""FP8 prefill attention behind `tunegen.attention`: float8 e4m3 q, k, v with FlashAttention-3's
descale factors, or float16/bfloat16 inputs rotated and quantized on the way in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tunegen import checks, fp8_quantize
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import fp8, quantize

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


def fp8_call(
    q: object,
    k: object,
    v: object,
    *,
    causal: object,
    scale: object,
    return_lse: object,
    strict: bool | None,
    precision: object,
    hadamard: object,
    descales: Sequence[object],
    quantize_now: bool = True,
) -> PrefillCall:
    """An FP8 call of `tunegen.attention`, checked, on e4m3 inputs: those given, with their
    descales (None given as ones), or 16-bit inputs quantized here (rotated unless `hadamard` is
    False; with `quantize_now` False, only their layout allocated, as `explain` needs)."""
    checked = check_fp8(q, k, v, precision, hadamard, descales)
    resolved = checks.check_scale(scale, q.shape[-1])
    if checked is not None:
        x, out_dtype = fp8.Fp8Inputs(q, k, v, *checked), torch.bfloat16
    elif quantize_now:
        x, out_dtype = (
            fp8_quantize.quantize_fp8(q, k, v, hadamard=hadamard is None or bool(hadamard)),
            q.dtype,
        )
    else:
        x, out_dtype = quantize.outputs(q, k, per_block=True), q.dtype
    return PrefillCall(
        x.q,
        x.k,
        x.v,
        bool(causal),
        resolved,
        bool(return_lse),
        strict,
        descales=tuple(x[3:]),
        out_dtype=out_dtype,
    )
