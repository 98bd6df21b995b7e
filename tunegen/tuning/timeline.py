"""Where a tuning run's time goes: spans of work on each lane of each GPU's process (its GPU, each
compile worker, the tuner's own thread), written as a Chrome trace (open it in Perfetto or
chrome://tracing) and summed per GPU, so that a user can see why a host scales as it does.

Lanes: "gpu" holds what the timing worker does on the GPU (a trial's check and timing, the peers,
a Problem's final round); "compile K" what compile worker K does; "sampler" the tuner's asks
for trials (each with the database transactions that write the trial); "tuner" the rest of what
the tuner does between results (telling the study) and what it waits for (other processes'
trials, the host's next instruction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tunegen.kernels.problem import Problem, problem_text

GPU = "gpu"
TUNER = "tuner"
SAMPLER = "sampler"
COMPILE = "compile"
# Tuner-lane span names that are waits, not work (the summary adds them up).
WAIT_OTHERS = "waiting for other processes' trials"
WAIT_HOST = "waiting for the other GPUs to finish"
# The tuner-lane span from the command's start (its imports, the host's devices) to the ranks',
# and within it the host's CUDA devices being read (the driver wakes GPUs left idle: seconds).
STARTING = "starting the command"
READING_GPUS = "reading the host's GPUs"


@dataclasses.dataclass(frozen=True)
class Span:
    """One piece of work or waiting: its lane, what it was, the Problem it served (its short
    text, "" for none), and its wall-clock start and end (time.time(): comparable across the
    processes of one host)."""

    lane: str
    name: str
    problem: str
    start: float
    end: float


class Timeline:
    """The spans one process records (thread-safe); `take` hands over those not taken before."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, lane: str, name: str, start: float, end: float, problem: str = "") -> None:
        with self._lock:
            self._spans.append(Span(lane, name, problem, start, end))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, problem: str = "") -> Iterator[None]:
        """Record the time the body takes (also when it raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.add(lane, name, start, time.time(), problem)

    def take(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def process_start() -> float | None:
    """When this process started, on time.time()'s clock (to Linux's 10 ms ticks), so that a run's
    timeline can show its command's start too; None where the platform does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError, IndexError):
        return None
    return time.time() - age


def problem_label(problem: Problem) -> str:
    """How the timeline names a Problem."""
    return problem_text(problem.as_dict())


def compile_lane(worker: int) -> str:
    return f"{COMPILE} {worker}"


def _busy(spans: Iterable[Span]) -> float:
    """Seconds covered by at least one of `spans` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > reach:
            total += s.end - max(s.start, reach)
            reach = s.end
    return total


def summary(spans: dict[str, list[Span]], start: float, end: float) -> list[dict[str, object]]:
    """Per GPU (key of `spans`): the run's wall time, how much of it its GPU was busy (and with
    what), its compile workers' mean occupancy, and the tuner's waits, in seconds."""
    wall = max(end - start, 1e-9)
    rows = []
    for gpu, own in spans.items():
        on_gpu = [s for s in own if s.lane == GPU]
        lanes = {s.lane for s in own if s.lane.startswith(COMPILE)}
        compiling = sum(s.end - s.start for s in own if s.lane.startswith(COMPILE))
        kinds: dict[str, float] = {}
        for s in on_gpu:
            kind = "trials" if s.name.startswith("trial") else s.name
            kinds[kind] = kinds.get(kind, 0.0) + s.end - s.start
        waits = {
            name: sum(s.end - s.start for s in own if s.lane == TUNER and s.name == name)
            for name in (WAIT_OTHERS, WAIT_HOST)
        }
        rows.append(
            {
                "gpu": gpu,
                "wall_s": wall,
                "gpu_busy_s": _busy(on_gpu),
                "gpu_busy": _busy(on_gpu) / wall,
                "gpu_s_by_kind": kinds,
                "compile_workers": len(lanes),
                "compile_busy": compiling / (wall * max(1, len(lanes))),
                "waits_s": waits,
                "trials_timed": sum(1 for s in on_gpu if s.name.startswith("trial")),
                "trials_compiled": sum(
                    1 for s in own if s.lane.startswith(COMPILE) and s.name.startswith("trial")
                ),
            }
        )
    return rows


def chrome_trace(spans: dict[str, list[Span]], start: float) -> dict[str, object]:
    """The spans as Chrome's trace-event JSON: a process per GPU, a thread per lane (µs from the
    run's start)."""
    events: list[dict[str, object]] = []
    for pid, (gpu, own) in enumerate(spans.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": gpu}})
        lanes = sorted({s.lane for s in own}, key=_lane_order)
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        for s in own:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": pid,
                    "tid": lanes.index(s.lane),
                    "ts": round((s.start - start) * 1e6),
                    "dur": round((s.end - s.start) * 1e6),
                    "args": {"problem": s.problem} if s.problem else {},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane_order(lane: str) -> tuple[int, int]:
    if lane == GPU:
        return (0, 0)
    if lane in (TUNER, SAMPLER):
        return (1, int(lane == SAMPLER))
    number = lane.removeprefix(COMPILE).strip()
    return (2, int(number) if number.isdigit() else 0)


def write(path: str | Path, spans: dict[str, list[Span]], start: float, end: float) -> None:
    """Write the Chrome trace of `spans` with the per-GPU summary beside it (key "summary")."""
    trace = chrome_trace(spans, start)
    trace["summary"] = summary(spans, start, end)
    Path(path).write_text(json.dumps(trace))
