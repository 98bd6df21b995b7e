"""The decode family's tuning case: a full cache of random tokens (contiguous, or paged in
shuffled pages), launch, float64 check, SDPA peers for one-token decode on contiguous caches.
An fp8 cache holds the tokens quantized per (sequence, KV head); the check and the peers use
the dequantized values. A Problem with the features of current models runs them as its model
would (the prefill case's cap, a random sink logit per head), checked with the same window, chunk,
cap and sinks; SDPA, which takes none of them, times nothing beside it."""

from __future__ import annotations

import torch

from tunegen.kernels import fp8
from tunegen.kernels.families.base import Case, Kernel, case_features, generator, normal
from tunegen.kernels.launch_args import DecodeArgs
from tunegen.kernels.problem import TORCH_DTYPES, Problem
from tunegen.kernels.reference import attention_reference


def decode_case(problem: Problem, kernel: Kernel | None, device: torch.device, seed: int) -> Case:
    # Drawn on the device: a 32k-token cache for batch 64 is 2 G values, minutes on the host.
    gen = generator(device, seed)
    dtype = TORCH_DTYPES[problem.dtype]
    b, nq, length, d = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.head_dim
    hq, hkv = problem.num_heads_q, problem.num_heads_kv
    q = normal((b, nq, hq, d), gen, device).to(dtype)
    keys = normal((b, length, hkv, d), gen, device, dtype)
    values = normal((b, length, hkv, d), gen, device, dtype)
    seqlens = torch.full((b,), length, dtype=torch.int32, device=device)
    table = None
    k_cache, v_cache = keys, values
    descales = ()
    if problem.fp8 and device.type == "meta":  # shapes only
        descales = tuple(torch.empty((b, hkv), device=device) for _ in range(2))
        k_cache, v_cache = (torch.empty_like(x, dtype=fp8.E4M3) for x in (keys, values))
    elif problem.fp8:
        descales = (fp8.calibrate_kv(keys, 1.0), fp8.calibrate_kv(values, 1.0))
        k_cache, v_cache = (fp8.quantize_kv(x, s) for x, s in zip((keys, values), descales, strict=True))
        keys, values = (
            (x.float() * s[:, None, :, None]).to(dtype)
            for x, s in zip((k_cache, v_cache), descales, strict=True)
        )
    if problem.paged:
        # Whole pages: a page that does not divide the length (48 into 4096) leaves the end of each
        # sequence's last page unused (zeros).
        page = problem.page_size
        pages = -(-length // page)
        table = torch.randperm(b * pages, generator=gen, device=device).view(b, pages).to(torch.int32)
        contiguous = (k_cache, v_cache)
        k_cache = torch.zeros((b * pages, page, hkv, d), device=device, dtype=k_cache.dtype)
        v_cache = torch.zeros_like(k_cache)
        if device.type != "meta":  # meta tensors hold no tokens to place
            positions = torch.arange(length, device=device)
            slots = (table.long()[:, positions // page] * page + positions % page).flatten()
            for cache, tokens in zip((k_cache, v_cache), contiguous, strict=True):
                cache.view(-1, hkv, d)[slots] = tokens.reshape(-1, hkv, d)
    scale = d**-0.5
    local = case_features(problem, gen, device)
    sinks, softcap = local.pop("sinks"), local["softcap"]

    def error_of(out: torch.Tensor) -> float:
        """‖out − ref‖/‖ref‖ against float64, one sequence at a time (a whole batch of 32k-token
        caches in float64 would not fit)."""
        if torch.isnan(out).any():
            return float("nan")
        diff = norm = 0.0
        for i in range(b):
            one = slice(i, i + 1)
            ref, _ = attention_reference(
                q[one].transpose(1, 2),
                keys[one].transpose(1, 2),
                values[one].transpose(1, 2),
                causal=problem.causal,
                scale=scale,
                sinks=sinks,
                **local,
            )
            ref = ref.transpose(1, 2)
            diff += float((out[one].double() - ref).square().sum())
            norm += float(ref.square().sum())
        return (diff / norm) ** 0.5

    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, nq), float("nan"), device=device) if problem.return_lse else None
    launch = None
    if kernel is not None:
        named = dict(zip(("k_descale", "v_descale"), descales, strict=False))
        args = DecodeArgs(
            q,
            k_cache,
            v_cache,
            seqlens,
            out,
            lse,
            scale,
            block_table=table,
            **named,
            softcap=softcap,
            sinks=sinks,
        )
        launch = lambda: kernel.launch(args)

    def error() -> float:
        if lse is not None and torch.isnan(lse).any():
            return float("nan")
        return error_of(out)

    peers = {}
    if device.type == "cuda" and not problem.paged and nq == 1 and not problem.model_features:
        from tunegen.kernels import peers as peer_impls

        qt, kt, vt = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
            fn = peer_impls.sdpa(name, False)
            peers[name] = lambda fn=fn: fn(qt, kt, vt).transpose(1, 2)
    public = None
    if kernel is not None:
        named = dict(zip(("k_descale", "v_descale"), descales, strict=False))
        public = ((q, k_cache, v_cache, seqlens), {"block_table": table, **named, **local, "sinks": sinks})
    return Case(launch=launch, error=error, peers=peers, peer_error=error_of, public=public)
