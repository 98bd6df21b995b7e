"""Calibrate the Hopper schedule's register bound for the installed Triton release.

The "ws" constraint (tunegen.kernels.families.prefill_ws.ws_constraint) admits a Variant when its
consumer's tiles (float32 output and scores, the 16-bit P tiles) plus `Release.ws_spare_registers`
fit the registers each consumer thread gets. This compiles offline for sm_90, with no GPU, every
Variant of a set of Problems whose tiles leave between --low and --high registers of that budget,
and reports what ptxas gave each: registers and local memory (spills). The spare registers a
release needs are the fewest that keep every admitted Variant within --spill bytes.

    python benchmarks/ws_registers.py --out benchmarks/results/ws_registers_triton3.9.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys

import triton

from tunegen.kernels.compiler import CompileJob, compile_many
from tunegen.kernels.families import prefill, prefill_ws
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import render

HOPPER = Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda")
PROBLEMS = [  # dtype, head dim, causal, fp8
    ("bfloat16", 64, False, False),
    ("bfloat16", 64, True, False),
    ("bfloat16", 128, False, False),
    ("bfloat16", 128, True, False),
    ("bfloat16", 128, True, True),
    ("bfloat16", 64, False, True),
]


def candidates(low: int, high: int) -> list[tuple[Problem, prefill.PrefillVariant, int]]:
    """(Problem, Variant, registers its tiles leave) for Variants within shared memory whose
    tiles leave between `low` and `high` registers per consumer thread."""
    out = []
    variants = []
    knobs = itertools.product([64, 128], [64, 128], [1, 2, 3], [False, True], [24, 40], [1, 2])
    for bm, bn, c, o, p, ctas in knobs:
        try:
            variants.append(
                prefill.PrefillVariant(
                    schedule="ws",
                    block_m=bm,
                    block_n=bn,
                    consumers=c,
                    overlap=o,
                    producer_regs=p,
                    ctas_per_sm=ctas,
                    pingpong=c > 1,
                    num_stages=2,
                )
            )
        except ValueError:  # combinations the Variant refuses (two programs of several consumers)
            continue
    for dtype, d, causal, fp8 in PROBLEMS:
        problem = Problem("prefill", dtype, d, causal, 16, 4, 2, 4096, 4096, fp8=fp8, return_lse=True)
        for variant in variants:
            left = variant.consumer_regs - prefill_ws.ws_tile_registers(variant, d)
            why = prefill.FAMILY.constraint(variant, problem, HOPPER)
            if why is not None and not why.startswith("registers"):
                continue
            if low <= left <= high:
                out.append((problem, variant, left))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--low", type=int, default=24, help="fewest registers the tiles leave (default 24)")
    parser.add_argument("--high", type=int, default=72, help="most registers the tiles leave (default 72)")
    parser.add_argument("--spill", type=int, default=64, help="local-memory bytes tolerated (default 64)")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: all cores)")
    parser.add_argument("--out", help="CSV of every compile")
    args = parser.parse_args(argv)
    rows = []
    found = candidates(args.low, args.high)
    jobs = [
        CompileJob(
            render(prefill.FAMILY.template, "prefill", v, prefill.FAMILY.features(p, HOPPER)), p.dtype, (9, 0)
        )
        for p, v, _ in found
    ]
    for (problem, variant, left), report in zip(found, compile_many(jobs, args.workers), strict=True):
        rows.append(
            {
                "triton": triton.__version__,
                "dtype": "e4m3" if problem.fp8 else problem.dtype,
                "head_dim": problem.head_dim,
                "causal": problem.causal,
                "block_m": variant.block_m,
                "block_n": variant.block_n,
                "consumers": variant.consumers,
                "overlap": variant.overlap,
                "producer_regs": variant.producer_regs,
                "ctas_per_sm": variant.ctas_per_sm,
                "consumer_regs": variant.consumer_regs,
                "left": left,
                "registers": report.registers,
                "local_bytes": report.local_bytes,
                "error": (report.error or "").splitlines()[0][:120] if report.error else "",
            }
        )
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    spilled = sorted({r["left"] for r in rows if (r["local_bytes"] or 0) > args.spill})
    errors = [r for r in rows if r["error"]]
    need = (max(spilled) + 1) if spilled else args.low
    print(
        f"Triton {triton.__version__}: {len(rows)} Variants compiled, {len(errors)} errors; "
        f"spills past {args.spill} bytes where the tiles left {spilled}; spare registers needed: {need}"
    )
    for r in rows:
        if (r["local_bytes"] or 0) > args.spill or r["error"]:
            print("  ", {k: r[k] for k in list(r)[1:]})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
