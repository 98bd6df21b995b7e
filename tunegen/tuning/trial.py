"""What a tuning trial does inside a worker process: build one Variant for one Problem, check
it against float64 on fresh random inputs with its outputs poisoned, and time it; and the peers'
time on the same Problem. The inputs, launch and reference come from the family's `case`.
Payloads and results are plain dicts (they cross processes).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tunegen.kernels import peers
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import gpu_of, meta_facts
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import tolerance


def _device(payload: dict[str, Any]) -> torch.device:
    return torch.device("cuda" if payload["backend"] == "cuda" else "cpu")


def _case(payload: dict[str, Any], with_kernel: bool = True) -> tuple[Problem, base.Case]:
    problem = Problem(**payload["problem"])
    family = get(problem.family)
    device = _device(payload)
    kernel = None
    if with_kernel:
        variant = family.variant_type.from_json(payload["variant"])
        kernel = base.build(family, variant, problem, gpu_of(device))
    return problem, family.case(problem, kernel, device, payload["seed"])


def _sync(payload: dict[str, Any]) -> None:
    if payload["backend"] == "cuda":
        torch.cuda.synchronize()


def median_ms(
    fn: Callable[[], object], backend: str, rep_ms: float = 100.0, impl: str | None = None
) -> float:
    """The GPU's median time of `fn`, which runs implementation `impl` (a peer's name, or None for
    tunegen's: see `peers.pinned`); the interpreter's wall clock, a functional stand-in only."""
    if backend == "cuda":
        from tunegen.tuning.timing import median_ms as gpu_median_ms

        return gpu_median_ms(fn, warmup_ms=25, rep_ms=rep_ms, impl=impl)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def warm_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Nothing but what every task needs first: this module's imports (Triton, torch, the
    families), done as it is unpickled, and with "context" on a GPU, the CUDA context (the timing
    worker's: compile workers make none, see `compile_task`). A worker that gets it at start is
    ready when its first task comes, rather than making that task wait."""
    if payload["backend"] == "cuda" and payload.get("context"):
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    return {"status": "ok"}


def compile_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Render and compile the Variant for the case's inputs into Triton's cache, where the timing
    worker finds it, without running it. For a GPU the inputs are meta tensors and nothing touches
    the GPU (launcher.compiled_for_meta): the driver makes CUDA contexts two to three a second for
    a whole host (2 x H200, 2026-11-26), so thirty-two compile workers each making one held the
    first compiles back for seconds. The result says how many seconds it took (the tuner paces
    its compiles by it)."""
    start = time.monotonic()
    problem = Problem(**payload["problem"])
    family = get(problem.family)
    cuda = payload["backend"] == "cuda"
    gpu = meta_facts().gpu() if cuda else gpu_of(_device(payload))
    device = torch.device("meta") if cuda else _device(payload)
    kernel = base.build(family, family.variant_type.from_json(payload["variant"]), problem, gpu)
    binding = dataclasses.replace(kernel, launch=kernel.bind)  # the case's launch binds, runs nothing
    family.case(problem, binding, device, payload["seed"]).launch()
    return {"status": "ok", "seconds": time.monotonic() - start}


def evaluate_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Verify then time one Variant: {"status": "ok", "ms", "rel_err"} or a failure with its reason."""
    problem, case = _case(payload)
    case.launch()
    _sync(payload)
    err = case.error()
    if not err <= tolerance(problem):
        return {
            "status": "wrong",
            "reason": f"relative error {err:.3g} against float64 (NaN: unwritten)",
            "rel_err": err,
        }
    return {
        "status": "ok",
        "ms": median_ms(case.launch, payload["backend"], payload.get("rep_ms", 100.0)),
        "rel_err": err,
    }


def peers_task(payload: dict[str, Any]) -> dict[str, Any]:
    """The fastest correct peer on the Problem (CUDA only): {"name", "ms"}, or none."""
    problem, case = _case(payload, with_kernel=False)
    best: tuple[float, str] | None = None
    for name, call in case.peers.items():
        try:
            with peers.quiet(), peers.pinned(name):
                out = call()
                _sync(payload)
        except Exception:  # this backend cannot run the inputs: no peer for this Problem
            continue
        if not case.peer_error(out) <= tolerance(problem):
            continue
        ms = median_ms(call, payload["backend"], impl=name)
        if best is None or ms < best[0]:
            best = (ms, name)
    return {"status": "ok", "name": best[1] if best else None, "ms": best[0] if best else None}
