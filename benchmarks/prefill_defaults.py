"""Pick the default prefill Variants for this GPU class: verify and time a small grid of
hand-chosen Variants per (head dim, causal) on the bf16 suite at one sequence length.

Compiles every Variant in parallel worker processes first (Triton's cache is shared on disk),
then checks each against float64 on sampled rows and times it on the GPU, one after another.

    python benchmarks/prefill_defaults.py --seqlen 4096 -o results.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import itertools
import json
import multiprocessing as mp

import torch

from tunegen.bench import prefill_suite
from tunegen.families import base, prefill
from tunegen.gpu import cuda_gpu
from tunegen.reference import sampled_error
from tunegen.timing import median_ms

TILES = {
    64: [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (256, 64, 8, 3),
    ],
    128: [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 8, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (128, 128, 4, 2),
    ],
    256: [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 8, 2),
        (64, 64, 4, 2),
        (128, 32, 4, 2),
        (64, 32, 4, 3),
        (128, 128, 8, 2),
    ],
}


def candidates(head_dim: int, causal: bool) -> list[prefill.PrefillVariant]:
    orders = [("head_inner", True), ("m_inner", False)] if causal else [("m_inner", False)]
    out = []
    for (bm, bn, w, s), load, (order, rev) in itertools.product(TILES[head_dim], ("desc", "ptr"), orders):
        out.append(
            prefill.PrefillVariant(
                block_m=bm, block_n=bn, num_warps=w, num_stages=s, load=load, order=order, reverse_m=rev
            )
        )
    return out


def _inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
    return mk(shape.heads), mk(shape.kv_heads), mk(shape.kv_heads), gen


def _compile(args):
    shape, variant_json = args
    variant = prefill.PrefillVariant.from_json(variant_json)
    try:
        gpu = cuda_gpu(0)
        kernel = base.build(prefill.FAMILY, variant, shape.problem("bfloat16"), gpu)
        q, k, v, _ = _inputs(shape)
        kernel.launch(q, k, v, torch.empty_like(q), None, 0.1)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    dims = [int(x) for x in args.head_dims.split(",")]
    shapes = prefill_suite((args.seqlen,), dims)
    jobs = [(s, v.to_json()) for s in shapes for v in candidates(s.head_dim, s.causal)]
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
        compile_errors = dict(zip(range(len(jobs)), pool.map(_compile, jobs), strict=False))
    gpu = cuda_gpu(0)
    results = []
    for i, (shape, vj) in enumerate(jobs):
        variant = prefill.PrefillVariant.from_json(vj)
        rec = {
            "shape": shape.__dict__,
            "variant": variant.as_dict(),
            "ms": None,
            "tflops": None,
            "err": None,
            "note": compile_errors[i] or "",
        }
        if not rec["note"]:
            try:
                kernel = base.build(prefill.FAMILY, variant, shape.problem("bfloat16"), gpu)
                q, k, v, gen = _inputs(shape)
                out = torch.full_like(q, float("nan"))
                scale = shape.head_dim**-0.5
                kernel.launch(q, k, v, out, None, scale)
                rec["err"] = sampled_error(out, q, k, v, causal=shape.causal, scale=scale, generator=gen)
                if rec["err"] < 2e-2:
                    run = functools.partial(kernel.launch, q, k, v, out, None, scale)
                    rec["ms"] = median_ms(run, warmup_ms=25, rep_ms=100)
                    rec["tflops"] = shape.problem("bfloat16").flops() / rec["ms"] / 1e9
                else:
                    rec["note"] = "wrong"
            except Exception as exc:
                rec["note"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(rec)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"gpu": gpu.name, "seqlen": args.seqlen, "results": results}, fh, indent=1)
    best: dict = {}
    for r in results:
        key = (r["shape"]["head_dim"], r["shape"]["causal"])
        if r["tflops"] and (key not in best or r["tflops"] > best[key]["tflops"]):
            best[key] = r
    failed = [r for r in results if r["note"]]
    print(f"{len(results)} variants, {len(failed)} failed or wrong")
    for r in failed[:10]:
        print("  ", r["variant"], r["note"][:150])
    for key, r in sorted(best.items()):
        v = r["variant"]
        top = sorted(
            (x for x in results if (x["shape"]["head_dim"], x["shape"]["causal"]) == key and x["tflops"]),
            key=lambda x: -x["tflops"],
        )[:4]
        print(
            f"D={key[0]} causal={key[1]}: "
            + " | ".join(
                f"{x['tflops']:.0f} {x['variant']['load']} "
                f"{x['variant']['block_m']}x{x['variant']['block_n']} "
                f"w{x['variant']['num_warps']} s{x['variant']['num_stages']} {x['variant']['order'][:1]}"
                f"{'r' if x['variant']['reverse_m'] else ''}"
                for x in top
            )
        )


if __name__ == "__main__":
    main()
