"""The tuner: an Optuna search over a family's Variants for each (Gpu, Problem), recorded in the
tuning database.

Each round asks the sampler for a batch of trials, prunes those the family's cheap constraints
reject (or that already failed, or that another fleet worker is running), compiles the rest in
parallel worker processes, then verifies and times them one at a time on the GPU in a timing
worker. Failures are recorded with their reason and never retried. The study lives in the same
database, so an interrupted run resumes and several workers share one search.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import optuna
import torch

from tunegen.kernels.database import database_url, gpu_record, open_store
from tunegen.kernels.families import get
from tunegen.kernels.families.base import choose
from tunegen.kernels.gpu import Gpu, driver_version
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import template_hash
from tunegen.kernels.variant import Variant
from tunegen.tuning.timing import rate
from tunegen.tuning.trial import compile_task, evaluate_task, peers_task
from tunegen.tuning.workers import Worker, WorkerPool
from tunegen.tuning_db import FailureRecord, WinnerRecord

SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp")
STALE_AFTER_S = 3600.0
FINALISTS = 3
FINAL_REP_MS = 400.0


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """How hard to search: evaluated trials per Problem, a time limit per Problem, the sampler."""

    trials: int = 40
    timeout: float | None = None
    sampler: str = "tpe"
    seed: int = 0
    workers: int = 8
    trial_timeout: float = 120.0
    url: str | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What tuning one Problem produced."""

    problem: Problem
    winner: WinnerRecord | None
    recorded: str | None
    evaluated: int
    failed: int
    found_at: int | None
    wall_s: float


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid without its own stop: Study.stop only works inside optimize(), and the
    tuner asks and tells, stopping by itself once every grid point was asked."""

    def after_trial(self, study: optuna.Study, trial: Any, state: Any, values: Any) -> None:
        return None


def make_sampler(name: str, seed: int, space: dict[str, list]) -> optuna.samplers.BaseSampler:
    """The Optuna sampler called `name`, seeded."""
    if name == "tpe":
        # group: knobs of one schedule are searched together, apart from another schedule's (an
        # option Optuna still marks experimental, which users need not be warned about).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return _Grid(space, seed=seed)
    if name == "cmaes":
        # CMA-ES has no categorical model: Optuna hands those knobs to its independent sampler.
        return optuna.samplers.CmaEsSampler(
            seed=seed, independent_sampler=optuna.samplers.TPESampler(seed=seed)
        )
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    raise ValueError(f"sampler: expected one of {SAMPLERS}, got {name!r}")


def study_name(gpu: Gpu, problem: Problem, sampler: str) -> str:
    """One study per (Gpu, Problem, Triton version, sampler): what fleet workers share."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.name.lower()).strip("-")
    digest = hashlib.sha256(problem.to_json().encode()).hexdigest()[:16]
    return f"tunegen-{problem.family}-{slug}-{gpu.backend}-triton{gpu.triton_version}-{sampler}-{digest}"


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _fail_stale(study: optuna.Study) -> None:
    """Trials left running by a process that died (this host), or by anyone an hour ago, failed."""
    host = socket.gethostname()
    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = trial.user_attrs.get("owner", "")
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        dead = False
        if owner.startswith(host + ":"):
            try:
                os.kill(int(owner.rsplit(":", 1)[1]), 0)
            except (ProcessLookupError, ValueError):
                dead = True
        if dead or now - started > STALE_AFTER_S:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)


