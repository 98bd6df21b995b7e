"""GPU timing: the median of many runs, measured with CUDA events through triton.testing."""

from __future__ import annotations

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
