"""GPU timing: the median of many runs, measured with CUDA events through triton.testing."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import triton.testing


def rate(unit: str, work: float, ms: float) -> float:
    """TFLOP/s from FLOPs, or GB/s from bytes, over a time in milliseconds."""
    return work / ms / (1e9 if unit == "TFLOP/s" else 1e6)


def median_ms(fn: Callable[[], object], *, warmup_ms: float = 100.0, rep_ms: float = 500.0) -> float:
    """Median time of `fn` in milliseconds on the current CUDA device (L2 flushed between runs)."""
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA GPU; the interpreter's wall clock says nothing about kernels")
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def interleaved_ms(calls: dict[str, Callable[[], object]], rep_ms: float = 200.0) -> dict[str, float]:
    """Median time of each call over as many rounds as there are calls, the order rotated each round
    so that every call is timed once in every position. A GPU's clocks drift under sustained
    load: timed one after another, the same H100 kernel measured 648 and 609 TFLOP/s (first and
    second), more than separates the implementations being compared."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for shift in range(len(names)):
        for name in names[shift:] + names[:shift]:
            times[name].append(median_ms(calls[name], warmup_ms=25.0, rep_ms=rep_ms))
    return {name: statistics.median(values) for name, values in times.items()}
