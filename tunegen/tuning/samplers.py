"""The Optuna samplers a tuning run may search with (`tunegen tune --sampler`), by name."""

from __future__ import annotations

import warnings
from typing import Any

import optuna

SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp")


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid without its own stop (Study.stop works only in optimize(); the tuner stops)."""

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
