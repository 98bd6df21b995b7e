"""`tunegen doctor`: what this machine runs, which database it reads, which winners it has for
this GPU, which stored rows it cannot serve and why, which are stale, and where dispatch would
fall back to nearest buckets or defaults: for each family (FP8 prefill and decode apart) with a
Winner for this GPU, prefill where none has."""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import torch
import triton

from tunegen.kernels import releases, snapshot
from tunegen.kernels.database import database_url, gpu_record, open_store, unusable
from tunegen.kernels.dispatch import select
from tunegen.kernels.families import get
from tunegen.kernels.families.base import unrendered
from tunegen.kernels.gpu import Gpu, cuda_gpu, driver_version, interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning.presets import PRESETS, problems
from tunegen.tuning_db import TuningDbError, head_revision, shipped_store

# `tunegen tune`'s default sequence lengths and decode batch sizes: each suite below counts, for
# every preset's layer kinds and causal and not, the Problems that `tunegen tune --family F [--fp8]`
# tunes.
SEQLENS = (1024, 4096, 16384)
BATCHES = (1, 16, 64)
_NS = ", ".join(map(str, SEQLENS))
_BS = ", ".join(map(str, BATCHES))


@dataclasses.dataclass(frozen=True)
class Suite:
    """The preset Problems of one family (FP8 apart) whose dispatch doctor counts, and how the
    report names them: `label` says what the family is, `description` which shapes."""

    family: str
    fp8: bool
    label: str
    description: str

    def problems(self) -> list[Problem]:
        """Every preset's Problems for this family (one per layer kind its templates render: the
        tuner skips the others and no call reaches dispatch with them), causal and not where the
        family has both."""
        models = list(PRESETS.values())
        every = problems(
            models, causal=(False, True), seqlens=SEQLENS, batches=BATCHES, family=self.family, fp8=self.fp8
        )
        return [p for p in every if unrendered(get(self.family), p) is None]


# By the key a Winner's family and FP8 flag give (`family_key`), in the order the report lists them.
SUITES = {
    "prefill": Suite("prefill", False, "prefill", f"every preset, causal and not, N = {_NS}, bf16"),
    "decode": Suite("decode", False, "decode", f"every preset, B = {_BS}, cache length {_NS}, bf16"),
    "backward": Suite(
        "backward", False, "backward", f"every preset's layers it renders, causal and not, N = {_NS}, bf16"
    ),
    "prefill-fp8": Suite(
        "prefill", True, "FP8 prefill (e4m3 inputs, bf16 output)", f"every preset, causal and not, N = {_NS}"
    ),
    "decode-fp8": Suite(
        "decode",
        True,
        "decode over an e4m3 KV cache",
        f"every preset, B = {_BS}, cache length {_NS}, bf16 queries",
    ),
}


def family_key(problem: dict[str, Any]) -> str:
    """The suite a Problem (as a dict) belongs to: its family, with "-fp8" for FP8 ones."""
    return problem["family"] + ("-fp8" if problem.get("fp8") else "")


def current_gpu() -> Gpu:
    """The GPU dispatch serves here (the interpreter's stand-in without CUDA)."""
    return cuda_gpu(torch.cuda.current_device()) if torch.cuda.is_available() else interpreter_gpu()


def report(url: str | None = None) -> dict[str, Any]:
    """Everything doctor knows, as plain data."""
    gpu = current_gpu()
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_checked": releases.INSTALLED.checked,
        "interpreter": releases.interpreter_problem(),
        "cuda": torch.version.cuda,
        "driver": driver_version() if gpu.backend == "cuda" else None,
        "gpu": {
            "name": gpu.name,
            "capability": list(gpu.capability),
            "sm_count": gpu.sm_count,
            "smem_per_block": gpu.smem_per_block,
            "backend": gpu.backend,
        },
        "database": {"url": database_url(url), "schema": None, "head": head_revision(), "error": None},
    }
    record = gpu_record(gpu)
    try:
        with open_store(url, readonly=True) as store:
            out["database"]["schema"] = None if store.empty else store.revision()
            stored = store.winners(gpu=record)
            out["database"]["winners"] = len(store.winners())
    except TuningDbError as exc:
        out["database"]["error"] = str(exc)
        stored = []
    reasons = {w.id: unusable(w) for w in stored}
    mine = [w for w in stored if reasons[w.id] is None]
    out["unusable"] = [
        {"id": w.id, "family": w.family, "problem": w.problem, "reason": reasons[w.id]}
        for w in stored
        if reasons[w.id] is not None
    ]
    shipped = shipped_store().winners(gpu=record)
    out["winners_for_this_gpu"] = {"user": len(mine), "shipped": len(shipped)}
    out["stale"] = [
        {"family": w.family, "problem": w.problem, "triton_version": w.triton_version, "source": source}
        for source, group in (("user", mine), ("shipped", shipped))
        for w in group
        if w.triton_version != gpu.triton_version
    ]
    winners = snapshot.Snapshot(tuple(mine), tuple(shipped), out["database"]["error"])
    out["dispatch"] = dispatch(winners, gpu)
    # Prefill's counts where they were before doctor covered every family, for the scripts that read them.
    out["coverage"] = out["dispatch"].get("prefill") or coverage(SUITES["prefill"], winners, gpu)
    return out


