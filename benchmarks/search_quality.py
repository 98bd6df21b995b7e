"""Search quality: does TPE find (within 3%) the best Variant of the exhaustive grid over the
same space, in at most 30% of the grid's trials? And how long does a tune take?

For each Problem, an exhaustive grid run and a TPE run go to separate databases (neither sees
the other's failures or winners). Writes JSON with every trial, and prints a table.

    python benchmarks/search_quality.py -o results.json [--problems d64,d128,d128c] [--grid-from old.json]

The two winners are then timed again back to back in one process (alternating, longer runs):
two separate timings of the same kernel can differ by a few percent, so only a same-run
comparison says whether TPE's winner is within 3% of the grid's. `--grid-from` reuses the
exhaustive grid of an earlier run of this script (its best Variant is re-timed here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import optuna
import torch

from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning.study import study_name
from tunegen.tuning.trial import evaluate_task
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning.workers import Worker

PROBLEMS = {
    "d64": Problem("prefill", "bfloat16", 64, False, 32, 32, 4, 4096, 4096),
    "d128": Problem("prefill", "bfloat16", 128, False, 16, 16, 4, 4096, 4096),
    "d128c": Problem("prefill", "bfloat16", 128, True, 16, 16, 1, 16384, 16384),
}


def valid_grid(problem: Problem, gpu) -> int:
    """How many distinct Variants of the Problem's (conditional) space pass the constraints."""
    family = get(problem.family)
    space = family.search_space(problem, gpu)
    return sum(family.constraint(v, problem, gpu) is None for v in base.grid(family, space))


def trials_of(url: str, name: str) -> list[dict]:
    study = optuna.load_study(study_name=name, storage=url)
    return [{"number": t.number, "state": t.state.name, "ms": t.value, **t.user_attrs} for t in study.trials]


def same_run(problem: Problem, a: dict, b: dict, rounds: int = 3) -> tuple[float, float]:
    """Median times of Variants `a` and `b`, alternating in one worker process."""
    worker = Worker(interpret=False)
    times: dict[int, list[float]] = {0: [], 1: []}
    try:
        for _ in range(rounds):
            for i, variant in enumerate((a, b)):
                payload = {
                    "problem": problem.as_dict(),
                    "variant": json.dumps(variant, sort_keys=True),
                    "backend": "cuda",
                    "seed": 1,
                    "rep_ms": 400.0,
                }
                result = worker.call(evaluate_task, payload, 300)
                assert result["status"] == "ok", result
                times[i].append(result["ms"])
    finally:
        worker.close()
    return sorted(times[0])[rounds // 2], sorted(times[1])[rounds // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", default="d64,d128,d128c")
    ap.add_argument("--fraction", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--grid-from", default=None, help="JSON files of earlier runs whose grid rows to reuse")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    earlier = {}
    for path in args.grid_from.split(",") if args.grid_from else []:
        with open(path) as fh:
            earlier.update({r["problem"]: r for r in json.load(fh)["rows"]})
    gpu = cuda_gpu(torch.cuda.current_device())
    folder = tempfile.mkdtemp(prefix="search-quality-")
    report = []
    for key in args.problems.split(","):
        problem = PROBLEMS[key]
        grid_n = valid_grid(problem, gpu)
        budget = math.floor(args.fraction * grid_n)
        row = {"problem": key, **problem.as_dict(), "grid_variants": grid_n, "tpe_budget": budget}
        runs = [("tpe", budget)]
        if key in earlier:
            row["grid"] = {**earlier[key]["grid"], "reused_from": args.grid_from}
        else:
            runs.insert(0, ("grid", grid_n))
        for sampler, trials in runs:
            url = f"sqlite:///{folder}/{key}-{sampler}.db"
            options = TuneOptions(trials=trials, sampler=sampler, seed=0, workers=args.workers, url=url)
            with Tuner(gpu, options) as tuner:
                outcome = tuner.tune(problem)
            w = outcome.winner
            row[sampler] = {
                "ms": w.median_ms if w else None,
                "tflops": w.tflops if w else None,
                "variant": w.variant if w else None,
                "evaluated": outcome.evaluated,
                "failed": outcome.failed,
                "found_at": outcome.found_at,
                "wall_s": outcome.wall_s,
                "peer": w.peer_name if w else None,
                "peer_ms": w.peer_ms if w else None,
                "trials": trials_of(url, study_name(gpu, problem, sampler)),
            }
            print(
                f"{key} {sampler}: {row[sampler]['tflops']:.0f} TFLOP/s after {outcome.evaluated} trials "
                f"(best found at {outcome.found_at}), {outcome.wall_s:.0f} s",
                flush=True,
            )
        row["tpe_over_grid"] = row["tpe"]["ms"] / row["grid"]["ms"]
        grid_ms, tpe_ms = same_run(problem, row["grid"]["variant"], row["tpe"]["variant"])
        row["same_run"] = {
            "grid_ms": grid_ms,
            "tpe_ms": tpe_ms,
            "tpe_over_grid": tpe_ms / grid_ms,
            "same_variant": row["grid"]["variant"] == row["tpe"]["variant"],
        }
        report.append(row)
        with open(args.output, "w") as fh:
            json.dump(
                {"gpu": gpu.name, "triton": gpu.triton_version, "torch": gpu.torch_version, "rows": report},
                fh,
                indent=1,
            )
    print(
        f"{'problem':8} {'grid':>6} {'best':>6} {'tpe n':>6} {'tpe':>6} {'tpe/grid':>9} {'same-run':>9} "
        f"{'same?':>6} {'found@':>7} "
        f"{'grid s':>7} {'tpe s':>6}"
    )
    for r in report:
        print(
            f"{r['problem']:8} {r['grid_variants']:6d} {r['grid']['tflops']:6.0f} {r['tpe']['evaluated']:6d} "
            f"{r['tpe']['tflops']:6.0f} {r['tpe_over_grid']:9.3f} {r['same_run']['tpe_over_grid']:9.3f} "
            f"{r['same_run']['same_variant']!s:>6} {r['tpe']['found_at']!s:>7} "
            f"{r['grid']['wall_s']:7.0f} {r['tpe']['wall_s']:6.0f}"
        )


if __name__ == "__main__":
    main()
