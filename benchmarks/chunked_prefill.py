"""Chunked prefill over a paged cache (`tunegen.attention_varlen` with `block_table` and
`seqused_k`) beside the same call over a contiguous cache.

A serving engine prefills a long prompt a chunk at a time: each new chunk of queries attends to
everything cached before it and to itself (causal, aligned bottom-right), with the keys in pages
of a block table. Rows (bf16, 32 query heads over 8 KV heads): `--batch` sequences, each a chunk of
`--chunk` queries over `--cache` keys, in pages of `--page` rows shuffled through a cache with
spare pages (which hold NaN, so a wrong page shows). Per row: tunegen's default Variant for the
paged Problem and the contiguous one (the packed keys of the same values), FlashAttention-2's loop
over the pages, the Variants of `--variants FILE.json` over the pages, and the public call. Each is
checked once on sampled rows against float64, then all are timed together in interleaved rounds
(sweep.py).

    python benchmarks/chunked_prefill.py --chunk 2048 --cache 16384 --page 64 -o chunked.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
from collections.abc import Callable

import torch
import triton
from sweep import ROUNDS, time_in_rounds

import tunegen
from tunegen.kernels import masks
from tunegen.kernels.families import base, prefill
from tunegen.kernels.families.prefill_paged import paged
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import TOLERANCE, sampled_error

HEADS = (32, 8)


def inputs(batch: int, chunk: int, cache: int, head_dim: int, page: int) -> dict:
    """The chunk's queries (dense and packed), the keys and values (dense, packed, paged), the
    offsets, the block table and the key counts."""
    gen = torch.Generator("cuda").manual_seed(0)
    mk = lambda h, n: torch.randn(batch, h, n, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = mk(HEADS[0], chunk), mk(HEADS[1], cache), mk(HEADS[1], cache)
    k_cache, v_cache, table, seqused = paged(k, v, page, gen)
    pack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], head_dim)
    cu = lambda n: torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda")
    return {
        "dense": (q, k, v),
        "q": pack(q),
        "kv": (pack(k), pack(v)),
        "paged": (k_cache, v_cache, table, seqused),
        "cu_q": cu(chunk),
        "cu_k": cu(cache),
    }


def problem_of(batch: int, chunk: int, cache: int, head_dim: int, page: int) -> Problem:
    """The Problem the public call dispatches the paged call under (page 0: the contiguous one)."""
    features = {"paged": page > 0, "page_size": page}
    return Problem.of(
        family="prefill",
        batch=batch,
        seqlen_q=chunk,
        seqlen_k=cache,
        dtype="bfloat16",
        head_dim=head_dim,
        causal=True,
        num_heads_q=HEADS[0],
        num_heads_kv=HEADS[1],
        varlen=True,
        **features,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--cache", type=int, default=16384)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", default=None, help="JSON file: a list of dicts of PrefillVariant fields")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    b, n, c, d, page = args.batch, args.chunk, args.cache, args.head_dim, args.page
    x = inputs(b, n, c, d, page)
    gpu = gpu_of(torch.device("cuda"))
    scale = d**-0.5
    out = torch.empty_like(x["q"])
    k_cache, v_cache, table, seqused = x["paged"]
    paged_args = PrefillArgs(
        x["q"], k_cache, v_cache, out, None, scale, cu_seqlens_q=x["cu_q"], max_seqlen_q=n
    )
    paged_args.seqused_k, paged_args.block_table = seqused, table
    flat_args = PrefillArgs(x["q"], *x["kv"], out, None, scale, cu_seqlens_q=x["cu_q"], max_seqlen_q=n)
    flat_args.cu_seqlens_k = x["cu_k"]
    p_paged, p_flat = problem_of(b, n, c, d, page), problem_of(b, n, c, d, 0)
    runs: list[tuple[str, object, Problem, PrefillArgs]] = [
        ("tunegen default (paged)", prefill.FAMILY.default_variant(p_paged, gpu), p_paged, paged_args),
        ("tunegen default (contiguous)", prefill.FAMILY.default_variant(p_flat, gpu), p_flat, flat_args),
        ("fa2 default (paged)", prefill.fa2_default(p_paged, gpu), p_paged, paged_args),
    ]
    extra = json.loads(pathlib.Path(args.variants).read_text()) if args.variants else []
    for i, fields in enumerate(extra):  # {"contiguous": true} runs a Variant over the contiguous cache
        over = (p_flat, flat_args) if fields.pop("contiguous", False) else (p_paged, paged_args)
        runs.append((f"variant {i}", prefill.PrefillVariant.from_json(fields), *over))
    # The (row, key) pairs a chunk attends, exactly (a chunk over a longer cache sees more than half).
    flops = 4.0 * b * HEADS[0] * d * masks.attended_pairs(n, c, causal=True)
    q, k, v = x["dense"]
    check_gen = torch.Generator().manual_seed(1)
    results, timed = [], []

    def add(name: str, call: Callable[[], torch.Tensor], variant: object = None) -> None:
        rec = {"impl": name, "variant": variant.as_dict() if variant is not None else None, "ms": None}
        results.append(rec)
        try:
            got = call().view(b, n, HEADS[0], d).transpose(1, 2)
            rec["err"] = sampled_error(got, q, k, v, causal=True, scale=scale, rows=128, generator=check_gen)
        except Exception as exc:  # a Variant that does not build or run is recorded, not fatal
            rec["note"] = f"{type(exc).__name__}: {exc}"[:300]
        if rec.get("err") is not None and rec["err"] < TOLERANCE["bfloat16"]:
            timed.append((rec, call))
        print(f"  {name:32s} err {rec.get('err', float('nan')):.1e} {rec.get('note', '')}", flush=True)

    for name, variant, problem, launch_args in runs:
        try:
            kernel = base.build(prefill.FAMILY, variant, problem, gpu)
        except Exception as exc:
            results.append({"impl": name, "variant": variant.as_dict(), "ms": None, "note": str(exc)[:300]})
            continue
        out.fill_(float("nan"))
        add(name, lambda kernel=kernel, a=launch_args: (kernel.launch(a), a.out)[1].clone(), variant)
    add(
        "tunegen (public, paged)",
        lambda: tunegen.attention_varlen(
            x["q"], k_cache, v_cache, x["cu_q"], None, n, c, causal=True, seqused_k=seqused, block_table=table
        ),
    )
    time_in_rounds(timed, args.rounds)
    for rec, _ in timed:
        rec["tflops"] = flops / rec["ms"] / 1e9
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    meta |= {"measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    meta |= {"batch": b, "chunk": n, "cache": c, "page": page, "head_dim": d, "heads": HEADS}
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps({**meta, "results": results}, indent=1))
    contiguous = next((r.get("tflops") for r in results if r["impl"] == "tunegen default (contiguous)"), None)
    print(f"\nbatch {b}, chunk {n} over {c} keys, page {page}, head dim {d}: TFLOP/s (median)")
    for rec in results:
        t = rec.get("tflops")
        ratio = f"  {t / contiguous:.3f} of contiguous" if t and contiguous else ""
        print(
            f"{rec['impl']:32s} {t:7.0f}{ratio}" if t else f"{rec['impl']:32s}       x  {rec.get('note', '')}"
        )


if __name__ == "__main__":
    sys.exit(main())