def dispatch(winners: snapshot.Snapshot, gpu: Gpu) -> dict[str, dict[str, Any]]:
    """For each suite with a Winner among `winners` (this GPU's: the user's and shipped), or for
    prefill alone where there are none, how many of its Problems dispatch would serve from a
    Winner, a nearest bucket or a default (see `coverage`)."""
    present = {family_key(w.problem) for w in (*winners.user, *winners.shipped)}
    keys = [key for key in SUITES if key in present] or ["prefill"]
    return {key: coverage(SUITES[key], winners, gpu) for key in keys}


def coverage(suite: Suite, winners: snapshot.Snapshot, gpu: Gpu) -> dict[str, Any]:
    """How `suite`'s Problems fare among `winners` on `gpu`, by dispatch's own rule (`select`): a
    Winner for exactly the Problem, else a usable nearest bucket, else the default Variant; with
    the label, the suite's description and the Problems that get the default."""
    kinds: dict[str, list[dict[str, Any]]] = {"winner": [], "nearest": [], "default": []}
    for problem in suite.problems():
        kinds[select(problem, gpu, winners).source].append(problem.as_dict())
    return {
        "label": suite.label,
        "suite": suite.description,
        **{kind: len(found) for kind, found in kinds.items()},
        "falls_back": kinds["default"],
    }


def render_text(r: dict[str, Any]) -> str:
    """The report as lines a person reads."""
    g, db = r["gpu"], r["database"]
    if g["backend"] == "cuda":
        arch = f"sm_{g['capability'][0]}{g['capability'][1]}"
        gpu = f"{g['name']} ({arch}, {g['sm_count']} SMs, driver {r['driver']})"
    else:
        gpu = "none: CPU tensors run under Triton's interpreter (TRITON_INTERPRET=1), else PyTorch's fallback"
    lines = [
        f"GPU        {gpu}",
        f"versions   python {r['python']}, torch {r['torch']}, triton {r['triton']}, CUDA {r['cuda']}",
    ]
    if not r["triton_checked"]:
        lines.append(f"           Triton: not a release tunegen is checked on ({releases.checked_range()})")
    if r["interpreter"]:
        lines.append(f"           interpreter: {r['interpreter']}")
    lines.append(f"database   {db['url']}")
    if db["error"]:
        lines.append(f"           ERROR: {db['error']}")
    else:
        schema = db["schema"] or "not created yet"
        lines.append(
            f"           schema {schema} (this release: {db['head']}), {db.get('winners', 0)} winners in all"
        )
    w = r["winners_for_this_gpu"]
    lines.append(f"winners    {w['user']} for this GPU in the database, {w['shipped']} shipped with tunegen")
    if r["unusable"]:
        lines.append(f"unusable   {len(r['unusable'])} stored rows this tunegen cannot serve (skipped):")
        lines += [f"           - id {u['id']} {u['family']}: {u['reason']}" for u in r["unusable"]]
    if r["stale"]:
        lines.append(
            f"stale      {len(r['stale'])} tuned under another Triton (used, with a warning; re-tune):"
        )
        lines += [
            f"           - {s['family']} {s['problem']} (Triton {s['triton_version']}, {s['source']})"
            for s in r["stale"]
        ]
    else:
        lines.append("stale      none")
    for i, cov in enumerate(r["dispatch"].values()):
        lines.append(
            f"{'dispatch' if i == 0 else '':<11}{cov['label']}, {cov['suite']}: {cov['winner']} tuned, "
            f"{cov['nearest']} nearest bucket, {cov['default']} default Variant"
        )
    return "\n".join(lines)
