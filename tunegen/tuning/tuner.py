"""The tuner: an Optuna search over a family's Variants for each (Gpu, Problem), recorded in the
tuning database.

A search keeps every compile worker busy: whenever one is free it asks the sampler for the next
trial, prunes what the family's cheap constraints reject (or what failed before, or what another
process holds), and compiles it; compiled Variants are verified and timed one at a time on the
GPU, in the timing worker, while others compile. Failures are recorded with their reason and
never retried. The study lives in the tuning database, so an interrupted run resumes and several
processes share one search (the ranks of `tunegen tune --gpus`, or the hosts of a fleet; see
study.py for how they divide it). Finishing a Problem waits for the trials other processes still
hold, re-times the fastest few and records the Winner.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from tunegen.kernels.database import database_url, gpu_record, open_store
from tunegen.kernels.families import get
from tunegen.kernels.families.base import choose
from tunegen.kernels.gpu import Gpu, driver_version
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import template_hash
from tunegen.kernels.variant import Variant
from tunegen.tuning import study as studies
from tunegen.tuning.interrupt import deferred
from tunegen.tuning.options import TuneOptions
from tunegen.tuning.timing import rate
from tunegen.tuning.trial import compile_task, evaluate_task, peers_task
from tunegen.tuning.workers import Worker, WorkerPool
from tunegen.tuning_db import FailureRecord, WinnerRecord

FINALISTS = 3
FINAL_REP_MS = 400.0
# Rounds of waiting for other processes' trials, then evaluating the queued copies of abandoned ones.
SETTLE_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What tuning one Problem on one Gpu produced."""

    problem: Problem
    gpu: Gpu
    winner: WinnerRecord | None
    recorded: str | None
    evaluated: int
    failed: int
    found_at: int | None
    wall_s: float


