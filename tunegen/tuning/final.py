"""A Problem's end, for the Tuner: wait until no process holds a trial of it, re-time the
fastest few back to back (sharing the re-timings with processes that have nothing left to do,
where it has any), and record the Winner with the best peer's time (kept apart from the search in
tuner.py, whose Tuner it is part of)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from tunegen.kernels.families import get
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import template_hash
from tunegen.tuning import claims
from tunegen.tuning import study as studies
from tunegen.tuning.flight import Pending
from tunegen.tuning.interrupt import SLICE_S, check, pause
from tunegen.tuning.retiming import Helpers, Retiming, queue
from tunegen.tuning.timeline import TUNER, WAIT_OTHERS, problem_label
from tunegen.tuning.timing import rate
from tunegen.tuning.trial import evaluate_task, peers_task
from tunegen.tuning_db import WinnerRecord

FINALISTS = 3
# A GPU that would wait for compiles times a later Problem's peers only where its next compile is
# due no sooner than this: a Problem's peers take the GPU 0.4-1 s (2 x H200, 2026-11-26), and a
# compile that ends meanwhile waits for them.
PEERS_S = 0.5
FINAL_REP_MS = 400.0
# Rounds of waiting for other processes' trials, then evaluating the queued copies of abandoned ones.
SETTLE_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What tuning one Problem on one Gpu produced; `skipped`: why it was not tuned (its family
    builds no kernel for it), None where it was."""

    problem: Problem
    gpu: Gpu
    winner: WinnerRecord | None
    recorded: str | None
    evaluated: int
    failed: int
    found_at: int | None
    wall_s: float
    skipped: str | None = None


