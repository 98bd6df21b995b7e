"""The prefill family's tuning case: inputs, launch, float64 check, SDPA peers."""

from __future__ import annotations

import torch

from tunegen.families.base import Case, Kernel
from tunegen.problem import TORCH_DTYPES, Problem
from tunegen.reference import attention_reference, sampled_error

FULL_REFERENCE_LIMIT = 2**22  # score elements: above this, check sampled rows


def prefill_case(problem: Problem, kernel: Kernel | None, device: torch.device, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[problem.dtype]
    b, nq, nk, d = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.head_dim
    q, k, v = (
        torch.randn(b, h, n, d, generator=gen).to(device, dtype)
        for h, n in ((problem.num_heads_q, nq), (problem.num_heads_kv, nk), (problem.num_heads_kv, nk))
    )
    scale = d**-0.5

    def error_of(out: torch.Tensor) -> float:
        if torch.isnan(out).any():
            return float("nan")
        if b * problem.num_heads_q * nq * nk <= FULL_REFERENCE_LIMIT:
            ref, _ = attention_reference(q, k, v, causal=problem.causal, scale=scale)
            return float((out.double() - ref).norm() / ref.norm())
        return sampled_error(out, q, k, v, causal=problem.causal, scale=scale, rows=128, generator=gen)

    out = torch.full_like(q, float("nan"))
    launch = lse = None
    if kernel is not None and problem.varlen:
        packed = [t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (q, k, v, out)]
        cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * nk, nk, dtype=torch.int32, device=device)
        if problem.return_lse:
            lse = torch.full((problem.num_heads_q, b * nq), float("nan"), device=device)
        launch = lambda: kernel.launch(*packed, lse, scale, cu_q, cu_k, nq)
        out = packed[3].view(b, nq, problem.num_heads_q, d).transpose(1, 2)
    elif kernel is not None:
        if problem.return_lse:
            lse = torch.full((b, problem.num_heads_q, nq), float("nan"), device=device)
        launch = lambda: kernel.launch(q, k, v, out, lse, scale)

    def error() -> float:
        if lse is not None and torch.isnan(lse).any():
            return float("nan")
        return error_of(out)

    peers = {}
    if device.type == "cuda" and not problem.varlen:
        from tunegen import peers as peer_impls

        for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
            fn = peer_impls.sdpa(name, problem.causal)
            peers[name] = lambda fn=fn: fn(q, k, v)
    return Case(launch=launch, error=error, peers=peers, peer_error=error_of)
