"""What a Problem's progress line shows, read from its study: the trials evaluated against the
target, the best time and rate so far, and the best peer's rate."""

from __future__ import annotations

from typing import Any

import optuna

from tunegen.kernels.families import get
from tunegen.kernels.problem import Problem
from tunegen.tuning import claims
from tunegen.tuning.timing import rate

# Between two progress reports of a search, at least this long: each reads every trial of the
# study, whose unfinished ones (every rank's in flight) Optuna reads afresh from the database,
# which took 5-8 ms with 10-20 in flight on the 2-core CI machine.
EVERY_S = 0.5


def progress(study: optuna.Study, problem: Problem, target: int, peer: dict[str, Any]) -> dict[str, Any]:
    """The progress of `problem`'s search in `study`, against `target` trials, beside `peer`
    (the fastest peer's name and ms, or empty)."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    done = sum(1 for t in trials if claims.evaluated(t))
    best = min((t.value for t in complete), default=None)
    unit, work = get(problem.family).measure(problem)
    return {
        "evaluated": done,
        "target": target,
        "best_ms": best,
        "unit": unit,
        "best_rate": rate(unit, work, best) if best else None,
        "peer_name": peer.get("name"),
        "peer_rate": rate(unit, work, peer["ms"]) if peer.get("ms") else None,
    }
