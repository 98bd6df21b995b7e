"""A Problem's study: joined where it exists, else created with the default Variant queued as its
first trial (so that a Winner is never slower than what dispatch would run untuned); and every
study of a run created up front, before the processes that share them start."""

from __future__ import annotations

from collections.abc import Iterable

import optuna

from tunegen.kernels.families import get
from tunegen.kernels.families.base import choose
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning import study as studies
from tunegen.tuning.interrupt import check
from tunegen.tuning.options import TuneOptions
from tunegen.tuning.samplers import make_sampler


def open_study(
    storage: optuna.storages.BaseStorage, gpu: Gpu, problem: Problem, sampler: str, seed: int
) -> optuna.Study:
    """The study of `problem` on `gpu` with `sampler` (seeded `seed`), joined or created. Joining
    only reads, where creating takes the database's write lock, for which processes starting
    together queued (0.2-0.7 s of a rank's start on 2 x H200, 2026-11-26)."""
    family = get(problem.family)
    space = family.search_space(problem, gpu)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = studies.study_name(gpu, problem, sampler)
    chosen = make_sampler(sampler, seed, space)
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=chosen)
    except KeyError:  # none yet
        pass
    try:
        study = optuna.create_study(study_name=name, storage=storage, sampler=chosen, direction="minimize")
    except optuna.exceptions.DuplicatedStudyError:  # another process made it meanwhile
        return optuna.load_study(study_name=name, storage=storage, sampler=chosen)
    default = family.default_variant(problem, gpu).as_dict()
    params = choose(family, space, lambda knob, values: default[knob] if default[knob] in values else None)
    if None not in params.values():
        study.enqueue_trial(params)
    return study


def create_studies(url: str, gpus: Iterable[Gpu], problems: list[Problem], options: TuneOptions) -> None:
    """Create (or find) the study of every Problem on every Gpu model in the database at `url`,
    for the processes about to share them, which then only join them."""
    storage = studies.storage(url, options.heartbeat_s, options.grace_s)
    try:
        for gpu in gpus:
            for problem in problems:
                check()  # a signal stops this before the ranks are started
                open_study(storage, gpu, problem, options.sampler, options.seed)
    finally:
        storage.engine.dispose()
