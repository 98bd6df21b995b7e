"""`tunegen doctor`: what this machine runs, which database it reads, which winners it has for
this GPU, which are stale, and where dispatch would fall back to nearest buckets or defaults."""

from __future__ import annotations

import platform
from typing import Any

import torch
import triton

from tunegen.kernels.database import database_url, gpu_record, open_store, winners_for
from tunegen.kernels.gpu import Gpu, cuda_gpu, driver_version, interpreter_gpu
from tunegen.tuning.presets import PRESETS, problems
from tunegen.tuning_db import TuningDbError, head_revision, shipped_store


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
            mine = store.winners(gpu=record)
            out["database"]["winners"] = len(store.winners())
    except TuningDbError as exc:
        out["database"]["error"] = str(exc)
        mine = []
    shipped = shipped_store().winners(gpu=record)
    out["winners_for_this_gpu"] = {"user": len(mine), "shipped": len(shipped)}
    out["stale"] = [
        {"family": w.family, "problem": w.problem, "triton_version": w.triton_version, "source": source}
        for source, group in (("user", mine), ("shipped", shipped))
        for w in group
        if w.triton_version != gpu.triton_version
    ]
    coverage = {"winner": [], "nearest": [], "default": []}
    suite = problems(list(PRESETS.values()), causal=(False, True), seqlens=(1024, 4096, 16384))
    if out["database"]["error"] is None:
        for problem in suite:
            if winners_for(gpu, problem, url):
                kind = "winner"
            elif winners_for(gpu, problem, url, same_features=True):
                kind = "nearest"
            else:
                kind = "default"
            coverage[kind].append(problem.as_dict())
    out["coverage"] = {
        "suite": "every preset, causal and not, N = 1024, 4096, 16384, bf16",
        **{k: len(v) for k, v in coverage.items()},
        "falls_back": coverage["default"],
    }
    return out


def render_text(r: dict[str, Any]) -> str:
    """The report as lines a person reads."""
    g, db, cov = r["gpu"], r["database"], r["coverage"]
    if g["backend"] == "cuda":
        arch = f"sm_{g['capability'][0]}{g['capability'][1]}"
        gpu = f"{g['name']} ({arch}, {g['sm_count']} SMs, driver {r['driver']})"
    else:
        gpu = "none: CPU tensors run under Triton's interpreter (TRITON_INTERPRET=1), else PyTorch's fallback"
    lines = [
        f"GPU        {gpu}",
        f"versions   python {r['python']}, torch {r['torch']}, triton {r['triton']}, CUDA {r['cuda']}",
        f"database   {db['url']}",
    ]
    if db["error"]:
        lines.append(f"           ERROR: {db['error']}")
    else:
        schema = db["schema"] or "not created yet"
        lines.append(
            f"           schema {schema} (this release: {db['head']}), {db.get('winners', 0)} winners in all"
        )
    w = r["winners_for_this_gpu"]
    lines.append(f"winners    {w['user']} for this GPU in the database, {w['shipped']} shipped with tunegen")
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
    lines.append(
        f"dispatch   {cov['suite']}: {cov['winner']} tuned, {cov['nearest']} nearest bucket, "
        f"{cov['default']} default Variant"
    )
    return "\n".join(lines)
