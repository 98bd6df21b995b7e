"""The study storage that the processes of a tuning run share: calls that only read never queue
for SQLite's write lock (another process writing does not stall them), calls that write still
take it when they begin, and what a trial's process sets in a row (its owner, parameters and
claim; its result's attributes) is written in one transaction, or not at all if it fails."""

from __future__ import annotations

import sqlite3
import threading
import time

import optuna
import pytest
import sqlalchemy

from tunegen.tuning import study as studies

HOLD_S = 1.5


@pytest.fixture
def shared(tmp_path):
    """A study on a fresh SQLite file through tunegen's storage, and the file's path."""
    path = tmp_path / "study.db"
    storage = studies.storage(f"sqlite:///{path}", heartbeat_s=10, grace_s=60)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=storage)
    return storage, study, path


def _while_locked(path, call) -> float:
    """Seconds `call` took while another connection held the file's write lock for HOLD_S."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(HOLD_S, holder.execute, ("COMMIT",)).start()
    start = time.monotonic()
    call()
    took = time.monotonic() - start
    time.sleep(max(0.0, HOLD_S - took) + 0.2)
    holder.close()
    return took


def test_reads_do_not_wait_for_a_writer_and_writes_do(shared):
    storage, study, path = shared
    trial = studies.ask(study)
    trial.suggest_categorical("block_m", [64, 128])
    assert _while_locked(path, lambda: study.get_trials(deepcopy=False)) < HOLD_S / 2
    assert _while_locked(path, lambda: storage.get_trial(trial._trial_id)) < HOLD_S / 2
    assert _while_locked(path, lambda: trial.set_user_attr("variant", "x")) >= HOLD_S * 0.9
    assert storage.get_trial(trial._trial_id).user_attrs["variant"] == "x"


def _writes(storage) -> list[int]:
    """A counter of the transactions that begin to write (those not marked as reading)."""
    begun = [0]

    def count(_connection) -> None:
        begun[0] += not getattr(storage.reading, "on", False)

    sqlalchemy.event.listen(storage.engine, "begin", count)
    return begun


def test_a_batch_is_written_in_one_transaction_as_it_ends(shared):
    storage, study, _ = shared
    trial = studies.ask(study)
    begun = _writes(storage)
    with storage.batched():
        trial.set_user_attr("owner", "me")
        params = {name: trial.suggest_categorical(name, [1, 2, 3]) for name in ("a", "b", "c", "d")}
        trial.set_user_attr("variant", repr(params))
        assert begun[0] == 0, "nothing written before the batch ends"
        assert storage.get_trial(trial._trial_id).params == {}
    assert begun[0] == 1, "the batch's one transaction"
    stored = storage.get_trial(trial._trial_id)
    assert stored.params == params and stored.user_attrs == {"owner": "me", "variant": repr(params)}
    assert studies.conclude(storage, study, trial, {"evaluated": True, "rel_err": 0.5}, values=1.0)
    done = study.trials[0]
    assert done.value == 1.0 and done.user_attrs["rel_err"] == 0.5 and done.user_attrs["evaluated"]


def test_a_batch_that_fails_writes_nothing_and_writes_after_it_go_through(shared):
    storage, study, _ = shared
    trial = studies.ask(study)
    with pytest.raises(RuntimeError), storage.batched():
        trial.suggest_categorical("a", [1, 2])
        trial.set_user_attr("variant", "a")
        raise RuntimeError("screening failed")
    stored = storage.get_trial(trial._trial_id)
    assert stored.params == {} and stored.user_attrs == {}
    trial.set_user_attr("reason", "later")  # outside any batch: written at once
    assert storage.get_trial(trial._trial_id).user_attrs == {"reason": "later"}


def test_a_batch_checks_distributions_against_the_study_as_single_writes_do(shared):
    storage, study, _ = shared
    first = studies.ask(study)
    with storage.batched():
        first.suggest_categorical("a", [1, 2])
    second = studies.ask(study)
    # written straight to the storage, past Optuna's cache: the check is the batch's own
    with pytest.raises(ValueError), storage.batched():
        storage.set_trial_param(
            second._trial_id, "a", 0, optuna.distributions.CategoricalDistribution([7, 8, 9])
        )
