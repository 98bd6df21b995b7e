"""Records for the store's tests: one GPU, Problems that differ by index, Winners with a chosen time."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import pytest

from tunegen.kernels import snapshot
from tunegen.kernels.database import gpu_from_record
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import (
    GpuRecord,
    WinnerRecord,
)

H100 = GpuRecord("NVIDIA H100 80GB HBM3", "9.0", 132, 232448, "cuda", "580.159.04")


def problem(i: int = 0) -> dict:
    return {
        "family": "prefill",
        "dtype": "bfloat16",
        "head_dim": 128,
        "causal": bool(i % 2),
        "num_heads_q": 32,
        "num_heads_kv": 8,
        "batch": 4,
        "seqlen_q": 1024 << (i % 5),
        "seqlen_k": 1024 << (i % 5),
        "variant_of": i,
    }


def winner(i: int = 0, ms: float = 1.0, block_m: int = 128, **changes) -> WinnerRecord:
    w = WinnerRecord(
        gpu=H100,
        family="prefill",
        problem=problem(i),
        variant={"block_m": block_m, "block_n": 64},
        median_ms=ms,
        rel_err=2e-3,
        triton_version="3.6.0",
        torch_version="2.11.0",
        template_hash="abc123",
        tflops=400.0 / ms,
        peer_name="sdpa-flash",
        peer_ms=1.4,
    )
    return dataclasses.replace(w, **changes)


def servable(i: int = 0, ms: float = 1.0, **changes) -> WinnerRecord:
    """A Winner this release rebuilds and serves: the Problems above carry an extra field
    (`variant_of`), which the store keeps as it is but `tunegen import` and dispatch refuse."""
    w = winner(i, ms, **changes)
    return dataclasses.replace(w, problem={k: v for k, v in w.problem.items() if k != "variant_of"})


# A Winner dispatch serves as stored: its Problem with every field this release writes.
GOOD = dataclasses.replace(servable(0), problem=Problem(**servable(0).problem).as_dict())


@contextlib.contextmanager
def dispatch_snapshot(url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gpu, snapshot.Snapshot]]:
    """GOOD's GPU and dispatch's snapshot of the Winners at `url` for it (taken with warnings as
    errors: a store it can read gives none), forgotten afterwards."""
    monkeypatch.setenv("TUNEGEN_DB", url)
    gpu = dataclasses.replace(gpu_from_record(GOOD.gpu), triton_version=GOOD.triton_version)
    snapshot.forget()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            taken = snapshot.for_gpu(gpu)
        yield gpu, taken
    finally:
        snapshot.forget()
