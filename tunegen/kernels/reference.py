"""Reference attention in PyTorch with explicit masks: the ground truth kernels are checked
against (in float64) and the fallback path when no Triton kernel can run (in float32)."""

from __future__ import annotations

import torch

from tunegen.kernels.masks import local_mask
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
    return local_mask(seqlen_q, seqlen_k, causal=True, device=device)


def _masked_scores(
    scores: torch.Tensor,
    rows: torch.Tensor | None,
    seqlen_q: int,
    *,
    causal: bool,
    window_size: tuple[int, int],
    attention_chunk: int,
    softcap: float,
) -> torch.Tensor:
    """Scaled scores (..., rows, Nk) capped (`c·tanh(s/c)`, before the mask, as FlashAttention and
    Gemma 2 do) and masked to -inf where a key is out of sight; `rows` are the query rows (None:
    all of them)."""
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if not (causal or left >= 0 or right >= 0 or attention_chunk > 0):
        return scores
    sides = {"left": left, "right": right, "chunk": attention_chunk}
    keep = local_mask(seqlen_q, scores.shape[-1], causal=causal, rows=rows, device=scores.device, **sides)
    return scores.masked_fill(~keep, float("-inf"))


def _with_sinks(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp (..., H, rows) with one extra logit per head (gpt-oss's attention sinks):
    the sink takes its share of the probability and sends nothing to the output."""
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (B, H, N, D) tensors with GQA by head groups, computed in `compute_dtype`.

    `window_size`, `attention_chunk`, `softcap` and `sinks` (one logit per query head) follow
    FlashAttention (see `masks`). Returns the output in `compute_dtype` and the natural-log
    log-sum-exp (B, Hq, Nq), the sink included. Rows with no visible key give a zero output and a
    log-sum-exp of the sink (-inf without sinks). Gradients reach the sinks through autograd.
    """
    group = q.shape[1] // k.shape[1]
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=1)
    vc = vc.repeat_interleave(group, dim=1)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    scores = _masked_scores(
        scores,
        None,
        q.shape[2],
        causal=causal,
        window_size=window_size,
        attention_chunk=attention_chunk,
        softcap=softcap,
    )
    lse = _with_sinks(torch.logsumexp(scores, dim=-1), sinks)
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
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (total, H, D) attention, sequence by sequence, each bottom-right aligned on its own
    lengths; log-sum-exp is (Hq, total_q). The keyword arguments are `attention_reference`'s."""
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            if sinks is not None:
                lse[:, q0:q1] = sinks.to(compute_dtype)[:, None]
            continue
        o, s = attention_reference(
            q[q0:q1].transpose(0, 1)[None],
            k[k0:k1].transpose(0, 1)[None],
            v[k0:k1].transpose(0, 1)[None],
            causal=causal,
            scale=scale,
            compute_dtype=compute_dtype,
            window_size=window_size,
            attention_chunk=attention_chunk,
            softcap=softcap,
            sinks=sinks,
        )
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = s[0]
    return out, lse


def gather_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seqused_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged keys and values (num_pages, page_size, kv_heads, head_dim) as packed ones: sequence b's
    `seqused_k[b]` keys, key j from page `block_table[b, j // page_size]` row `j % page_size`, one
    sequence after another (total_k, kv_heads, head_dim), with their int32 offsets cu_seqlens_k
    (batch + 1). What `attention_varlen_reference` takes for a paged call (the reference and the
    PyTorch path), and what tests and benchmarks compare a paged call with."""
    page = k_cache.shape[1]
    lengths = seqused_k.to(torch.int64)
    cu_seqlens_k = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=seqused_k.device)
    cu_seqlens_k[1:] = lengths.cumsum(0)
    total = int(cu_seqlens_k[-1])
    seq = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=seqused_k.device), lengths, output_size=total
    )
    pos = torch.arange(total, device=seqused_k.device) - cu_seqlens_k[seq]
    pages = block_table[seq, pos // page].long().to(k_cache.device)
    rows = (pos % page).to(k_cache.device)
    return k_cache[pages, rows], v_cache[pages, rows], cu_seqlens_k.to(torch.int32)


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
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> float:
    """Relative error ‖out − ref‖/‖ref‖ of a (B, H, N, D) output on randomly sampled query rows of
    one random batch entry, against float64: a check that stays cheap at any sequence length. The
    last four keyword arguments are `attention_reference`'s."""
    batch, _, seqlen_q, _ = q.shape
    b = int(torch.randint(batch, (1,), generator=generator))
    idx = torch.randperm(seqlen_q, generator=generator)[: min(rows, seqlen_q)].to(q.device)
    group = q.shape[1] // k.shape[1]
    qs = q[b][:, idx].double()
    ks = k[b].double().repeat_interleave(group, 0)
    vs = v[b].double().repeat_interleave(group, 0)
    scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    scores = _masked_scores(
        scores,
        idx,
        seqlen_q,
        causal=causal,
        window_size=window_size,
        attention_chunk=attention_chunk,
        softcap=softcap,
    )
    if sinks is None:
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    else:
        lse = _with_sinks(torch.logsumexp(scores, dim=-1), sinks.double())
        probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    ref = torch.matmul(probs, vs)
    got = out[b][:, idx].double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))
