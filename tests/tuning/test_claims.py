"""How the processes sharing a study divide its trials (`claims.claim`): a claim on a Variant is
decided against the claims made before it, one at a time, so no Variant is evaluated twice, none
is lost because two processes stepped back from it together, and the number of trials asked for
holds however many processes ask for the last ones at once."""

from __future__ import annotations

import threading

import optuna
import pytest
from optuna.trial import TrialState

from tunegen.tuning import claims
from tunegen.tuning import study as studies

CLAIMANTS = 4
ROUNDS = 8


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'claims.db'}"
    return request.getfixturevalue("postgres_url")


def _study(url: str) -> tuple[optuna.storages.RDBStorage, optuna.Study]:
    storage = studies.storage(url, heartbeat_s=10, grace_s=60)
    return storage, optuna.load_study(study_name="s", storage=storage)


def _at_once(url: str, configs: list[str], target: int) -> dict[int, str | None]:
    """Each of `configs` claimed by its own process (a thread with its own connections), the
    claims made together once every trial is asked for: trial number -> why it stepped back."""
    storages = [_study(url) for _ in configs]
    trials = [studies.ask(study) for _, study in storages]
    start = threading.Barrier(len(configs))
    reasons: dict[int, str | None] = {}

    def claimant(i: int) -> None:
        storage, study = storages[i]
        start.wait()
        reasons[trials[i].number] = claims.claim(storage, study, trials[i], configs[i], target)

    threads = [threading.Thread(target=claimant, args=(i,)) for i in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for storage, _ in storages:
        storage.engine.dispose()
    return reasons


def test_of_processes_claiming_one_variant_at_once_exactly_one_holds_it(url):
    studies.prepare(url)
    optuna.create_study(study_name="s", storage=url)
    for round_ in range(ROUNDS):
        reasons = _at_once(url, [f"v{round_}"] * CLAIMANTS, target=1000)
        (holder,) = [number for number, reason in reasons.items() if reason is None]
        assert all(r == f"being evaluated as trial {holder}" for n, r in reasons.items() if n != holder)
    study = _study(url)[1]
    held = {t.user_attrs["variant"] for t in study.get_trials(deepcopy=False) if claims.holds_claim(t)}
    assert held == {f"v{r}" for r in range(ROUNDS)}, "one claim per Variant written"
    assert claims.claimed(study) == ROUNDS


def test_processes_claiming_the_last_trials_at_once_stop_at_the_target(url):
    studies.prepare(url)
    optuna.create_study(study_name="s", storage=url)
    for round_ in range(ROUNDS):
        target = 2 * (round_ + 1)
        reasons = _at_once(url, [f"v{round_}.{i}" for i in range(CLAIMANTS)], target)
        assert sum(reason is None for reason in reasons.values()) == 2
        stepped_back = f"the {target} trials asked for were claimed before it"
        assert all(r in (None, stepped_back) for r in reasons.values())
    assert claims.claimed(_study(url)[1]) == 2 * ROUNDS


@pytest.fixture
def shared(tmp_path):
    storage = studies.storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_s=10, grace_s=60)
    return storage, optuna.create_study(study_name="s", storage=storage)


def test_a_timed_trial_never_told_is_not_evaluated_once_failed_as_abandoned(shared):
    """`conclude` writes a result's attributes, then tells the study: a process killed between the
    two leaves a running trial marked evaluated, which the heartbeat fails as abandoned. Counted as
    evaluated, its Variant was ruled out for good ("failed as trial N") though it never failed."""
    storage, study = shared
    outcomes = {}
    for name, attrs, tell in (
        ("timed", {"evaluated": True, "rel_err": 0.0}, {"values": 1.0}),
        ("failed", {"evaluated": True, "reason": "wrong: relative error 1"}, {"state": TrialState.FAIL}),
        ("abandoned", {"evaluated": True, "rel_err": 0.0}, {"state": TrialState.FAIL}),
    ):
        trial = studies.ask(study)
        assert claims.claim(storage, study, trial, name, 10) is None
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        study.tell(trial, **tell)
        outcomes[name] = claims.evaluated(storage.get_trial(trial._trial_id))
    assert outcomes == {"timed": True, "failed": True, "abandoned": False}
    assert claims.claim(storage, study, studies.ask(study), "failed", 10) == "failed as trial 1"
    assert claims.claim(storage, study, studies.ask(study), "timed", 10) == "duplicate of trial 0"
    fresh = studies.ask(study)
    assert claims.claim(storage, study, fresh, "abandoned", 10) is None, "its Variant may be evaluated again"
    assert storage.get_trial(fresh._trial_id).user_attrs["variant"] == "abandoned"


def test_a_claim_past_the_target_steps_back_and_holds_nothing(shared):
    """Trials evaluated or held count against the target; those pruned or abandoned, and those
    that stepped back, leave room."""
    storage, study = shared
    for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
        done = studies.ask(study)
        assert claims.claim(storage, study, done, f"v{done.number}", 10) is None
        done.set_user_attr("evaluated", state == TrialState.COMPLETE)
        study.tell(done, 1.0 if state == TrialState.COMPLETE else None, state=state)
    first, second, third = studies.ask(study), studies.ask(study), studies.ask(study)
    assert claims.claim(storage, study, second, "b", 2) is None
    assert claims.claim(storage, study, first, "a", 2) == "the 2 trials asked for were claimed before it"
    assert "variant" not in storage.get_trial(first._trial_id).user_attrs
    assert claims.claim(storage, study, third, "a", 3) is None
