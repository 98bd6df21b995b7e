"""Tuning on several GPUs of one host (`tunegen tune --gpus`).

Each GPU gets a process of its own (a rank): a Tuner whose timing worker and compile workers see
only that GPU. Each rank of a model owns every so many of the Problems and searches those first,
alone, as one GPU would (a search shared by two GPUs asks for twice the trials before any result
is known, and its Winner came out 5-9% slower on one Problem in three of four runs, 2 x H200,
2026-11-27); then it goes through the other ranks' Problems, last first, taking the trials not
yet asked for (rank_process.search_order). Sharing is the fleet mechanism of study.py, on whatever
store is configured: ranks divide a study's trials without duplicates. GPUs of different models are
separate Gpu identities, each tuning every Problem for itself. This process shows the progress,
and once a rank has searched a Problem (none is left to ask for), tells the others to skip it and
hands its final round (waiting for the trials other ranks still hold, re-timing the finalists,
recording the Winner) to a rank of its model (`_takes_final`), while the others go on; a rank of
that model with nothing left to do takes over a round of its finalists' re-timings (`_hand`,
retiming.py). A rank that dies is started again where it was; its trials are failed by the
heartbeat and queued again (study.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from tunegen.kernels.database import database_url, open_store
from tunegen.kernels.environ import environment
from tunegen.kernels.families import get
from tunegen.kernels.families.base import unrendered
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning import study as studies
from tunegen.tuning.final import Outcome
from tunegen.tuning.interrupt import blocked, check, raising
from tunegen.tuning.opening import create_studies
from tunegen.tuning.rank_process import POLL_S, owner, rank_main, search_order
from tunegen.tuning.ranks import Rank, cores
from tunegen.tuning.retiming import ROUNDS
from tunegen.tuning.timeline import Span
from tunegen.tuning.tuner import TuneOptions, Tuner

# A rank that dies more often than this on one GPU stops the run (its GPU is likely unusable).
MAX_RESTARTS = 3


class HostError(RuntimeError):
    """A rank reported an error, or kept dying: the run stops (the studies keep what was done)."""


@dataclasses.dataclass
class _State:
    rank: Rank
    position: int
    process: Any = None
    conn: Any = None
    order: list[int] = dataclasses.field(default_factory=list)  # its search_order
    current: int = 0  # the position in `order` it searches (or will)
    finalizing: list[int] = dataclasses.field(default_factory=list)
    searched: set[int] = dataclasses.field(default_factory=set)
    waiting: bool = False  # asked for work, none given yet
    more: bool = True
    restarts: int = 0
    done: bool = False
    finals: int = 0  # final rounds handed to it
    offer: tuple[int, list] | None = None  # a round of its final round, on offer: (Problem, finalists)
    helpers: int = 0  # ranks that took over a round of its final round
    helping: tuple[_State, int] | None = None  # whose final round it re-times a round of (its restarts)


class _Host:
    """Starts the ranks, answers them, restarts the dead, and collects the Outcomes."""

    def __init__(self, problems, ranks, options, progress, finished, record) -> None:
        self.problems = problems
        self.options = options
        self.progress = progress
        self.finished = finished
        self.record = record
        # Ranks are forked on Linux, starting with what this process imported (seconds each). A
        # rank never calls CUDA nor writes to the terminal, and forks its workers through a zygote
        # only where this process has not touched CUDA (`zygote.usable`).
        self.context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        self.states = [_State(rank, position) for position, rank in enumerate(ranks)]
        for state in self.states:
            members = self._members(state.rank.gpu)
            state.order = search_order(len(problems), members.index(state), len(members))
        self.outcomes: dict[tuple[Gpu, int], Outcome] = {}
        self.assigned: set[tuple[Gpu, int]] = set()
        self.started: dict[tuple[Gpu, int], float] = {}

    def _start(self, state: _State) -> None:
        state.conn, child = self.context.Pipe()
        state.finalizing = []
        state.waiting = False
        # Each rank its own share of the cores; its samplers' seeds follow from its share
        # (rank_process.sampler_seed).
        options = dataclasses.replace(self.options, cpus=cores(state.position, len(self.states)))
        members = self._members(state.rank.gpu)
        share = (members.index(state), len(members))
        settled = self._settled(state.rank.gpu)  # to skip, for one started again
        args = (state.rank, self.problems, options, state.current, share, child, settled)
        # Signals wait until the rank can give its trials back (`raising` in rank_main).
        with environment("CUDA_VISIBLE_DEVICES", state.rank.visible), blocked(), warnings.catch_warnings():
            # Python 3.12 warns of any fork from a process with threads; see __init__ for why not here.
            warnings.filterwarnings("ignore", message=".*use of fork", category=DeprecationWarning)
            state.process = self.context.Process(
                target=rank_main, args=args, name=f"tunegen-gpu{state.rank.index}"
            )
            state.process.start()
        child.close()

    def _members(self, gpu: Gpu) -> list[_State]:
        return [s for s in self.states if s.rank.gpu == gpu]

    def _owner(self, gpu: Gpu, j: int) -> _State:
        """The rank of model `gpu` that owns Problem `j`."""
        members = self._members(gpu)
        return members[owner(j, len(members))]

    def _settled(self, gpu: Gpu) -> list[int]:
        """The Problems a rank of model `gpu` has searched: a search ends once the Problem has no
        trial left to ask for (or hit this process's limits, which end the Problem's search), so
        none is left for another rank; the final round waits for the trials they still hold. Its
        owner need not come by: a Problem taken by another rank before its owner reached it would
        wait for it."""
        members = self._members(gpu)
        return [j for j in range(len(self.problems)) if any(j in s.searched for s in members)]

    def _ready(self, state: _State) -> list[int]:
        """Problems searched (`_settled`), not yet handed out, that the rank of `state` may take,
        its own first. One with Problems left to search takes none of the last ones (as many
        as the model has ranks) before those are all searched: their final rounds then run side by
        side at the end. Handed out as they came, one GPU ran the last final round alone while the
        others, which had taken theirs during the last search, stood idle (1.6-1.8 s of a 22-s
        llama3-8b run on 2 x H200, 2026-11-26)."""
        gpu = state.rank.gpu
        last = len(self.problems) - len(self._members(gpu))
        ready = [
            j for j in self._settled(gpu) if (gpu, j) not in self.assigned and (j < last or not state.more)
        ]
        return sorted(ready, key=lambda j: self._owner(gpu, j) is not state)

    def _group_done(self, gpu: Gpu) -> bool:
        return all((gpu, j) in self.outcomes for j in range(len(self.problems)))

    def _answer(self, state: _State) -> None:
        gpu = state.rank.gpu
        ready = self._ready(state)
        if ready and self._takes_final(state):
            self.assigned.add((gpu, ready[0]))
            state.finalizing.append(ready[0])
            state.finals += 1
            message: tuple = ("finalize", ready[0])
        elif state.more:
            message = ("go", self._settled(gpu))
        elif self._group_done(gpu):
            message = ("stop",)
            state.done = True
        else:
            offering = next((s for s in self._members(gpu) if s.offer is not None), None)
            if offering is not None:
                self._hand(offering, state)
                self._send(offering, ("taken",))
            return
        state.waiting = False
        self._send(state, message)

    def _takes_final(self, state: _State) -> bool:
        """Whether the rank asking takes a searched Problem's final round: not while it has had
        more of them than a rank of its model that has Problems left to search, which takes it at
        its next stop. Handed to whoever finished searching last, they piled up on one GPU (all
        three of llama3-8b's on 2 x H200), and the other GPU waited for it at the end."""
        others = [s.finals for s in self._members(state.rank.gpu) if s is not state and s.more]
        return not state.more or not others or state.finals <= min(others)

    def _answer_waiting(self, gpu: Gpu) -> None:
        for state in self._members(gpu):
            if state.waiting:
                self._answer(state)

    def _handle(self, state: _State, message: tuple) -> None:
        kind, *args = message
        gpu = state.rank.gpu
        if kind == "start":
            state.current = state.order.index(args[0])
            self.started.setdefault((gpu, args[0]), time.monotonic())
        elif kind == "progress":
            self.progress(gpu, args[0], args[1])
        elif kind == "ready":
            searched, state.more = args
            if searched is not None:
                state.searched.add(searched)
                state.current = state.order.index(searched) + 1
            state.waiting = True
            self._answer_waiting(gpu)
        elif kind == "outcome":
            j, outcome = args
            state.finalizing.remove(j)
            wall = time.monotonic() - self.started.get((gpu, j), time.monotonic())
            outcome = dataclasses.replace(outcome, wall_s=wall)
            self.outcomes[(gpu, j)] = outcome
            self.finished(gpu, j, outcome)
            self._answer_waiting(gpu)
        elif kind == "offer":
            state.offer, state.helpers = (args[0], args[1]), 0
            idle = [s for s in self._members(gpu) if s.waiting and not s.more and not s.done]
            if idle:
                self._hand(state, idle[0])
            self._send(state, ("offered", bool(idle)))
        elif kind == "withdraw":
            state.offer = None
            self._send(state, ("helpers", state.helpers))
        elif kind == "helped":
            helped, state.helping = state.helping, None
            self._pass_on(helped, args[0])
        elif kind == "spans":
            self.record(state.rank.name, args[0])
        elif kind == "error":
            raise HostError(f"{state.rank.name}: {args[0]}")

    def _hand(self, state: _State, helper: _State) -> None:
        """Hand the round that the rank of `state` offers of its final round to `helper`, a rank
        of its model with nothing left to do, which re-times it on its GPU meanwhile."""
        j, payloads = state.offer
        state.offer = None
        state.helpers += 1
        helper.waiting = False
        helper.helping = (state, state.restarts)
        self._send(helper, ("help", j, payloads, ROUNDS - 1, ROUNDS))

    def _pass_on(self, helped: tuple[_State, int] | None, result: list[dict[str, Any]] | None) -> None:
        """Give a helper's re-timings (None: it died) to the rank whose final round it shared, if
        that process still awaits them (not one started again since)."""
        if helped is None:
            return
        state, restarts = helped
        if state.restarts == restarts:
            self._send(state, ("helped", result))

    @staticmethod
    def _send(state: _State, message: tuple) -> None:
        """Send a rank `message`; one that has just died gets nothing (and, while the run goes on,
        is started again on the next sweep: `_revive`)."""
        with contextlib.suppress(OSError):
            state.conn.send(message)

    def _revive(self, state: _State) -> None:
        state.process.join()
        code = state.process.exitcode
        state.restarts += 1
        if state.restarts > MAX_RESTARTS:
            raise HostError(
                f"{state.rank.name}: its tuning process died {state.restarts} times "
                f"(last exit code {code}); the studies keep what was done: run again to resume"
            )
        state.conn.close()
        for j in state.finalizing:
            self.assigned.discard((state.rank.gpu, j))
        state.offer, state.helpers = None, 0  # its final round starts again, on offer or not
        helped, state.helping = state.helping, None
        self._pass_on(helped, None)
        self._start(state)
        self._answer_waiting(state.rank.gpu)

    def run(self) -> dict[tuple[Gpu, int], Outcome]:
        url = database_url(self.options.url)
        open_store(url).close()
        studies.prepare(url)
        create_studies(url, dict.fromkeys(s.rank.gpu for s in self.states), self.problems, self.options)
        try:
            for state in self.states:
                self._start(state)
            while not all(self._group_done(s.rank.gpu) for s in self.states):
                check()
                live = {s.conn: s for s in self.states if not s.done}
                for conn in multiprocessing.connection.wait(list(live), timeout=POLL_S):
                    state = live[conn]
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):  # it died: its pipe closed with it
                        self._revive(state)
                        continue
                    self._handle(state, message)
        except BaseException:
            self._stop(terminate=True)
            raise
        self._stop(terminate=False)
        return self.outcomes

    def _last_spans(self, state: _State, deadline: float) -> None:
        """Take what a stopping rank still sends (its last spans) until its pipe closes."""
        with contextlib.suppress(EOFError, OSError):
            while state.conn.poll(max(0.0, deadline - time.monotonic())):
                kind, *args = state.conn.recv()
                if kind == "spans":
                    self.record(state.rank.name, args[0])

    def _stop(self, *, terminate: bool) -> None:
        """Stop the ranks: those still running are told to stop, or with `terminate` (the run is
        interrupted or failed) sent SIGTERM, on which each gives its trials back to the study and
        exits; any still alive after 30 s are killed."""
        for state in self.states:
            if state.process is not None and state.process.is_alive():
                if terminate:
                    state.process.terminate()
                    continue
                self._send(state, ("stop",))
        deadline = time.monotonic() + 30
        for state in self.states:
            if state.process is None:
                continue
            if not terminate:
                self._last_spans(state, deadline)
            state.process.join(max(0.1, deadline - time.monotonic()))
            if state.process.is_alive():
                state.process.kill()
                state.process.join()


