"""Reference attention in PyTorch with explicit masks: the ground truth kernels are checked
against (in float64) and the fallback path when no Triton kernel can run (in float32)."""

from __future__ import annotations

import torch

from tunegen.kernels.problem import Problem

# The relative error ‖out − ref‖/‖ref‖ against float64 a kernel may show and still be trusted,
# per input dtype: the probabilities are rounded to it before the second product, and so is the
# output. float32 runs its products in IEEE float32.
TOLERANCE = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 1e-4}
# FP8 prefill rounds P to e4m3 (3 mantissa bits) before the second product: about 2.5% on
# random inputs against float64 on the e4m3 inputs it was given. (An fp8 cache is widened
# exactly, so fp8 decode keeps its query dtype's bound.)
FP8_TOLERANCE = 4e-2


def tolerance(problem: Problem) -> float:
    """The relative error a kernel for `problem` may show against float64 on the inputs it got."""
    if problem.fp8 and problem.family == "prefill":
        return FP8_TOLERANCE
    return TOLERANCE[problem.dtype]


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask (True = attend): row i sees key j iff j <= i + Nk - Nq."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (B, H, N, D) tensors with GQA by head groups, computed in `compute_dtype`.

    Returns the output in `compute_dtype` and the natural-log log-sum-exp (B, Hq, Nq). Rows with
    no visible key give a zero output and a log-sum-exp of -inf.
    """
    group = q.shape[1] // k.shape[1]
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=1)
    vc = vc.repeat_interleave(group, dim=1)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.matmul(probs, vc), lse


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (total, H, D) attention, sequence by sequence; log-sum-exp is (Hq, total_q)."""
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        o, s = attention_reference(
            q[q0:q1].transpose(0, 1)[None],
            k[k0:k1].transpose(0, 1)[None],
            v[k0:k1].transpose(0, 1)[None],
            causal=causal,
            scale=scale,
            compute_dtype=compute_dtype,
        )
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = s[0]
    return out, lse


def sampled_error(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    rows: int = 64,
    generator: torch.Generator | None = None,
) -> float:
    """Relative error ‖out − ref‖/‖ref‖ of a (B, H, N, D) output on randomly sampled query rows of
    one random batch entry, against float64: a check that stays cheap at any sequence length."""
    batch, _, seqlen_q, _ = q.shape
    b = int(torch.randint(batch, (1,), generator=generator))
    idx = torch.randperm(seqlen_q, generator=generator)[: min(rows, seqlen_q)].to(q.device)
    group = q.shape[1] // k.shape[1]
    qs = q[b][:, idx].double()
    ks = k[b].double().repeat_interleave(group, 0)
    vs = v[b].double().repeat_interleave(group, 0)
    scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    if causal:
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        scores = scores.masked_fill(~(cols <= idx[:, None] + (k.shape[2] - seqlen_q)), float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    ref = torch.matmul(probs, vs)
    got = out[b][:, idx].double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))