class FinalRound:
    """The Tuner's final round on a Problem, and the peers' times it records beside the Winner (a
    part of Tuner, which provides the study, the timing worker, the store and the search it calls
    back into)."""

    def finalize(
        self,
        problem: Problem,
        progress: Callable[[dict[str, Any]], None] | None = None,
        *,
        start: float | None = None,
        later: Sequence[Problem] = (),
        helpers: Helpers | None = None,
    ) -> Outcome:
        """Wait for the trials other processes hold on `problem` (a dead holder's are failed and
        their Variants evaluated here), then re-time the fastest few, with `helpers` where given,
        and record the Winner, with the best peer's time on the same Problem. Trials compiled
        meanwhile (the next Problem's) are timed first (`_time_compiled`), and while the final
        round runs, trials of `later` (the Problems this process searches next, in order) are
        asked for and compile (`_search_ahead`): the Outcome's wall time includes them."""
        start = time.monotonic() if start is None else start
        study = self._study(problem)
        # Asked for ahead and settled since (`settle`), its asks start afresh: the final round may
        # search for what a dead process left.
        self._asks.pop(problem, None)
        self._time_compiled()
        self._settle(study, problem, progress)
        self._time_compiled()
        return self._finish(study, problem, get(problem.family), start, later, helpers)

    def help_final(
        self, problem: Problem, payloads: list[dict[str, Any]], index: int, rounds: int
    ) -> list[dict[str, Any]]:
        """Re-time round `index` of `rounds` of another process's final round on `problem` (its
        finalists' `payloads`, see retiming.py): the results, in the finalists' order."""
        futures = queue(self._submit_final(problem), payloads, index, rounds)
        while not all(f.done() for f in futures):
            check()
            concurrent.futures.wait(futures, SLICE_S)
        return [f.result() for f in futures]

    def _time_compiled(self) -> None:
        """Queue on the GPU the trials compiled meanwhile (the next Problem's), all of them past
        GPU_QUEUE, ahead of this one's final round, and tell the studies what those timed found:
        the processes sharing their study could run out of trials to take while these wait (on
        2 x H200 the other GPU idled 3 s at a run's end for eight of them)."""
        self._take({f for f in self.flight.futures() if f.done()}, None, None)
        for ready in self.flight.ready.values():
            while ready:
                self._on_gpu_queue(ready.popleft())

    def _time_own(self, seconds: float) -> None:
        """Wait `seconds` (stopped by a signal), timing this process's own trials in flight
        meanwhile: the process whose trials this one waits for may itself be waiting, in a final
        round of its own, for trials this one asked for ahead."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            check()
            self._time_compiled()
            futures = self.flight.futures()
            if not futures:
                pause(left)
                return
            concurrent.futures.wait(futures, min(left, SLICE_S), concurrent.futures.FIRST_COMPLETED)
        self._time_compiled()

    def settle(self, problem: Problem) -> None:
        """Ask for no more trials of `problem`, which another process has searched (its final round
        may have begun); those this process asked for ahead are still compiled and timed."""
        if problem in self._asks:
            self._asks[problem].more = False

    def _peer_measured(self, study: optuna.Study, problem: Problem, result: dict[str, Any]) -> None:
        """Keep the fastest peer's time (for the progress line and the Winner's record), and share
        it through the study with the other processes tuning the Problem."""
        if result["status"] == "ok":
            self._peers[problem] = {"name": result["name"], "ms": result["ms"]}
            study.set_user_attr("peer", self._peers[problem])

    def _peers_first(self, problem: Problem, later: Sequence[Problem]) -> None:
        """Queue `problem`'s peers, the bar to beat, timed while its first Variants compile; and
        keep, in order, the Problems of `later` whose peers this process times, for the moments
        its GPU would otherwise wait (`_peers_while_idle`)."""
        self._time_peers(problem)
        self._later_peers = [p for p in later if self.times_peers(p) and p not in self._peers_tried]
        self._peers_while_idle()

    def _peers_while_idle(self) -> None:
        """Where the GPU has nothing to time nor any compiled trial waiting while the Problem
        searched has trials compiling, queue the peers of the next Problem this process times
        later, which it times anyway, rather than leave the GPU idle: at a run's start while the
        first Variants compile, and each time a GPU joins a Problem whose first compiles have not
        ended (0.7-1 s per GPU each time, 2 x H200, 2026-11-26). One at a time, so that a compiled
        trial waits behind one at most, and only where the next compile is not due within
        PEERS_S; never once the search holds nothing, whose final round would wait for them; and
        once per run for each Problem (whose peers may have failed)."""
        searching = self._searching
        if searching is None or self.flight.timing or any(self.flight.ready.values()):
            return
        due = self.flight.due_in(searching)
        if not self.flight.holds(searching) or (due is not None and due < PEERS_S):
            return
        while self._later_peers:
            later = self._later_peers.pop(0)
            self._peers_tried.add(later)
            if self._time_peers(later):
                return

    def _time_peers(self, problem: Problem) -> bool:
        """Queue the timing of `problem`'s peers on the GPU, if this process times them and they
        are neither timed nor queued; whether it queued them."""
        if not self.times_peers(problem) or self._peer(self._study(problem), problem) is not None:
            return False
        if any(p.trial is None and p.problem == problem for p in self.flight.timing.values()):
            return False
        self._on_gpu_queue(Pending(problem, None, None, self._payload(problem, None, self.options.seed)))
        return True

    def _peer(self, study: optuna.Study, problem: Problem) -> dict[str, Any] | None:
        """The fastest peer measured in this run: by this process, else by another one."""
        return self._peers.get(problem) or study.user_attrs.get("peer")

    def _settle(self, study: optuna.Study, problem: Problem, progress) -> None:
        opts = self.options
        deadline = time.monotonic() + opts.grace_s + 3 * opts.trial_timeout
        for _ in range(SETTLE_ROUNDS):
            with self.timeline.span(TUNER, WAIT_OTHERS, problem_label(problem)):
                while time.monotonic() < deadline:
                    studies.fail_stale(study, opts.grace_s)
                    # Unclaimed ones too: a process killed between asking for a trial and claiming
                    # it leaves one running, which fail_stale fails `grace_s` after it began.
                    if not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                        break
                    self._time_own(min(1.0, opts.heartbeat_s))
            if claims.claimed(study) >= opts.trials or not study.get_trials(
                deepcopy=False, states=(TrialState.WAITING,)
            ):
                return
            self.search(problem, progress)

    def _final_round(
        self, problem: Problem, complete: list, helpers: Helpers | None = None
    ) -> tuple[list, Retiming | None]:
        """The fastest few, and their re-timings with a longer run, back to back on the GPU (with
        `helpers` where given, see retiming.py): one short timing can be off by a few percent,
        more than separates the leaders. None to re-time where one trial completed, or off a GPU."""
        ranked = sorted(complete, key=lambda t: (t.value, t.number))[:FINALISTS]
        if len(ranked) == 1 or not self._retimes():
            return [], None
        payloads = []
        for trial in ranked:
            payload = self._payload(problem, None, self.options.seed + trial.number)
            payload.update(variant=trial.user_attrs["variant"], rep_ms=FINAL_REP_MS)
            payloads.append(payload)
        return ranked, Retiming(self._submit_final(problem), payloads, helpers)

    def _retimes(self) -> bool:
        """Whether final rounds re-time: on a GPU, not under the interpreter, whose wall clock
        ranks nothing."""
        return self.gpu.backend == "cuda"

    def _submit_final(self, problem: Problem) -> Callable[[dict[str, Any]], concurrent.futures.Future]:
        """How a final round's re-timing of `problem` is queued on the GPU."""

        def submit(payload: dict[str, Any]) -> concurrent.futures.Future:
            return self._timing.submit(self._on_gpu, "final round", problem, evaluate_task, payload)

        return submit

    def _search_ahead(
        self,
        running: list[concurrent.futures.Future],
        later: Sequence[Problem],
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        """Until the GPU has done `running` (a Problem's peers and final round), ask for trials of
        `later` and compile them (`_ask_later`), queueing the compiled ones behind it: the GPU goes
        on to them at once. Asked afterwards, their asks and compiles left the GPU idle 1-1.4 s
        after each final round (2 x H200, 2026-11-26). `tick` runs between the waits."""
        while pending := [f for f in running if not f.done()]:
            check()
            tick()
            self._ask_later(None, later, None, lambda: not all(f.done() for f in running))
            # what is still running: a finished one would end the wait at once, every time
            concurrent.futures.wait(
                [*pending, *self.flight.futures()], SLICE_S, concurrent.futures.FIRST_COMPLETED
            )
            self._collect(None, None, later)

    def _finish(self, study, problem, family, start, later, helpers) -> Outcome:
        trials = study.get_trials(deepcopy=False)
        evaluated = [t for t in trials if claims.evaluated(t)]
        failed = sum(1 for t in evaluated if t.state == optuna.trial.TrialState.FAIL)
        complete = [t for t in evaluated if t.state == optuna.trial.TrialState.COMPLETE]
        peers = None
        if self._peer(study, problem) is None:  # nobody timed them: this process does, now
            payload = self._payload(problem, None, self.options.seed)
            peers = self._timing.submit(self._on_gpu, "peers", problem, peers_task, payload)
        ranked, retiming = self._final_round(problem, complete, helpers) if complete else ([], None)
        running = [*([peers] if peers else []), *(retiming.futures() if retiming else [])]
        self._search_ahead(running, later, retiming.poll if retiming else lambda: None)
        if peers is not None:
            self._peer_measured(study, problem, peers.result())
        peer = self._peer(study, problem) or {}
        if not complete:
            return Outcome(
                problem, self.gpu, None, None, len(evaluated), failed, None, time.monotonic() - start
            )
        results = zip(ranked, retiming.results() if retiming else [], strict=True)
        retimed = [(r["ms"], t.number, t) for t, r in results if r["status"] == "ok"]
        if retimed:
            ms, _, best = min(retimed)
        else:  # one trial completed, off a GPU, or the final round failed: the search's time stands
            best = min(complete, key=lambda t: (t.value, t.number))
            ms = best.value
        ms = float(ms)
        found_at = 1 + sorted(t.number for t in evaluated).index(best.number)
        variant = family.variant_type.from_json(best.user_attrs["variant"])
        unit, work = family.measure(problem)
        winner = WinnerRecord(
            gpu=self.record,
            family=problem.family,
            problem=problem.as_dict(),
            variant=variant.as_dict(),
            median_ms=ms,
            rel_err=float(best.user_attrs["rel_err"]),
            triton_version=self.gpu.triton_version,
            torch_version=self.gpu.torch_version,
            template_hash=template_hash(family.template),
            cuda_version=torch.version.cuda or "",
            **{("tflops" if unit == "TFLOP/s" else "gbps"): rate(unit, work, ms)},
            peer_name=peer.get("name"),
            peer_ms=peer.get("ms"),
        )
        recorded = self.store.record_winner(winner)
        return Outcome(
            problem, self.gpu, winner, recorded, len(evaluated), failed, found_at, time.monotonic() - start
        )
