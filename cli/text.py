"""How commands print a Variant and a Winner's speed, each on one line (a Problem: `problem_text`
in tunegen.kernels.problem, which the tuner's timeline shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunegen.tuning_db import WinnerRecord


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
