"""The tuner: an Optuna search over a family's Variants for each (Gpu, Problem), recorded in the
tuning database.

A search is paced to the GPU (flight.py): it asks the sampler for trials, prunes what the
family's cheap constraints reject (or what failed before, or what another process holds), and
compiles just enough of them ahead that the timing worker, which verifies and times one at a
time, never waits. Failures are recorded with their reason and never retried. The study lives in
the tuning database, so an interrupted run resumes and several processes share one search (the
ranks of `tunegen tune --gpus`, or the hosts of a fleet; see study.py for how they divide it).
A Problem's end (final.py) waits for the trials other processes hold, re-times the fastest few
and records the Winner.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from tunegen.kernels.database import database_url, gpu_record, open_store
from tunegen.kernels.families import get
from tunegen.kernels.families.base import choose
from tunegen.kernels.gpu import Gpu, driver_version
from tunegen.kernels.problem import Problem
from tunegen.kernels.variant import Variant
from tunegen.tuning import claims, interrupt
from tunegen.tuning import study as studies
from tunegen.tuning.final import FinalRound, Outcome
from tunegen.tuning.flight import FIRST_AHEAD, GPU_QUEUE, Asks, Flight, Pending
from tunegen.tuning.opening import open_study
from tunegen.tuning.options import TuneOptions
from tunegen.tuning.progress import EVERY_S
from tunegen.tuning.progress import progress as progress_of
from tunegen.tuning.timeline import GPU, SAMPLER, TUNER, Timeline, problem_label
from tunegen.tuning.trial import compile_task, evaluate_task, peers_task, warm_task
from tunegen.tuning.workers import Worker, WorkerPool
from tunegen.tuning.zygote import Zygote
from tunegen.tuning_db import FailureRecord


class Tuner(FinalRound):
    """Tunes Problems on one Gpu; holds the worker processes (forked by `zygote` where given) and
    the database between Problems. `times_peers`: the Problems whose peers this process times (the
    processes sharing a study split them; whoever finishes a Problem times them where nobody did);
    `seeds`: the seed of each Problem's sampler (the run's where not given)."""

    def __init__(
        self,
        gpu: Gpu,
        options: TuneOptions,
        times_peers: Callable[[Problem], bool] = lambda problem: True,
        zygote: Zygote | None = None,
        seeds: Callable[[Problem], int] | None = None,
    ) -> None:
        self.gpu = gpu
        self.options = options
        self.url = database_url(options.url)
        interpret = gpu.backend == "interpreter"
        cpus = options.cpus if options.cpus and len(options.cpus) > 1 else None
        self.timeline = Timeline()
        warm = {"backend": gpu.backend}
        with self.timeline.span(TUNER, "starting workers"):
            # The timing worker first: its CUDA context is the first thing the GPU waits for.
            self.timer = Worker(interpret=interpret, cpus=cpus and cpus[:1], zygote=zygote)
            self._timing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tunegen-timing")
            self._timing.submit(self._on_gpu, "warm-up", None, warm_task, {**warm, "context": True})
            self.pool = WorkerPool(
                options.workers,
                interpret=interpret,
                cpus=cpus and cpus[1:],
                timeline=self.timeline,
                # Forked, all at once: one started mid-run took 3-4 s over its first compile
                # (then its CUDA context, and Triton's first compile) against 1 s after.
                start=options.workers if zygote else min(options.workers, FIRST_AHEAD),
                zygote=zygote,
            )
            for _ in range(self.pool.started):
                self.pool.submit(warm_task, warm, options.trial_timeout, ("warm-up", ""))
        # The workers start (the timing worker's CUDA context, spawned ones their imports) while
        # the database opens.
        try:
            with self.timeline.span(TUNER, "opening the database"):
                self.store = open_store(self.url)
                self.storage = studies.storage(self.url, options.heartbeat_s, options.grace_s)
                self.heartbeat = studies.Heartbeat(self.storage, options.heartbeat_s)
        except BaseException:
            self._stop_workers(abandon=True)
            raise
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.record = gpu_record(gpu, driver_version() if gpu.backend == "cuda" else "")
        self._studies: dict[Problem, optuna.Study] = {}
        self._peers: dict[Problem, dict[str, Any]] = {}
        self._asks: dict[Problem, Asks] = {}
        self._searching: Problem | None = None  # with the two below, see _peers_while_idle
        self._later_peers: list[Problem] = []
        self._peers_tried: set[Problem] = set()
        self.flight = Flight(self.pool.size, self.pool.started if gpu.backend == "cuda" else FIRST_AHEAD)
        self.times_peers = times_peers
        self.seeds = seeds or (lambda problem: options.seed)
        self._reported = 0.0  # when progress was last read for a report

    def close(self, *, abandon: bool = False, failed: bool = False) -> None:
        """Stop the workers and the heartbeat, close the storage and the store. With `abandon` (this
        process stops early: interrupted, or `failed`), work in flight is cut short, not awaited,
        and the trials it holds are failed and their Variants queued again at once, as the
        heartbeat would do `grace_s` after a killed process's last beat (a failure, which a
        Variant may cause, counting against their retries)."""
        self._stop_workers(abandon=abandon)
        self.heartbeat.close(abandon=abandon, counted=failed)
        self.storage.engine.dispose()  # with the last connection to it, SQLite folds its log back in
        self.store.close()

    def _stop_workers(self, *, abandon: bool) -> None:
        """Stop the timing thread and the worker processes (with `abandon`, cutting their work short)."""
        if abandon:
            self.pool.kill()
            self.timer.kill()
        self._timing.shutdown(wait=True, cancel_futures=abandon)
        self.timer.stop()  # it ends while the compile workers do
        self.pool.close()
        self.timer.close()

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(
            abandon=kind is not None, failed=kind is not None and not issubclass(kind, interrupt.Interrupted)
        )

    def _payload(self, problem: Problem, variant: Variant | None, seed: int) -> dict[str, Any]:
        return {
            "problem": problem.as_dict(),
            "variant": variant.to_json() if variant is not None else None,
            "backend": self.gpu.backend,
            "seed": seed,
        }

    def _study(self, problem: Problem) -> optuna.Study:
        """The Problem's shared study, joined or created (opening.py)."""
        if problem not in self._studies:
            self._studies[problem] = open_study(
                self.storage, self.gpu, problem, self.options.sampler, self.seeds(problem)
            )
        return self._studies[problem]

    def tune(
        self,
        problem: Problem,
        progress: Callable[[dict[str, Any]], None] | None = None,
        later: Sequence[Problem] = (),
    ) -> Outcome:
        """Search `problem`'s Variants, then record the fastest verified one as the Winner (`later`:
        the Problems tuned after it, in order, see `search`)."""
        start = time.monotonic()
        self.search(problem, progress, later)
        return self.finalize(problem, progress, start=start, later=later)

    def search(
        self,
        problem: Problem,
        progress: Callable[[dict[str, Any]], None] | None = None,
        later: Sequence[Problem] = (),
    ) -> None:
        """Evaluate trials of `problem` until `trials` are evaluated or held (by any process
        sharing the study), the time limit passes, or the space runs out. Once `problem` has no
        trial left to ask for, the workers compile the first trials of the next of `later` (the
        Problems searched after it, in order) that has any left, and the GPU times them while
        `problem`'s last compiles finish: neither waits."""
        asks = self._asks.get(problem) or self._asking(problem)
        self._asks[problem] = asks
        if progress is not None:  # trials timed while the Problem before it finished count too
            progress(self._progress(asks.study, problem))
        studies.fail_stale(asks.study, self.options.grace_s)
        try:
            self._searching = problem
            self._peers_first(problem, later)
            swept = time.monotonic()
            while True:
                if time.monotonic() - swept > self.options.heartbeat_s:
                    # a dead process's claims stop counting, its Variants come back
                    studies.fail_stale(asks.study, self.options.grace_s)
                    swept = time.monotonic()
                self._dispatch(problem)
                more = self._fill(problem, later, progress)
                self._dispatch(problem, () if more or not self.flight.holds(problem) else later)
                if not more and not self.flight.holds(problem) and not self.flight.timing:
                    return  # nothing of the next Problem is timed ahead of the final round
                self._take(self._wait(), problem, progress)
        finally:
            self._asks.pop(problem, None)
            self._searching, self._later_peers = None, []

    def _asking(self, problem: Problem) -> Asks:
        family = get(problem.family)
        with self.timeline.span(TUNER, "opening the study", problem_label(problem)):
            return Asks(
                study=self._study(problem),
                family=family,
                space=family.search_space(problem, self.gpu),
                failures=self.store.failures(
                    self.record, problem.family, problem.as_dict(), self.gpu.triton_version
                ),
                start=time.monotonic(),
            )

    def _can_ask(self, problem: Problem, asks: Asks) -> bool:
        """Whether `problem` has trials left to ask for: none of its limits reached, and fewer
        than `trials` evaluated or held by the processes sharing its study."""
        opts, study = self.options, asks.study
        if asks.more and (
            (opts.timeout is not None and time.monotonic() - asks.start > opts.timeout)
            or asks.asked >= max(200, 20 * opts.trials)
            or (isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(study))
        ):
            asks.more = False
        return asks.more and claims.claimed(study) < opts.trials

    def _fill(self, problem: Problem, later: Sequence[Problem], progress) -> bool:
        """Ask for trials and start compiling them, `problem`'s first, then those of `later`, in
        order, while the GPU is short of them (Flight.short); whether `problem` has trials left to
        ask. After each ask (tens of ms) the GPU's queue is refilled: a compiled trial never waits
        for the asks. Another process may have taken a later Problem's last trials: then the next."""
        asks = self._asks[problem]
        while self.flight.short(problem):
            if not self._ask(problem, asks):
                break
            self._collect(problem, progress)
        else:
            return True
        # Only while `problem` holds trials: then the later ones' compiled trials take the GPU
        # between the asks, and once it holds none, the next search asks on (the asks here, 50-90
        # ms each, held the GPU idle 1-2 s at each Problem's end, 2 x H200, 2026-11-26).
        self._ask_later(problem, later, progress, lambda: self.flight.holds(problem))
        return False

    def _ask_later(self, current: Problem | None, later: Sequence[Problem], progress, going) -> None:
        """Ask for trials of `later`'s Problems, in order, each until none is left (another process
        may have taken its last), while the GPU is short of trials and `going()`; the compiled
        trials of `current` and `later` are queued on the GPU between the asks."""
        for then in later:
            if not (self.flight.short() and going()):
                return
            ahead = self._asks[then] = self._asks.get(then) or self._asking(then)
            while self.flight.short() and going() and self._ask(then, ahead):
                self._collect(current, progress, later)

    def _collect(self, problem: Problem | None, progress, later: Sequence[Problem] = ()) -> None:
        self._take({f for f in self.flight.futures() if f.done()}, problem, progress)
        self._dispatch(problem, later)

    def _ask(self, problem: Problem, asks: Asks) -> bool:
        """One trial from the sampler, screened (pruned with the reason) or sent to compile; False
        where `problem` has none left to ask for. Up to its claim, the study's trials are read
        once (a snapshot: the count, a queued trial to take, the suggestions); after it, afresh."""
        opts, study = self.options, asks.study
        interrupt.check()  # a signal that has arrived stops this process before it takes a trial
        asking = time.time()
        with self.storage.snapshot():
            if not self._can_ask(problem, asks):
                return False
            trial = studies.ask(study)
            self.heartbeat.hold(trial)
            asks.asked += 1
            with self.storage.batched():  # its owner and its knobs: one transaction
                trial.set_user_attr("owner", self.owner)
                params = choose(asks.family, asks.space, trial.suggest_categorical)
                variant, reason = self._screen(asks.family, params, problem, asks.failures)
        if reason is None:
            reason = claims.claim(self.storage, study, trial, variant.to_json(), opts.trials)
        self.timeline.add(SAMPLER, "asking the sampler", asking, time.time(), problem_label(problem))
        if reason is not None:
            studies.conclude(self.storage, study, trial, {"reason": reason}, state=TrialState.PRUNED)
            self.heartbeat.release(trial)
            return True
        payload = self._payload(problem, variant, opts.seed + trial.number)
        future = self.pool.submit(
            compile_task, payload, opts.trial_timeout, (f"trial {trial.number}", problem_label(problem))
        )
        self.flight.compiling[future] = Pending(problem, trial, variant, payload)
        return True

    def _wait(self) -> set[concurrent.futures.Future]:
        """The futures in flight that are done, once one is; a signal stops the wait (and only
        the wait: see interrupt.py)."""
        while True:
            interrupt.check()
            done, _ = concurrent.futures.wait(
                self.flight.futures(), interrupt.SLICE_S, concurrent.futures.FIRST_COMPLETED
            )
            if done:
                return done

    def _dispatch(self, problem: Problem | None, later: Sequence[Problem] = ()) -> None:
        """Queue `problem`'s compiled trials on the GPU, up to its queue's length; then those of
        `later`, given where `problem` asks for no more and its last compiles would leave it idle;
        where the GPU is left idle all the same, a later Problem's peers (`_peers_while_idle`)."""
        for each in (problem, *later):
            ready = self.flight.ready.get(each)
            while ready and len(self.flight.timing) < GPU_QUEUE:
                self._on_gpu_queue(ready.popleft())
        self._peers_while_idle()

    def _on_gpu_queue(self, pending: Pending) -> None:
        if pending.trial is None:
            future = self._timing.submit(self._on_gpu, "peers", pending.problem, peers_task, pending.payload)
        else:
            future = self._timing.submit(self._evaluate, pending)
        self.flight.timing[future] = pending

    def _evaluate(self, pending: Pending) -> dict[str, Any]:
        start = time.monotonic()
        name = f"trial {pending.trial.number}"
        result = self._on_gpu(name, pending.problem, evaluate_task, pending.payload)
        self.flight.timed(time.monotonic() - start)
        return result

    def _take(self, done, current: Problem, progress) -> None:
        """Tell the studies what the `done` futures found: a compiled Variant waits for the GPU, a
        timed one (or a failure) is concluded, the peers' time kept."""
        for future in done:
            if future in self.flight.compiling:
                pending = self.flight.compiling.pop(future)
                result = future.result()
                if result["status"] == "ok":
                    self.flight.compiled(result["seconds"])
                    self.flight.ready.setdefault(pending.problem, deque()).append(pending)
                    continue
            else:
                pending = self.flight.timing.pop(future)
                result = future.result()
            study = self._study(pending.problem)
            with self.timeline.span(TUNER, "telling the study", problem_label(pending.problem)):
                if pending.trial is None:
                    self._peer_measured(study, pending.problem, result)
                else:
                    self._conclude(study, pending.problem, pending.trial, pending.variant, result)
                if progress and pending.problem == current and time.monotonic() - self._reported > EVERY_S:
                    progress(self._progress(study, current))

    def _conclude(self, study, problem, trial, variant, result) -> None:
        """Tell the study a trial's verified time, or its failure (recorded, never retried); a
        trial whose worker was stopped goes back to the study."""
        if result["status"] == "stopped":
            self.heartbeat.abandon(trial)
            return
        if result["status"] == "ok":
            attrs = {"evaluated": True, "rel_err": result["rel_err"]}
            studies.conclude(self.storage, study, trial, attrs, values=result["ms"])
        else:
            reason = f"{result['status']}: {result['reason']}"
            studies.conclude(
                self.storage, study, trial, {"evaluated": True, "reason": reason}, state=TrialState.FAIL
            )
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

    def _on_gpu(
        self, name: str, problem: Problem | None, task: Any, payload: dict[str, Any]
    ) -> dict[str, Any]:
        """`task(payload)` in the timing worker, recorded on the timeline's GPU lane."""
        with self.timeline.span(GPU, name, problem_label(problem) if problem else ""):
            return self.timer.call(task, payload, self.options.trial_timeout)

    def _screen(self, family, params, problem, known_failures) -> tuple[Variant | None, str | None]:
        """The Variant for `params`, or why it should not be evaluated."""
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
        return variant, None

    def _progress(self, study: optuna.Study, problem: Problem) -> dict[str, Any]:
        self._reported = time.monotonic()
        return progress_of(study, problem, self.options.trials, self._peer(study, problem) or {})
