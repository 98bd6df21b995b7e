"""How commands print a Variant and a Winner's speed, each on one line (a Problem: `problem_text`
in tunegen.kernels.problem, which the tuner's timeline shares), and where a tuning run's time went."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def where_time_went(rows: list[dict]) -> Any:
    """The timeline's summary as a table: per GPU, how busy its GPU and compile workers were."""
    from rich.table import Table

    table = Table(title="where each GPU's time went")
    for col in ("gpu", "wall", "GPU busy", "on the GPU", "compile workers busy", "waiting", "trials"):
        table.add_column(col)
    for row in rows:
        kinds = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(row["gpu_s_by_kind"].items()))
        waits = ", ".join(f"{k} {v:.0f} s" for k, v in row["waits_s"].items() if v >= 0.5) or "-"
        table.add_row(
            row["gpu"],
            f"{row['wall_s']:.0f} s",
            f"{row['gpu_busy']:.0%}",
            kinds or "-",
            f"{row['compile_busy']:.0%} of {row['compile_workers']}",
            waits,
            f"{row['trials_timed']} timed, {row['trials_compiled']} compiled",
        )
    return table
