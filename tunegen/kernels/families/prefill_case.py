"""The prefill family's tuning case: inputs, launch, float64 check, SDPA peers.

An fp8 Problem's inputs are quantized with per-block scales; the kernel is checked against
float64 on the dequantized inputs, and the peers run bf16 on those same values. A Problem with the
features of current models runs them as its model would (Gemma 2's cap of 50, a random sink
logit per head), checked against float64 with the same window, chunk, cap and sinks; SDPA,
which takes none of them, times nothing beside it."""

from __future__ import annotations

import torch

from tunegen.kernels import fp8, quantize
from tunegen.kernels.families.base import Case, Kernel, case_features, generator, normal
from tunegen.kernels.families.prefill_paged import paged
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import TORCH_DTYPES, Problem
from tunegen.kernels.reference import attention_reference, sampled_error

FULL_REFERENCE_LIMIT = 2**22  # score elements: above this, check sampled rows


def prefill_case(problem: Problem, kernel: Kernel | None, device: torch.device, seed: int) -> Case:
    gen = generator(device, seed)
    rows = torch.Generator().manual_seed(seed)  # which rows the sampled check takes
    dtype = TORCH_DTYPES[problem.dtype]
    b, nq, nk, d = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.head_dim
    q, k, v = (
        normal((b, h, n, d), gen, device).to(dtype)
        for h, n in ((problem.num_heads_q, nq), (problem.num_heads_kv, nk), (problem.num_heads_kv, nk))
    )
    scale = d**-0.5
    local = case_features(problem, gen, device)
    sinks, softcap = local["sinks"], local["softcap"]
    inputs = (q, k, v)
    if problem.fp8 and device.type == "meta":  # shapes only, laid out as the quantize kernel writes them
        inputs = quantize.outputs(q, k, per_block=True)
    elif problem.fp8:
        inputs = quantize.quantize(q, k, v, hadamard=False, per_block=True)
        q, k, v = (fp8.dequantize(x, s, torch.float32) for x, s in zip(inputs[:3], inputs[3:], strict=True))

    def error_of(out: torch.Tensor) -> float:
        if torch.isnan(out).any():
            return float("nan")
        if b * problem.num_heads_q * nq * nk <= FULL_REFERENCE_LIMIT:
            ref, _ = attention_reference(q, k, v, causal=problem.causal, scale=scale, **local)
            return float((out.double() - ref).norm() / ref.norm())
        return sampled_error(
            out, q, k, v, causal=problem.causal, scale=scale, rows=128, generator=rows, **local
        )

    out = torch.full(q.shape, float("nan"), device=device, dtype=dtype)
    launch = lse = None
    if kernel is not None and problem.varlen:
        packed = [t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (q, k, v, out)]
        cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * nk, nk, dtype=torch.int32, device=device)
        if problem.return_lse:
            lse = torch.full((problem.num_heads_q, b * nq), float("nan"), device=device)
        args = PrefillArgs(
            *packed,
            lse,
            scale,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=nq,
            softcap=softcap,
            sinks=sinks,
        )
        if problem.paged:  # a chunk of nq queries over nk cached keys, in shuffled pages
            args.k, args.v, args.block_table, args.seqused_k = paged(k, v, problem.page_size, gen)
            args.cu_seqlens_k = None
        launch = lambda: kernel.launch(args)
        out = packed[3].view(b, nq, problem.num_heads_q, d).transpose(1, 2)
    elif kernel is not None:
        if problem.return_lse:
            lse = torch.full((b, problem.num_heads_q, nq), float("nan"), device=device)
        descales = dict(zip(("q_descale", "k_descale", "v_descale"), inputs[3:], strict=False))
        args = PrefillArgs(*inputs[:3], out, lse, scale, **descales, softcap=softcap, sinks=sinks)
        launch = lambda: kernel.launch(args)

    def error() -> float:
        if lse is not None and torch.isnan(lse).any():
            return float("nan")
        return error_of(out)

    peers = {}
    if device.type == "cuda" and not problem.varlen and not problem.model_features:
        from tunegen.kernels import peers as peer_impls

        # FP8's V is K-major (see fp8.py); SDPA's fused kernels take only unit-stride rows.
        peer_inputs = tuple(t.to(dtype).contiguous() for t in (q, k, v))
        for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
            fn = peer_impls.sdpa(name, problem.causal)
            peers[name] = lambda fn=fn: fn(*peer_inputs)
    return Case(launch=launch, error=error, peers=peers, peer_error=error_of)
