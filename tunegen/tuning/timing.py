"""GPU timing: the median of many runs, measured with CUDA events through triton.testing."""

from __future__ import annotations

import statistics
import time
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


def per_call_us(calls: list[Callable[[], object]], *, graph: bool, min_calls: int = 2000) -> float | None:
    """Microseconds per call of the `calls` run in turn, back to back, as a model runs them: the
    median of rounds each closed by one synchronization, so that the host's cost per call counts
    wherever it exceeds the GPU's. Several calls on separate inputs keep a cache-sized input from
    being read from L2 every time. With `graph`, one pass over the calls is captured in a CUDA
    graph and its replays are timed instead (the GPU's time, launch gaps shrunk); None if a call
    cannot be captured."""
    run = lambda: [call() for call in calls]
    if graph:
        run()
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(captured):
                run()
        except Exception:  # a peer that cannot be captured: no graph figure for it
            return None
        run = captured.replay
    passes = max(1, min_calls // len(calls))
    for _ in range(max(1, passes // 10)):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(passes):
            run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / (passes * len(calls)) * 1e6)
    return statistics.median(samples)
