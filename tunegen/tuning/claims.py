"""How the processes sharing a study divide its trials: what counts as a claim on a Variant (a
trial evaluated, or being evaluated), and claiming one.

A trial holds a Variant once its "variant" attribute is written (its claim). Claims are decided
one at a time, each looking at those before it in the same transaction (`claim`), so of two
processes that pick the same Variant at once exactly one evaluates it.
"""

from __future__ import annotations

import json
from typing import Any

import optuna
import sqlalchemy
from optuna.storages._rdb import models as _models
from optuna.storages._rdb import storage as _rdb
from optuna.trial import FrozenTrial, TrialState


def _evaluated(state: TrialState, attrs: dict[str, Any]) -> bool:
    return bool(attrs.get("evaluated")) and (state != TrialState.FAIL or "reason" in attrs)


def evaluated(trial: FrozenTrial) -> bool:
    """Whether the trial's Variant was verified and timed, or failed doing so. Not a timed trial
    its process never told (killed between the two writes of `conclude`): failed as abandoned."""
    return _evaluated(trial.state, trial.user_attrs)


def _holds(state: TrialState, attrs: dict[str, Any]) -> bool:
    return state == TrialState.RUNNING and "variant" in attrs


def holds_claim(trial: FrozenTrial) -> bool:
    """Whether a live process is evaluating the trial's Variant."""
    return _holds(trial.state, trial.user_attrs)


def claimed(study: optuna.Study) -> int:
    """Trials evaluated or being evaluated: what counts against the number asked for."""
    return sum(1 for t in study.get_trials(deepcopy=False) if evaluated(t) or holds_claim(t))


# The user attributes a claim is decided on.
_CLAIM_KEYS = ("variant", "evaluated", "reason")


def claim(
    storage: optuna.storages.RDBStorage, study: optuna.Study, trial: optuna.Trial, config: str, target: int
) -> str | None:
    """Write `trial`'s claim on the Variant `config`, unless other trials' claims rule it out:
    then why (a claim on the Variant, or `target` claims already made: processes that asked for
    a Problem's last trials at once went past the target, 5 of 9 Problems on 2 x H200, 2026-11-26).

    The look and the claim are one transaction under the lock on the study's row that Optuna
    takes to number its trials (SQLite's write lock, there), so claims are decided one at a time:
    of two processes that pick the same Variant at once exactly one evaluates it, and a trial that
    steps back never rules out another. (Claims written first and looked at after let both step
    back, and a stepped-back trial counted against the target: a grid point was lost for good,
    7 of 8 Variants evaluated by two processes on PostgreSQL, CI, 2026-11-27.)"""
    T, A = _models.TrialModel, _models.TrialUserAttributeModel
    with _rdb._create_scoped_session(storage.scoped_session) as session:
        _models.StudyModel.find_or_raise_by_id(study._study_id, session, for_update=True)
        rows = session.execute(
            sqlalchemy.select(T.number, T.state, A.key, A.value_json)
            .join(A, A.trial_id == T.trial_id)
            .where(T.study_id == study._study_id, T.trial_id != trial._trial_id, A.key.in_(_CLAIM_KEYS))
        )
        others: dict[int, tuple[TrialState, dict[str, Any]]] = {}
        for number, state, key, value in rows:
            others.setdefault(number, (state, {}))[1][key] = json.loads(value)
        reason = _ruled_out(others, config, target)
        if reason is None:
            session.add(A(trial_id=trial._trial_id, key="variant", value_json=json.dumps(config)))
    return reason


def _ruled_out(others: dict[int, tuple[TrialState, dict[str, Any]]], config: str, target: int) -> str | None:
    if sum(_evaluated(state, attrs) or _holds(state, attrs) for state, attrs in others.values()) >= target:
        return f"the {target} trials asked for were claimed before it"
    for number, (state, attrs) in sorted(others.items()):
        if attrs.get("variant") != config:
            continue
        if state == TrialState.COMPLETE:
            return f"duplicate of trial {number}"
        if state == TrialState.FAIL and _evaluated(state, attrs):
            return f"failed as trial {number}"
        if state == TrialState.RUNNING:
            return f"being evaluated as trial {number}"
    return None
