"""GPU timing: the median of many runs, measured with CUDA events through triton.testing. Every
implementation, tunegen's or a peer's, is timed through these functions the same way: a peer's
setting (SDPA's choice of backend, `peers.pinned`) is entered once around all of its timed calls,
never inside them, as a model that picks a backend once calls it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import triton.testing

from tunegen.kernels import peers
from tunegen.tuning.rounds import balanced_rounds, round_order

# Seconds one round of `per_call_us` may last: a call of milliseconds needs no 2000 repeats to
# show its cost, and a decode over a 32k-token cache at batch 64 would take half a minute a round.
ROUND_S = 0.25


def rate(unit: str, work: float, ms: float) -> float:
    """TFLOP/s from FLOPs, or GB/s from bytes, over a time in milliseconds."""
    return work / ms / (1e9 if unit == "TFLOP/s" else 1e6)


def median_ms(
    fn: Callable[[], object], *, warmup_ms: float = 100.0, rep_ms: float = 500.0, impl: str | None = None
) -> float:
    """Median time of `fn` in milliseconds on the current CUDA device (L2 flushed between runs).
    `impl` names the implementation `fn` calls (a peer's name: see `peers.pinned`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA GPU; the interpreter's wall clock says nothing about kernels")
    with peers.pinned(impl):
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def interleaved_ms(
    calls: dict[str, Callable[[], object]], rep_ms: float = 200.0, rounds: int | None = None
) -> dict[str, float]:
    """Median time of each call (named by its implementation, see `median_ms`) over `rounds` rounds
    (default: `balanced_rounds`, as many as there are calls, one more for an odd count), each round
    in its own order (`round_order`), so that with the default every call is timed as often early
    as late and behind each other call, and with fewer rounds early, midway and late. A GPU's
    clocks drift under sustained load: timed one after another, the same H100 kernel measured 648
    and 609 TFLOP/s (first and second), more than separates the implementations being compared."""
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds: expected at least 1 round, got {rounds!r}")
    names = list(calls)
    count = balanced_rounds(len(names)) if rounds is None else rounds
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(count):
        for name in (names[k] for k in round_order(len(names), round_, count)):
            times[name].append(median_ms(calls[name], warmup_ms=25.0, rep_ms=rep_ms, impl=name))
    return {name: statistics.median(values) for name, values in times.items()}


def per_call_us(
    calls: list[Callable[[], object]], *, graph: bool, min_calls: int = 2000, impl: str | None = None
) -> float | None:
    """Microseconds per call of the `calls` run in turn, back to back, as a model runs them: the
    median of rounds each closed by one synchronization, so that the host's cost per call counts
    wherever it exceeds the GPU's. Several calls on separate inputs keep a cache-sized input from
    being read from L2 every time. A round makes `min_calls` calls, fewer where they would last
    more than ROUND_S. With `graph`, one pass over the calls is captured in a CUDA graph and its
    replays are timed instead (the GPU's time, launch gaps shrunk); None if a call cannot be
    captured. `impl` names the implementation the calls run (see `median_ms`)."""
    with peers.pinned(impl):
        return _per_call_us(calls, graph, min_calls)


def _per_call_us(calls: list[Callable[[], object]], graph: bool, min_calls: int) -> float | None:
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
    run()  # a first pass's one-time costs stay out of the estimate below
    torch.cuda.synchronize()
    warmup = max(1, passes // 10)
    start = time.perf_counter()
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    passes = max(1, min(passes, int(ROUND_S * warmup / (time.perf_counter() - start))))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(passes):
            run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / (passes * len(calls)) * 1e6)
    return statistics.median(samples)