def tune_on(
    problems: list[Problem],
    ranks: list[Rank],
    options: TuneOptions,
    progress: Callable[[Gpu, int, dict[str, Any]], None],
    finished: Callable[[Gpu, int, Outcome], None],
    record: Callable[[str, list[Span]], None] = lambda rank, spans: None,
) -> dict[tuple[Gpu, int], Outcome]:
    """Tune every Problem on every GPU model among `ranks`; the Outcome of each (model, Problem
    index). One rank on this process's own device runs here; more run one process per GPU.
    `record` receives each rank's timeline spans (by `Rank.name`) as they come.

    SIGINT (Ctrl-C) or SIGTERM stops the run: every process gives the trials it holds back to the
    study (failed, their Variants queued again) and exits, and `Interrupted` is raised here, so a
    rerun resumes at once rather than after the heartbeat's grace period.

    A Problem whose family builds no kernel for it (features its templates do not render) is
    skipped, with the reason in its Outcome, before any process starts."""
    skips = {j: unrendered(get(p.family), p) for j, p in enumerate(problems)}
    tuned = [j for j, reason in skips.items() if reason is None]
    outcomes = {}
    for gpu in dict.fromkeys(r.gpu for r in ranks):
        for j, reason in skips.items():
            if reason is not None:
                outcomes[(gpu, j)] = Outcome(problems[j], gpu, None, None, 0, 0, None, 0.0, skipped=reason)
                finished(gpu, j, outcomes[(gpu, j)])
    if tuned:
        found = _tune_on(
            [problems[j] for j in tuned],
            ranks,
            options,
            lambda gpu, i, state: progress(gpu, tuned[i], state),
            lambda gpu, i, outcome: finished(gpu, tuned[i], outcome),
            record,
        )
        outcomes.update({(gpu, tuned[i]): outcome for (gpu, i), outcome in found.items()})
    return outcomes


def _tune_on(problems, ranks, options, progress, finished, record) -> dict[tuple[Gpu, int], Outcome]:
    """`tune_on` for Problems that each family builds."""
    with raising():
        if len(ranks) > 1 or ranks[0].visible is not None:
            return _Host(problems, ranks, options, progress, finished, record).run()
        gpu = ranks[0].gpu
        outcomes = {}
        with Tuner(gpu, dataclasses.replace(options, cpus=cores(0, 1))) as tuner:
            for j, problem in enumerate(problems):
                outcome = tuner.tune(problem, lambda state, j=j: progress(gpu, j, state), problems[j + 1 :])
                outcomes[(gpu, j)] = outcome
                record(ranks[0].name, tuner.timeline.take())
                finished(gpu, j, outcome)
        return outcomes
