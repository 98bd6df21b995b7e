"""A benchmark's rows: the Row of one (shape, implementation) measurement; `check_then_time`,
which checks each call against float64 before timing the ones that passed, so a row never reports
the speed of a wrong answer; and writing rows to CSV or JSON."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from tunegen.kernels import peers
from tunegen.measure.suites import Shape
from tunegen.tuning.timing import interleaved_ms


@dataclasses.dataclass
class Row:
    """One (shape, implementation) measurement; `tflops` counts the (row, key) pairs attended
    (`Shape.flops`)."""

    impl: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    window_left: int
    window_right: int
    attention_chunk: int
    softcap: float
    sinks: bool
    ms: float | None
    tflops: float | None
    rel_err: float | None
    note: str
    gpu: str
    triton: str
    torch: str
    date: str

    @classmethod
    def of(
        cls,
        impl: str,
        dtype: str,
        shape: Shape,
        ms: float | None,
        tflops: float | None,
        err: float | None,
        note: str,
        gpu: str,
        date: str,
    ) -> Row:
        """The row of `impl` on `shape` (its features included), with the Triton and PyTorch
        versions of this run."""
        return cls(
            impl,
            dtype,
            shape.batch,
            shape.heads,
            shape.kv_heads,
            shape.seqlen,
            shape.head_dim,
            shape.causal,
            shape.window_left,
            shape.window_right,
            shape.attention_chunk,
            shape.softcap,
            shape.sinks,
            ms,
            tflops,
            err,
            note,
            gpu,
            triton.__version__,
            torch.__version__,
            date,
        )


def check_then_time(
    calls: dict[str, tuple[Callable[[], Any], Callable[[Any], float], float]],
) -> dict[str, tuple[float | None, float | None, str]]:
    """Run each call once and check its error against float64 within its bound; then time the
    calls that passed together, in interleaved rounds (`interleaved_ms`). Each call is named by its
    implementation, whose setting (`peers.pinned`) the check and the timing enter around it.
    Returns, per name, (median ms, relative error, note); the note is "n/a (why)" for an
    implementation that cannot run the inputs (asked quietly: see peers.quiet), "wrong: ..." for
    a wrong answer."""
    results: dict[str, tuple[float | None, float | None, str]] = {}
    passed = {}
    for name, (call, error_of, bound) in calls.items():
        try:
            with peers.quiet() as caught, peers.pinned(name):
                out = call()
                torch.cuda.synchronize()
            err = error_of(out)
        except Exception as exc:  # a peer refusing a shape is a result, not a crash
            results[name] = (None, None, f"n/a ({peers.refusal(exc, caught)})")
            continue
        if not err <= bound:
            results[name] = (None, err, f"wrong: relative error {err:.2e}")
            continue
        results[name] = (None, err, "")
        passed[name] = call
    for name, ms in interleaved_ms(passed).items():
        results[name] = (ms, results[name][1], "")
    return {name: results[name] for name in calls}


def write_rows(rows: Sequence[Row | dict], path: Path) -> None:
    """Write rows as CSV or JSON, by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in rows]
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]) if records else [])
        writer.writeheader()
        writer.writerows(records)
