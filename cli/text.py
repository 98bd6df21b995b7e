"""How commands print a Problem, a Variant and a Winner's speed, each on one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunegen.tuning_db import WinnerRecord


SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_text(problem: dict) -> str:
    """What a Problem computes in: its dtype, or for FP8 Problems what is FP8 and what is not."""
    dtype = str(problem.get("dtype"))
    if not problem.get("fp8"):
        return dtype
    if problem.get("family") == "decode":
        return f"{dtype} over an fp8 e4m3 KV cache"
    return f"fp8 e4m3 inputs, {SHORT.get(dtype, dtype)} output"


def problem_text(problem: dict) -> str:
    heads = f"{problem.get('num_heads_q')}/{problem.get('num_heads_kv')}"
    flags = [name for name in ("causal", "varlen", "paged", "return_lse") if problem.get(name)]
    sizes = f"B{problem.get('batch')} {problem.get('seqlen_q')}x{problem.get('seqlen_k')}"
    return f"{dtype_text(problem)} D{problem.get('head_dim')} H{heads} {sizes} {' '.join(flags)}".strip()


def variant_text(w: WinnerRecord) -> str:
    """A Winner's Variant: the knobs that apply to its Problem on its GPU (all of them for rows
    this release cannot rebuild)."""
    from tunegen.kernels.database import applicable_knobs

    return " ".join(f"{k}={v}" for k, v in sorted(applicable_knobs(w).items()))


def speed(w: WinnerRecord, ms: float | None = None) -> str:
    """A winner's speed (or, given `ms`, the speed at that time) in its family's unit."""
    scale = w.median_ms / ms if ms else 1.0
    if w.tflops:
        return f"{w.tflops * scale:.0f} TFLOP/s"
    if w.gbps:
        return f"{w.gbps * scale:.0f} GB/s"
    return "-"