class Tuner:
    """Tunes Problems on one Gpu; holds the worker processes and the database between Problems."""

    def __init__(self, gpu: Gpu, options: TuneOptions) -> None:
        if options.sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {SAMPLERS}, got {options.sampler!r}")
        if options.trials < 1:
            raise ValueError(f"trials: expected at least 1, got {options.trials}")
        self.gpu = gpu
        self.options = options
        self.url = database_url(options.url)
        self.store = open_store(self.url)
        self.storage = optuna.storages.RDBStorage(self.url)
        interpret = gpu.backend == "interpreter"
        self.pool = WorkerPool(options.workers, interpret=interpret)
        self.timer = Worker(interpret=interpret)
        self.record = gpu_record(gpu, driver_version() if gpu.backend == "cuda" else "")

    def close(self) -> None:
        self.pool.close()
        self.timer.close()
        self.store.close()

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _payload(self, problem: Problem, variant: Variant | None, seed: int) -> dict[str, Any]:
        return {
            "problem": problem.as_dict(),
            "variant": variant.to_json() if variant is not None else None,
            "backend": self.gpu.backend,
            "seed": seed,
        }

    def tune(self, problem: Problem, progress: Callable[[dict[str, Any]], None] | None = None) -> Outcome:
        """Search `problem`'s Variants until `trials` were evaluated (or the time limit), then
        record the fastest verified one as the Winner."""
        start = time.monotonic()
        opts = self.options
        family = get(problem.family)
        space = family.search_space(problem, self.gpu)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=study_name(self.gpu, problem, opts.sampler),
            storage=self.storage,
            sampler=make_sampler(opts.sampler, opts.seed, space),
            direction="minimize",
            load_if_exists=True,
        )
        _fail_stale(study)
        if not study.trials:
            # The default Variant goes first, so a Winner is never slower than what dispatch
            # would run untuned.
            default = family.default_variant(problem, self.gpu).as_dict()
            params = choose(
                family, space, lambda name, values: default[name] if default[name] in values else None
            )
            if None not in params.values():
                study.enqueue_trial(params)
        problem_dict = problem.as_dict()
        known_failures = self.store.failures(
            self.record, problem.family, problem_dict, self.gpu.triton_version
        )
        peer = self.timer.call(peers_task, self._payload(problem, None, opts.seed), opts.trial_timeout)
        asked = 0

        def evaluated() -> list[optuna.trial.FrozenTrial]:
            return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("evaluated")]

        while True:
            done = evaluated()
            if len(done) >= opts.trials or asked >= max(200, 20 * opts.trials):
                break
            if opts.timeout is not None and time.monotonic() - start > opts.timeout:
                break
            if isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(study):
                break
            batch = []
            for _ in range(min(opts.workers, opts.trials - len(done))):
                trial = study.ask()
                asked += 1
                trial.set_user_attr("owner", _owner())
                params = choose(family, space, trial.suggest_categorical)
                variant, reason = self._screen(family, params, problem, study, trial, known_failures)
                if reason is not None:
                    trial.set_user_attr("reason", reason)
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    continue
                trial.set_user_attr("variant", variant.to_json())
                batch.append((trial, variant))
            payloads = [self._payload(problem, v, opts.seed + t.number) for t, v in batch]
            compiled = self.pool.map(compile_task, payloads, opts.trial_timeout)
            for (trial, variant), payload, result in zip(batch, payloads, compiled, strict=True):
                trial.set_user_attr("evaluated", True)
                if result["status"] == "ok":
                    result = self.timer.call(evaluate_task, payload, opts.trial_timeout)
                if result["status"] == "ok":
                    trial.set_user_attr("rel_err", result["rel_err"])
                    study.tell(trial, result["ms"])
                else:
                    reason = f"{result['status']}: {result['reason']}"
                    trial.set_user_attr("reason", reason)
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    self.store.record_failure(
                        FailureRecord(
                            self.record,
                            problem.family,
                            problem_dict,
                            variant.as_dict(),
                            self.gpu.triton_version,
                            reason,
                        )
                    )
                if progress is not None:
                    progress(self._progress(study, problem))
        return self._finish(study, problem, family, peer, start)

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
        """The Variant for `params`, or why it should not be evaluated now."""
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
        for other in study.get_trials(deepcopy=False):
            if other.number == trial.number or other.user_attrs.get("variant") != config:
                continue
            if other.state == optuna.trial.TrialState.COMPLETE:
                return None, f"duplicate of trial {other.number}"
            if other.state == optuna.trial.TrialState.RUNNING and other.number < trial.number:
                return None, f"being evaluated as trial {other.number}"
            if other.state == optuna.trial.TrialState.FAIL:
                return None, f"failed as trial {other.number}"
        return variant, None

    def _progress(self, study: optuna.Study, problem: Problem) -> dict[str, Any]:
        complete = [
            t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE
        ]
        done = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("evaluated"))
        best = min((t.value for t in complete), default=None)
        unit, work = get(problem.family).measure(problem)
        return {
            "evaluated": done,
            "target": self.options.trials,
            "best_ms": best,
            "unit": unit,
            "best_rate": rate(unit, work, best) if best else None,
        }

    def _finish(self, study, problem, family, peer, start) -> Outcome:
        trials = study.get_trials(deepcopy=False)
        evaluated = [t for t in trials if t.user_attrs.get("evaluated")]
        failed = sum(1 for t in evaluated if t.state == optuna.trial.TrialState.FAIL)
        complete = [t for t in evaluated if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            return Outcome(problem, None, None, len(evaluated), failed, None, time.monotonic() - start)
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
        return Outcome(problem, winner, recorded, len(evaluated), failed, found_at, time.monotonic() - start)
