"""The trials one tuning process has in flight: compiling, compiled and waiting for the GPU, and
on the GPU; how many to keep ahead of the GPU; and where asking for each Problem's trials stands.

The GPU (the timing worker) is what a search waits for: a trial's check and timing take longer
than its compile. So the GPU gets its next trials queued behind the one it runs (it never waits for
the tuner's bookkeeping), and just enough trials are kept compiling or compiled ahead of it that
it never waits for a compile: each one more is asked of the sampler blind (before the results
ahead of it are known) and, near a Problem's end, held by this process while other processes
sharing the study have none left to take.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections import deque
from typing import Any

import optuna

from tunegen.kernels.problem import Problem
from tunegen.kernels.variant import Variant

# Trials queued on the GPU at once: the one it runs and two more, so that the GPU does not wait
# while the tuner asks the sampler (with two ranks on 2 x H200 an ask took 55-60 ms, up to 250 ms,
# and compiled trials waited 0.9-1.5 s of a 57-s run to be queued behind one trial of 0.15 s).
GPU_QUEUE = 3
# Trials kept ahead of the interpreter before the first compile and timing have been measured. A
# GPU gets all its compile workers at once: there a compile takes 1-5 s and a timing 0.15-0.2 s,
# so the estimates ask for them all anyway, and four ahead until they were measured left twelve of
# sixteen workers idle for the first 4 s of a run (2 x H200, 2026-11-26).
FIRST_AHEAD = 4
# Weight of the newest measurement in the running compile and timing estimates, and in the
# running deviation of a compile's time from its estimate.
SMOOTHING = 0.3
DEVIATION_SMOOTHING = 0.25
# Deviations of a compile's time past its estimate that the trials kept ahead cover: compiles
# vary (on a 2 x H200 host whose compiles took 1.1 s at the median, trials waited 2-5 s per GPU
# of a 50-s run for a compile that had just ended, 2026-11-26), and the GPU waits whenever the
# one it needs next is slower than the estimate.
DEVIATIONS = 2
# A compile running this many times longer than the estimate is a straggler: it is not counted
# as coming for the GPU (one in ten took 2.5-4.5 s on the 2 x H200 host, against a median of 1 s).
STRAGGLER = 2.0


@dataclasses.dataclass(frozen=True)
class Pending:
    """A trial in flight (`trial` None: the peers' timing for `problem`)."""

    problem: Problem
    trial: optuna.Trial | None
    variant: Variant | None
    payload: dict[str, Any]
    since: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Asks:
    """Where asking for one Problem's trials stands: its study and space, the Variants that
    failed before, when this process first asked for its trials (ahead of its search, too: its
    time limit counts from there), how many were asked, whether its limits still allow more."""

    study: optuna.Study
    family: Any
    space: dict[str, list]
    failures: dict[str, str]
    start: float
    asked: int = 0
    more: bool = True


class Flight:
    """What is in flight, and running estimates of a compile's and a GPU timing's seconds."""

    def __init__(self, compile_workers: int, first_ahead: int = FIRST_AHEAD) -> None:
        self.workers = compile_workers
        self.first_ahead = first_ahead
        self.compiling: dict[concurrent.futures.Future, Pending] = {}
        self.ready: dict[Problem, deque[Pending]] = {}
        self.timing: dict[concurrent.futures.Future, Pending] = {}
        self.compile_s: float | None = None
        self.compile_deviation = 0.0
        self.gpu_s: float | None = None

    def ahead(self, problem: Problem | None = None) -> int:
        """Trials compiling or compiled, not yet on the GPU (of `problem`, or of any)."""
        compiling = sum(1 for p in self.compiling.values() if problem in (None, p.problem))
        return compiling + self._compiled(problem)

    def _compiled(self, problem: Problem | None) -> int:
        if problem is not None:
            return len(self.ready.get(problem, ()))
        return sum(len(q) for q in self.ready.values())

    def short(self, problem: Problem | None = None) -> bool:
        """Whether the GPU needs more trials started (of `problem`, or of any): fewer than the
        depth are coming, counting the compiled ones and the compiles not yet stragglers, and a
        compile worker is free to take one."""
        if len(self.compiling) >= self.workers:
            return False
        late = None if self.compile_s is None else time.monotonic() - STRAGGLER * self.compile_s
        coming = sum(
            1
            for p in self.compiling.values()
            if problem in (None, p.problem) and (late is None or p.since >= late)
        )
        return coming + self._compiled(problem) < self.depth()

    def depth(self) -> int:
        """How many trials to keep ahead of the GPU: a slow compile's time (the estimate plus
        `DEVIATIONS` deviations) over a timing's, plus two (one to take, one for a straggler),
        within the compile workers there are; before both are measured, `first_ahead`."""
        if self.compile_s is None or self.gpu_s is None:
            return min(self.workers, self.first_ahead)
        slow = self.compile_s + DEVIATIONS * self.compile_deviation
        return min(self.workers, math.ceil(slow / max(self.gpu_s, 1e-3)) + 2)

    def due_in(self, problem: Problem) -> float | None:
        """Seconds until the first of `problem`'s compiles that is not a straggler should end, by
        the estimate (at least 0); None before a compile was measured, or where none is coming."""
        if self.compile_s is None:
            return None
        now = time.monotonic()
        coming = [
            p.since
            for p in self.compiling.values()
            if p.problem == problem and now - p.since < STRAGGLER * self.compile_s
        ]
        return max(0.0, min(coming) + self.compile_s - now) if coming else None

    def holds(self, problem: Problem) -> bool:
        """Whether anything of `problem` is compiling, waiting for the GPU or on it."""
        return bool(self.ahead(problem)) or any(p.problem == problem for p in self.timing.values())

    def futures(self) -> list[concurrent.futures.Future]:
        return [*self.compiling, *self.timing]

    def compiled(self, seconds: float) -> None:
        if self.compile_s is not None:
            off = abs(seconds - self.compile_s)
            self.compile_deviation += DEVIATION_SMOOTHING * (off - self.compile_deviation)
        self.compile_s = _smoothed(self.compile_s, seconds)

    def timed(self, seconds: float) -> None:
        self.gpu_s = _smoothed(self.gpu_s, seconds)


def _smoothed(estimate: float | None, seconds: float) -> float:
    return seconds if estimate is None else (1 - SMOOTHING) * estimate + SMOOTHING * seconds
