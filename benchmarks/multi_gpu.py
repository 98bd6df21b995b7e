"""Tuning on every GPU of a host against tuning on one (issue 18): `tunegen tune --gpus SPEC`
for each SPEC, each from nothing (its own database, Triton cache and kernel cache, so no run
reuses another's compiles), timed by the wall clock, with the run's own timeline of where each
GPU's time went (`--timeline`, kept beside the results); then each Problem's Winners from the runs
re-timed back to back on GPU 0 (interleaved, so that clock drift does not favour one), after a
check against float64 on fresh inputs. Writes JSON and a markdown summary; prints the table.

    python3 multi_gpu.py --preset llama3-8b --runs 1,all -o results/multi_gpu_h200x2
    python3 multi_gpu.py --preset llama3-8b --preset qwen2.5-7b --preset gpt2 -o ...  (9 Problems)

`--repeat N` runs the sequence N times, every other time in reverse order, and adds the median of
each SPEC's walls: a command's start (importing torch) varied by 2 s from run to run on 2 x H200.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.problem import Problem, problem_text
from tunegen.kernels.reference import tolerance
from tunegen.tuning.timeline import STARTING
from tunegen.tuning.timing import interleaved_ms
from tunegen.tuning_db import Store


def tune(spec: str, presets: list[str], work: Path, extra: list[str], label: str) -> dict:
    """One `tunegen tune` run from empty caches (`label`: the run's name among the repeats): its
    wall time, database and log."""
    slug = re.sub(r"[^a-z0-9]+", "_", label.lower())
    db = work / f"tune_gpus_{slug}.db"
    db.unlink(missing_ok=True)
    caches = {"TRITON_CACHE_DIR": work / f"triton_{slug}", "TUNEGEN_CACHE_DIR": work / f"kernels_{slug}"}
    for folder in caches.values():
        shutil.rmtree(folder, ignore_errors=True)
    env = dict(os.environ, **{k: str(v) for k, v in caches.items()})
    trace = work / f"timeline_{slug}.json"
    command = [
        *("tunegen", "tune", *(f"--preset={p}" for p in presets), "--gpus", spec, "--db", f"sqlite:///{db}"),
        *("--timeline", str(trace), *extra),
    ]
    start = time.monotonic()
    written = None  # when the command had written its timeline: what follows is its exit
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        lines = []
        for line in run.stdout:
            lines.append(line)
            if "timeline written to" in line:
                written = time.monotonic() - start
    wall = time.monotonic() - start
    output = "".join(lines)
    (work / f"tune_gpus_{slug}.log").write_text(output)
    print(output[-6000:])
    return {
        "gpus": spec,
        "label": label,
        "command": " ".join(command),
        "wall_s": wall,
        "exit_s": None if written is None else wall - written,
        "exit_code": run.returncode,
        "db": str(db),
        "trace": str(trace),
        "timeline": json.loads(trace.read_text())["summary"] if trace.exists() else [],
        "start_s": _starting(trace),
    }


def _starting(trace: Path) -> float | None:
    """Seconds from the command's start to its ranks' (its imports, the host's devices)."""
    if not trace.exists():
        return None
    events = json.loads(trace.read_text())["traceEvents"]
    return next((e["dur"] / 1e6 for e in events if e.get("name") == STARTING and e["ph"] == "X"), None)


def retime(runs: list[dict], seed: int = 7) -> list[dict]:
    """Each Problem's Winners from every run, checked and then timed interleaved on GPU 0."""
    gpu = cuda_gpu(0)
    winners: dict[str, dict[str, object]] = {}
    for run in runs:
        with Store(f"sqlite:///{run['db']}") as store:
            for w in store.winners():
                winners.setdefault(json.dumps(w.problem, sort_keys=True), {})[run["label"]] = w
    rows = []
    for key, by_run in winners.items():
        problem = Problem(**json.loads(key))
        family = get(problem.family)
        calls, row = {}, {"problem": problem.as_dict(), "runs": {}}
        for spec, w in by_run.items():
            variant = family.variant_type.from_json(json.dumps(w.variant))
            case = family.case(problem, base.build(family, variant, problem, gpu), torch.device("cuda"), seed)
            case.launch()
            torch.cuda.synchronize()
            err = case.error()
            row["runs"][spec] = {"variant": w.variant, "recorded_ms": w.median_ms, "rel_err": err}
            if err <= tolerance(problem):
                calls[spec] = case.launch
        for spec, ms in interleaved_ms(calls, rep_ms=400.0).items():
            row["runs"][spec]["retimed_ms"] = ms
        rows.append(row)
    return rows


# What stopped an asked trial short of the GPU: words of the reasons `Tuner._ask` records.
PRUNED = {
    "constraint:": "constraint",
    "failed before:": "failed before",
    "duplicate of trial": "duplicate",
    "being evaluated as trial": "claimed by another process",
    "were claimed before it": "past the target",
}


def searches(run: dict) -> dict[str, dict]:
    """How each Problem's search went in `run`, from its database: trials asked, evaluated (per
    process), pruned by reason; the best time, the trial that first came within 2% of it, and the
    schedule of the best Variant. What tells one search from another where their Winners differ."""
    url = f"sqlite:///{run['db']}"
    with Store(url) as store:
        problems = {Problem(**w.problem) for w in store.winners()}
    by_digest = {hashlib.sha256(p.to_json().encode()).hexdigest()[:16]: p for p in problems}
    out = {}
    storage = optuna.storages.RDBStorage(url)
    try:
        for name in optuna.study.get_all_study_names(storage):
            problem = by_digest.get(name.rsplit("-", 1)[-1])
            if problem is None:
                continue
            trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
            done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated")]
            best = min(done, key=lambda t: t.value) if done else None
            near = [t.number for t in done if best and t.value <= 1.02 * best.value]
            reasons = [t.user_attrs.get("reason", "") for t in trials if t.state == TrialState.PRUNED]
            pruned = collections.Counter(
                next((v for k, v in PRUNED.items() if k in r), "other") for r in reasons
            )
            owners = collections.Counter(
                t.user_attrs.get("owner") for t in trials if t.user_attrs.get("evaluated")
            )
            out[problem_text(problem.as_dict())] = {
                "asked": len(trials),
                "evaluated": sorted(owners.values(), reverse=True),
                "pruned": dict(pruned),
                "best_ms": best.value if best else None,
                "best_schedule": json.loads(best.user_attrs["variant"]).get("schedule") if best else None,
                "within_2pct_at": min(near) if near else None,
            }
    finally:
        storage.engine.dispose()
    return out


def _search_cell(one: dict | None) -> str:
    if one is None:
        return "-"
    evaluated = "+".join(map(str, one["evaluated"]))
    pruned = f"{one['pruned'].get('duplicate', 0)} / {one['pruned'].get('claimed by another process', 0)}"
    return f"{evaluated}; {pruned}; #{one['within_2pct_at']}; {one['best_schedule']}"


def summary(runs: list[dict], rows: list[dict] | None, device: str) -> str:
    first = runs[0]["gpus"]  # each speedup is over this SPEC's run of the same repeat
    base = {run["repeat"]: run["wall_s"] for run in runs if run["gpus"] == first}
    lines = [
        f"# `tunegen tune --gpus`: {device}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Triton "
        f"{__import__('triton').__version__}. Each run from empty databases and caches.",
        "",
        "| run | wall | speedup over the first | of it: the command's start | its exit |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        parts = [f"{run[k]:.1f} s" if run.get(k) is not None else "-" for k in ("start_s", "exit_s")]
        speedup = base[run["repeat"]] / run["wall_s"]
        lines.append(
            f"| `--gpus {run['label']}` | {run['wall_s']:.1f} s | {speedup:.2f}x | "
            + " | ".join(parts)
            + " |"
        )
    ok = [run for run in runs if run["exit_code"] == 0]  # a failed run's wall says nothing
    if len(base) > 1 and first in {r["gpus"] for r in ok}:
        medians = {
            spec: statistics.median(r["wall_s"] for r in ok if r["gpus"] == spec)
            for spec in dict.fromkeys(r["gpus"] for r in ok)
        }
        lines += ["", "| run | median wall | its speedup |", "| --- | --- | --- |"]
        lines += [f"| `--gpus {k}` | {v:.1f} s | {medians[first] / v:.2f}x |" for k, v in medians.items()]
    lines += [
        "",
        "Where each GPU's time went (the runs' own timelines; seconds):",
        "",
        "| run | GPU | wall | GPU busy | on the GPU | compile workers busy | waiting |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        for row in run["timeline"]:
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["gpu_s_by_kind"].items()))
            waits = ", ".join(f"{k} {v:.0f}" for k, v in row["waits_s"].items() if v >= 0.5) or "-"
            lines.append(
                f"| `--gpus {run['label']}` | {row['gpu']} | {row['wall_s']:.0f} | {row['gpu_busy']:.0%} | "
                f"{kinds} | {row['compile_busy']:.0%} of {row['compile_workers']} | {waits} |"
            )
    specs = [run["label"] for run in runs]
    searched = [run for run in runs if run.get("searches")]
    if searched:
        lines += [
            "",
            "Each search (trials evaluated per process; pruned: duplicate / claimed by another process; the",
            "first trial within 2% of the best; the best Variant's schedule):",
            "",
            "| problem | " + " | ".join(f"`--gpus {r['label']}`" for r in searched) + " |",
            "| --- | " + " | ".join("---" for _ in searched) + " |",
        ]
        for label in searched[0]["searches"]:
            cells = [_search_cell(run["searches"].get(label)) for run in searched]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if rows is None:
        return "\n".join([*lines, "", "Winners not re-timed yet."]) + "\n"
    lines += [
        "",
        "Winners re-timed back to back on GPU 0 (ms, median of interleaved 400 ms runs):",
        "",
        "| problem | " + " | ".join(f"`--gpus {s}`" for s in specs) + " | last / first | same Variant |",
        "| --- | " + " | ".join("---" for _ in specs) + " | --- | --- |",
    ]
    for row in rows:
        label = problem_text(row["problem"])
        times = [row["runs"].get(s, {}).get("retimed_ms") for s in specs]
        cells = [f"{t:.4f}" if t else "-" for t in times]
        ratio = f"{times[-1] / times[0]:.3f}" if times[0] and times[-1] else "-"
        variants = {json.dumps(row["runs"][s]["variant"], sort_keys=True) for s in specs if s in row["runs"]}
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {ratio} | {'yes' if len(variants) == 1 else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="repeatable (default: llama3-8b)")
    parser.add_argument("--runs", default="1,all", help="--gpus values, ';'-separated if they hold commas")
    parser.add_argument(
        "--repeat", type=int, choices=range(1, 11), default=1, metavar="N", help="run the sequence N times"
    )
    parser.add_argument("--work", default="/tmp/multi_gpu")
    parser.add_argument("-o", "--output", required=True, help="results path without extension")
    args, extra = parser.parse_known_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    specs = args.runs.split(";") if ";" in args.runs else args.runs.split(",")
    # Import what a tuning run imports (torch, Triton, Optuna, the tuner) once, so that the first
    # run does not pay alone for a cold page cache, nor for compiling the bytecode of modules
    # installed without it (`pip install --no-compile`), which the runs after it find done: on
    # 2 x H200 (2026-11-26) the first run started 0.3-2.5 s later than the next ones where the
    # wheels had no bytecode, and was not the slowest to start where they had it.
    warm = "import tunegen.cli.main, tunegen.tuning.host, rich.progress"
    subprocess.run([sys.executable, "-c", warm], capture_output=True, check=True)
    runs = []
    for repeat in range(1, args.repeat + 1):
        for spec in specs if repeat % 2 else specs[::-1]:  # every other time in reverse order
            label = spec if args.repeat == 1 else f"{spec} #{repeat}"
            run = tune(spec, args.preset or ["llama3-8b"], work, extra, label)
            run["searches"] = searches(run) if run["exit_code"] == 0 else {}
            runs.append({**run, "repeat": repeat})
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if Path(run["trace"]).exists():
            kept = out.with_name(f"{out.name}_{Path(run['trace']).name}")
            shutil.copyfile(run["trace"], kept)
            run["trace"] = kept.name
    # Written before the Winners are re-timed too: a run cut short there keeps its walls (a
    # tuple of both writes' rows re-timed first, and a timeout there lost the walls, 2026-11-27).
    write(out, runs, None, device)
    write(out, runs, retime([r for r in runs if r["exit_code"] == 0]), device)


def write(out: Path, runs: list[dict], rows: list[dict] | None, device: str) -> None:
    """The results as JSON and the markdown summary (printed too)."""
    document = {"device": device, "runs": runs, "problems": rows}
    out.with_suffix(".json").write_text(json.dumps(document, indent=1))
    text = summary(runs, rows, device)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
