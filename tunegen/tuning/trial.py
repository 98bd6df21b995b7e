"""What a tuning trial does inside a worker process: build one Variant for one Problem, check
it against float64 on fresh random inputs with its outputs poisoned, and time it; and the peers'
time on the same Problem. The inputs, launch and reference come from the family's `case`.
Payloads and results are plain dicts (they cross processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

from tunegen.kernels import peers
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import tolerance
from tunegen.kernels.render import cache_dir

try:
    import fcntl
except ImportError:  # Windows: no file locks, so no turns
    fcntl = None


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
    families), done as it is unpickled, and on a GPU the CUDA context. A worker that gets it at
    start is ready when its first trial comes, rather than making that trial wait. With
    "in_turn", the context is made under `contexts_in_turn`."""
    if payload["backend"] == "cuda":
        with contexts_in_turn() if payload.get("in_turn") else contextlib.nullcontext():
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
    return {"status": "ok"}


# CUDA contexts a GPU's workers make at once under `contexts_in_turn`.
CONTEXTS_AT_ONCE = 2
# How often a process waiting for a turn tries them all again (so that none sits unused).
TURN_POLL_S = 0.01


@contextlib.contextmanager
def contexts_in_turn() -> Iterator[None]:
    """Hold one of this user's CONTEXTS_AT_ONCE turns at making a CUDA context on the GPUs this
    process sees (file locks in tunegen's cache, released by the kernel if the holder dies). The
    driver makes contexts little faster side by side, and every one of them ends last: on 2 x H200
    (2026-11-26) 34 made at once were all ready after 5.5-10.4 s, 34 made one at a time each after
    0.47 s more than the one before. So the compile workers of a rank take turns, and the first
    ones start compiling within a second; each GPU has turns of its own, since with turns shared
    by the host one rank's workers took all sixteen before the other's got one. Without a cache
    folder to lock in, or file locks (Windows), nobody waits."""
    turns = _turns()
    try:
        while turns and not any(_took(turn) for turn in turns):
            time.sleep(TURN_POLL_S)
        yield
    finally:
        for turn in turns:
            turn.close()


def _turns() -> list[IO[str]]:
    """The turn files of the GPUs this process sees, open; none where they cannot be."""
    if fcntl is None:
        return []
    seen = re.sub(r"[^A-Za-z0-9,-]", "_", os.environ.get("CUDA_VISIBLE_DEVICES", "all"))[:200]
    turns: list[IO[str]] = []
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(CONTEXTS_AT_ONCE):
            turns.append(open(folder / f"cuda-contexts.{seen}.{i}.lock", "a"))  # noqa: SIM115
    except OSError:
        for turn in turns:
            turn.close()
        return []
    return turns


def _took(turn: IO[str]) -> bool:
    try:
        fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def compile_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Render, compile and load the binary for the case's inputs (so it is in Triton's cache for
    the timing worker), without running the kernel: the timing worker may be timing on that GPU.
    Only making the inputs touches it; their memory is given back at once, for the next worker.
    The result says how many seconds it took (the tuner paces its compiles by it)."""
    start = time.monotonic()
    problem = Problem(**payload["problem"])
    family = get(problem.family)
    device = _device(payload)
    kernel = base.build(family, family.variant_type.from_json(payload["variant"]), problem, gpu_of(device))
    binding = dataclasses.replace(kernel, launch=kernel.bind)  # the case's launch binds, runs nothing
    family.case(problem, binding, device, payload["seed"]).launch()
    _sync(payload)
    if payload["backend"] == "cuda":
        torch.cuda.empty_cache()
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
