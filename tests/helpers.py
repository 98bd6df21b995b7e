"""Shared test helpers: fresh random inputs, poisoned outputs, float64 comparisons."""

from __future__ import annotations

import torch

from tunegen.checks import is_aligned16
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import DTYPE_NAMES, Problem, bucket

# Relative error bounds ‖out − ref‖/‖ref‖ against float64, as tight as each dtype allows: the
# probabilities are rounded to the input dtype before the second product, and so is the output.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


# bfloat16 runs on the interpreter too, through the rendering that upcasts tl.dot's operands.
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def randn(*shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output holds NaN: some element was never written"
    return float((out.double() - ref).norm() / ref.norm())


def assert_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(lse).any(), "log-sum-exp holds NaN: some row was never written"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "rows with no visible key must give -inf"
    finite = torch.isfinite(ref)
    if finite.any():
        assert float((lse.double()[finite] - ref[finite]).abs().max()) < LSE_TOL[dtype]


def problem_for(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool, return_lse: bool, varlen: bool = False
) -> Problem:
    if varlen:
        batch, sq, sk = 1, q.shape[0], k.shape[0]
    else:
        batch, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    return Problem(
        family="prefill",
        dtype=DTYPE_NAMES[q.dtype],
        head_dim=q.shape[-1],
        causal=causal,
        num_heads_q=q.shape[-3] if not varlen else q.shape[1],
        num_heads_kv=k.shape[-3] if not varlen else k.shape[1],
        batch=bucket(batch, floor=1),
        seqlen_q=bucket(sq),
        seqlen_k=bucket(sk),
        varlen=varlen,
        return_lse=return_lse,
        aligned=is_aligned16(q, k),
    )


def run_variant(
    variant: prefill.PrefillVariant, q, k, v, *, causal, scale, return_lse=True, varlen_args=None
):
    """Launch one Variant directly, into outputs poisoned with NaN."""
    problem = problem_for(q, k, causal=causal, return_lse=return_lse, varlen=varlen_args is not None)
    kernel = base.build(prefill.FAMILY, variant, problem, gpu_of(q.device))
    out = torch.full_like(q, float("nan"))
    if varlen_args is None:
        lse = torch.full(q.shape[:3], float("nan"), device=q.device) if return_lse else None
        kernel.launch(q, k, v, out, lse, scale)
    else:
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device) if return_lse else None
        kernel.launch(q, k, v, out, lse, scale, *varlen_args)
    return out, lse
