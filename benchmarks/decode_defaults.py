"""Pick the default decode Variants for this GPU class: check and time a grid of decode Variants
(key tile, warps, pipeline stages, splits around the default's) on `tunegen bench decode`'s
Problems, the current default among them.

Per Problem, one full cache of random tokens (contiguous, or in shuffled pages) on the GPU; each
Variant's output, poisoned first, is checked against SDPA's float32 math on the same tokens
(within bf16's bound); the Variants that passed are then timed together in interleaved rounds
(sweep.py; L2 flushed, median). Writes every row and prints, per Problem, the default's GB/s
beside the best Variant's.

    python benchmarks/decode_defaults.py --batches 1,16,64 --cache-lengths 4096,32768 -o d.json

With `--window LEFT`, every Problem takes a sliding window of LEFT keys before the query's (issue
32: decode reads only the window's pages), its reference the window's keys only, and the splits
swept reach four times the default's. With `--fp8`, the cache is e4m3 with descales per (sequence,
KV head) (`KVCache`'s FP8 layout), the reference SDPA on its dequantized tokens, and the key tiles
swept reach 256 (an e4m3 tile of 128 keys moves the bytes of a bf16 tile of 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json

import torch
import triton
from sweep import time_in_rounds

from tunegen.kernels import fp8
from tunegen.kernels.families import base, decode
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import DecodeArgs
from tunegen.kernels.reference import TOLERANCE
from tunegen.measure.suites import decode_suite
from tunegen.tuning.timing import rate

TILES = list(itertools.product((64, 128), (4, 8), (2, 3, 4)))  # block_n, num_warps, num_stages


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def candidates(problem, gpu) -> list[decode.DecodeVariant]:
    """The default, then every tile with the default's split count, half and double it, and none
    (and for an e4m3 cache, key tiles of 256 too)."""
    default = decode.FAMILY.default_variant(problem, gpu)
    wider = (2, 4) if problem.local else (2,)
    n = default.num_splits
    splits = sorted({1, max(1, n // 2), n, *(min(64, n * w) for w in wider)})
    out = [default]
    tiles = TILES + list(itertools.product((256,), (4, 8), (2, 3))) if problem.fp8 else TILES
    for (block_n, warps, stages), n in itertools.product(tiles, splits):
        variant = dataclasses.replace(
            default, block_n=block_n, num_warps=warps, num_stages=stages, num_splits=n
        )
        if variant not in out and decode.FAMILY.constraint(variant, problem, gpu) is None:
            out.append(variant)
    return out


def inputs(problem, gen):
    """q, the cache (as the kernel takes it), its lengths and block table, its descales (an e4m3
    cache's, else None), and the reference."""
    b, n, hq, hkv, d = (
        problem.batch,
        problem.seqlen_k,
        problem.num_heads_q,
        problem.num_heads_kv,
        problem.head_dim,
    )
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    keys, values = (
        torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )
    descales = None
    if problem.fp8:
        descales = tuple(fp8.calibrate_kv(x, 1.0) for x in (keys, values))
        keys, values = (fp8.quantize_kv(x, s) for x, s in zip((keys, values), descales, strict=True))
        seen = [x.float() * s[:, None, :, None] for x, s in zip((keys, values), descales, strict=True)]
    else:
        seen = [keys, values]
    first = max(0, n - 1 - problem.window_left) if problem.window_left >= 0 else 0  # the window's
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        seen[0][:, first:].transpose(1, 2).float(),
        seen[1][:, first:].transpose(1, 2).float(),
        enable_gqa=True,
    ).transpose(1, 2)
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    table = None
    if problem.paged:
        page = problem.page_size
        order = torch.randperm(b * (n // page), device="cuda", generator=gen)
        table = order.view(b, n // page).to(torch.int32)
        paged = []
        for x in (keys, values):
            cache = torch.empty((b * (n // page), page, hkv, d), device="cuda", dtype=x.dtype)
            cache[order] = x.reshape(-1, page, hkv, d)
            paged.append(cache)
        keys, values = paged
    return q, keys, values, seqlens, table, descales, ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--cache-lengths", type=ints, default=[4096, 32768])
    ap.add_argument("--page-sizes", type=ints, default=[0, 64])
    ap.add_argument("--window", type=int, default=-1, help="a window of this many keys before the query's")
    ap.add_argument("--fp8", action="store_true", help="an e4m3 cache")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    gpu = cuda_gpu(0)
    meta = {
        "gpu": gpu.name,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    rows = []
    window = (args.window, -1)
    for problem in decode_suite(
        args.batches, args.cache_lengths, page_sizes=args.page_sizes, window_size=window
    ):
        problem = dataclasses.replace(problem, fp8=args.fp8)
        unit, work = decode.FAMILY.measure(problem)
        gen = torch.Generator("cuda").manual_seed(0)
        q, keys, values, seqlens, table, descales, ref = inputs(problem, gen)
        tensors = (q, keys, values, seqlens)
        out = torch.empty_like(q)
        scale = problem.head_dim**-0.5
        timed = []
        for i, variant in enumerate(candidates(problem, gpu)):
            row = {**problem.as_dict(), "variant": variant.as_dict(), "default": i == 0}
            try:
                kernel = base.build(decode.FAMILY, variant, problem, gpu)
                k_descale, v_descale = descales or (None, None)
                call = DecodeArgs(*tensors, out, None, scale, table, k_descale=k_descale, v_descale=v_descale)
                launch = functools.partial(kernel.launch, call)
                out.fill_(float("nan"))
                launch()
                row["rel_err"] = err = float((out.float() - ref).norm() / ref.norm())
                if not err <= TOLERANCE["bfloat16"]:
                    row["note"] = f"wrong: {err:.2e}"
                else:
                    timed.append((row, launch))
            except Exception as exc:  # a Variant that fails to build or run is a result
                row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            rows.append(row)
        time_in_rounds(timed)
        for row, _ in timed:
            row["gbps"] = rate(unit, work, row["ms"])
        mine = [row for row, _ in timed]
        del q, keys, values, ref, out, tensors, timed
        torch.cuda.empty_cache()
        best = max(mine, key=lambda r: r["gbps"])
        default = next((r for r in mine if r["default"]), None)
        knobs = {k: best["variant"][k] for k in ("block_n", "num_warps", "num_stages", "num_splits")}
        was = default["gbps"] if default else float("nan")
        print(
            f"B={problem.batch:3} cache={problem.seqlen_k:6} page={problem.page_size:3} "
            f"window={args.window}  "
            f"default {was:7.0f} GB/s  best {best['gbps']:7.0f} GB/s  {knobs}",
            flush=True,
        )
        if args.output:  # after every Problem: a run cut short keeps what it measured
            with open(args.output, "w") as fh:
                json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
