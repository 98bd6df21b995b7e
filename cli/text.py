"""How commands print a Problem, a Variant and a Winner's speed, each on one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunegen.tuning_db import WinnerRecord


def problem_text(problem: dict) -> str:
    heads = f"{problem.get('num_heads_q')}/{problem.get('num_heads_kv')}"
    flags = [name for name in ("causal", "varlen", "paged", "fp8", "return_lse") if problem.get(name)]
    sizes = f"B{problem.get('batch')} {problem.get('seqlen_q')}x{problem.get('seqlen_k')}"
    return f"{problem.get('dtype')} D{problem.get('head_dim')} H{heads} {sizes} {' '.join(flags)}".strip()


def variant_text(variant: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(variant.items()))


def speed(w: WinnerRecord, ms: float | None = None) -> str:
    """A winner's speed (or, given `ms`, the speed at that time) in its family's unit."""
    scale = w.median_ms / ms if ms else 1.0
    if w.tflops:
        return f"{w.tflops * scale:.0f} TFLOP/s"
    if w.gbps:
        return f"{w.gbps * scale:.0f} GB/s"
    return "-"