class Tuner:
    """Tunes Problems on one Gpu; holds the worker processes and the database between Problems."""

    def __init__(self, gpu: Gpu, options: TuneOptions) -> None:
        self.gpu = gpu
        self.options = options
        self.url = database_url(options.url)
        self.store = open_store(self.url)
        self.storage = studies.storage(self.url, options.heartbeat_s, options.grace_s)
        self.heartbeat = studies.Heartbeat(self.storage, options.heartbeat_s)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        interpret = gpu.backend == "interpreter"
        cpus = options.cpus if options.cpus and len(options.cpus) > 1 else None
        self.pool = WorkerPool(options.workers, interpret=interpret, cpus=cpus and cpus[1:])
        self.timer = Worker(interpret=interpret, cpus=cpus and cpus[:1])
        self._timing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tunegen-timing")
        self.record = gpu_record(gpu, driver_version() if gpu.backend == "cuda" else "")
        self._studies: dict[Problem, optuna.Study] = {}
        self._peers: dict[Problem, dict[str, Any]] = {}

    def close(self, *, abandon: bool = False) -> None:
        """Stop the workers and the heartbeat, close the store. With `abandon` (this process stops
        early: interrupted, or failing), work in flight is cut short, not awaited, and the trials
        this process holds are failed and their Variants queued again at once, as the heartbeat
        would do `grace_s` after a killed process's last beat."""
        with deferred():  # a signal meanwhile would leave workers and threads behind
            if abandon:
                self.pool.kill()
                self.timer.kill()
            self._timing.shutdown(wait=True)
            self.heartbeat.close(abandon=abandon)
            self.pool.close()
            self.timer.close()
            self.store.close()

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(abandon=kind is not None)

    def _payload(self, problem: Problem, variant: Variant | None, seed: int) -> dict[str, Any]:
        return {
            "problem": problem.as_dict(),
            "variant": variant.to_json() if variant is not None else None,
            "backend": self.gpu.backend,
            "seed": seed,
        }

    def _study(self, problem: Problem) -> optuna.Study:
        """The Problem's shared study, created (its first trial the default Variant, so a Winner
        is never slower than what dispatch would run untuned) or joined."""
        if problem in self._studies:
            return self._studies[problem]
        family = get(problem.family)
        space = family.search_space(problem, self.gpu)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        name = studies.study_name(self.gpu, problem, self.options.sampler)
        sampler = studies.make_sampler(self.options.sampler, self.options.seed, space)
        with deferred():  # a study made and not given its default would never get it
            try:
                study = optuna.create_study(
                    study_name=name, storage=self.storage, sampler=sampler, direction="minimize"
                )
            except optuna.exceptions.DuplicatedStudyError:  # another process's, or an earlier run's
                study = optuna.load_study(study_name=name, storage=self.storage, sampler=sampler)
            else:  # this process made it: its first trial is the default Variant
                default = family.default_variant(problem, self.gpu).as_dict()
                params = choose(
                    family, space, lambda name, values: default[name] if default[name] in values else None
                )
                if None not in params.values():
                    study.enqueue_trial(params)
        self._studies[problem] = study
        return study

    def tune(self, problem: Problem, progress: Callable[[dict[str, Any]], None] | None = None) -> Outcome:
        """Search `problem`'s Variants, then record the fastest verified one as the Winner."""
        start = time.monotonic()
        self.search(problem, progress)
        return self.finalize(problem, progress, start=start)

    def search(self, problem: Problem, progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Evaluate trials of `problem` until `trials` are evaluated or held (by any process
        sharing the study), the time limit passes, or the space runs out."""
        start = time.monotonic()
        opts = self.options
        family = get(problem.family)
        space = family.search_space(problem, self.gpu)
        study = self._study(problem)
        studies.fail_stale(study, opts.grace_s)
        known_failures = self.store.failures(
            self.record, problem.family, problem.as_dict(), self.gpu.triton_version
        )
        compiling: dict[concurrent.futures.Future, tuple] = {}
        ready: deque[tuple] = deque()
        timing: tuple | None = None
        if problem not in self._peers:  # first, while the first Variants compile: the bar to beat
            payload = self._payload(problem, None, opts.seed)
            timing = (
                self._timing.submit(self.timer.call, peers_task, payload, opts.trial_timeout),
                None,
                None,
            )
        asked, more, swept = 0, True, time.monotonic()
        while True:
            if time.monotonic() - swept > opts.heartbeat_s:
                studies.fail_stale(
                    study, opts.grace_s
                )  # a dead process's claims stop counting, its Variants come back
                swept = time.monotonic()
            while more and len(compiling) + len(ready) < self.pool.size:
                if (
                    (opts.timeout is not None and time.monotonic() - start > opts.timeout)
                    or asked >= max(200, 20 * opts.trials)
                    or (
                        isinstance(study.sampler, optuna.samplers.GridSampler)
                        and study.sampler.is_exhausted(study)
                    )
                ):
                    more = False
                    break
                if studies.claimed(study) >= opts.trials:
                    break
                with deferred():  # a trial asked for is held before a signal can stop this process
                    trial = studies.ask(study)
                    self.heartbeat.hold(trial)
                    trial.set_user_attr("owner", self.owner)
                asked += 1
                params = choose(family, space, trial.suggest_categorical)
                variant, reason = self._screen(family, params, problem, study, trial, known_failures)
                if reason is not None:
                    studies.conclude(study, trial, {"reason": reason}, state=TrialState.PRUNED)
                    self.heartbeat.release(trial)
                    continue
                payload = self._payload(problem, variant, opts.seed + trial.number)
                future = self.pool.submit(compile_task, payload, opts.trial_timeout)
                compiling[future] = (trial, variant, payload)
            if timing is None and ready:
                trial, variant, payload = ready.popleft()
                future = self._timing.submit(self.timer.call, evaluate_task, payload, opts.trial_timeout)
                timing = (future, trial, variant)
            if not compiling and timing is None:
                return
            waiting = [*compiling, *([timing[0]] if timing else [])]
            done, _ = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
            with deferred():  # results are told whole: a signal lands while waiting, not mid-write
                self._take(study, problem, done, compiling, ready, timing, progress)
            timing = None if timing is not None and timing[0] in done else timing

    def _take(self, study, problem, done, compiling, ready, timing, progress) -> None:
        """Tell the study what the `done` futures found: a compiled Variant goes to `ready`, a
        timed one (or a failure) is concluded, the peers' time kept."""
        for future in done:
            if future in compiling:
                trial, variant, payload = compiling.pop(future)
                if future.result()["status"] == "ok":
                    ready.append((trial, variant, payload))
                    continue
            else:
                _, trial, variant = timing
            if trial is None:
                self._peer_measured(study, problem, future.result())
            else:
                self._conclude(study, problem, trial, variant, future.result())
            if progress is not None:
                progress(self._progress(study, problem))

    def _peer_measured(self, study: optuna.Study, problem: Problem, result: dict[str, Any]) -> None:
        """Keep the fastest peer's time (for the progress line and the Winner's record), and share
        it through the study with the other processes tuning the Problem."""
        if result["status"] == "ok":
            self._peers[problem] = {"name": result["name"], "ms": result["ms"]}
            study.set_user_attr("peer", self._peers[problem])

    def _peer(self, study: optuna.Study, problem: Problem) -> dict[str, Any] | None:
        """The fastest peer measured in this run: by this process, else by another one."""
        return self._peers.get(problem) or study.user_attrs.get("peer")

    def _conclude(self, study, problem, trial, variant, result) -> None:
        """Tell the study a trial's verified time, or its failure (recorded, never retried); a
        trial whose worker was stopped goes back to the study."""
        if result["status"] == "stopped":
            self.heartbeat.abandon(trial)
            return
        if result["status"] == "ok":
            attrs = {"evaluated": True, "rel_err": result["rel_err"]}
            studies.conclude(study, trial, attrs, values=result["ms"])
        else:
            reason = f"{result['status']}: {result['reason']}"
            studies.conclude(study, trial, {"evaluated": True, "reason": reason}, state=TrialState.FAIL)
            self.store.record_failure(
                FailureRecord(
                    self.record,
                    problem.family,
                    problem.as_dict(),
                    variant.as_dict(),
                    self.gpu.triton_version,
                    reason,
                )
            )
        self.heartbeat.release(trial)

    def finalize(
        self,
        problem: Problem,
        progress: Callable[[dict[str, Any]], None] | None = None,
        *,
        start: float | None = None,
    ) -> Outcome:
        """Wait for the trials other processes hold on `problem` (a dead holder's are failed and
        their Variants evaluated here), then re-time the fastest few and record the Winner, with
        the best peer's time on the same Problem."""
        start = time.monotonic() if start is None else start
        study = self._study(problem)
        self._settle(study, problem, progress)
        if self._peer(study, problem) is None:
            payload = self._payload(problem, None, self.options.seed)
            self._peer_measured(
                study, problem, self.timer.call(peers_task, payload, self.options.trial_timeout)
            )
        peer = self._peer(study, problem) or {}
        return self._finish(study, problem, get(problem.family), peer, start)

    def _settle(self, study: optuna.Study, problem: Problem, progress) -> None:
        opts = self.options
        deadline = time.monotonic() + opts.grace_s + 3 * opts.trial_timeout
        for _ in range(SETTLE_ROUNDS):
            while time.monotonic() < deadline:
                studies.fail_stale(study, opts.grace_s)
                if not any(studies.holds_claim(t) for t in study.get_trials(deepcopy=False)):
                    break
                time.sleep(min(1.0, opts.heartbeat_s))
            if studies.claimed(study) >= opts.trials or not study.get_trials(
                deepcopy=False, states=(TrialState.WAITING,)
            ):
                return
            self.search(problem, progress)

    def _final_round(self, problem: Problem, complete: list) -> tuple[Any, float]:
        """Re-time the fastest few with longer runs, back to back, and keep the fastest: one short
        timing can be off by a few percent, more than separates the leaders."""
        ranked = sorted(complete, key=lambda t: (t.value, t.number))[:FINALISTS]
        if len(ranked) == 1 or self.gpu.backend != "cuda":
            return ranked[0], float(ranked[0].value)
        timed = []
        for trial in ranked:
            payload = self._payload(problem, None, self.options.seed + trial.number)
            payload.update(variant=trial.user_attrs["variant"], rep_ms=FINAL_REP_MS)
            result = self.timer.call(evaluate_task, payload, self.options.trial_timeout)
            if result["status"] == "ok":
                timed.append((result["ms"], trial.number, trial))
        if not timed:
            return ranked[0], float(ranked[0].value)
        ms, _, trial = min(timed)
        return trial, float(ms)

    def _screen(
        self, family, params, problem, study, trial, known_failures
    ) -> tuple[Variant | None, str | None]:
        """The Variant for `params` with this trial's claim on it written, or why it should not
        be evaluated now."""
        try:
            variant = family.variant_type(**params)
        except ValueError as exc:
            return None, f"constraint: {exc}"
        reason = family.constraint(variant, problem, self.gpu)
        if reason is not None:
            return None, f"constraint: {reason}"
        config = variant.to_json()
        if config in known_failures:
            return None, f"failed before: {known_failures[config]}"
        trial.set_user_attr("variant", config)
        reason = studies.conflict(study, trial, config)
        return (None, reason) if reason else (variant, None)

    def _progress(self, study: optuna.Study, problem: Problem) -> dict[str, Any]:
        complete = [
            t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE
        ]
        done = sum(1 for t in study.get_trials(deepcopy=False) if studies.evaluated(t))
        best = min((t.value for t in complete), default=None)
        unit, work = get(problem.family).measure(problem)
        peer = self._peer(study, problem) or {}
        return {
            "evaluated": done,
            "target": self.options.trials,
            "best_ms": best,
            "unit": unit,
            "best_rate": rate(unit, work, best) if best else None,
            "peer_name": peer.get("name"),
            "peer_rate": rate(unit, work, peer["ms"]) if peer.get("ms") else None,
        }

    def _finish(self, study, problem, family, peer, start) -> Outcome:
        trials = study.get_trials(deepcopy=False)
        evaluated = [t for t in trials if studies.evaluated(t)]
        failed = sum(1 for t in evaluated if t.state == optuna.trial.TrialState.FAIL)
        complete = [t for t in evaluated if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            return Outcome(
                problem, self.gpu, None, None, len(evaluated), failed, None, time.monotonic() - start
            )
        best, ms = self._final_round(problem, complete)
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
