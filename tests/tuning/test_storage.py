"""The study storage that the processes of a tuning run share: calls that only read never queue
for SQLite's write lock (another process writing does not stall them), calls that write still
take it when they begin, and what a trial's process sets in a row (its owner and parameters;
its result's attributes) is written in one transaction, or not at all if it fails, and its
suggestions read the study's trials once (`snapshot`)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from tunegen.tuning import claims
from tunegen.tuning import study as studies
from tunegen.tuning.samplers import make_sampler

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


def _queries(monkeypatch, storage) -> list[int]:
    """A counter of `storage`'s reads of trials that reach the database."""
    queried = [0]
    read = optuna.storages.RDBStorage._get_trials

    def count(self, *args, **kwargs):
        queried[0] += self is storage
        return read(self, *args, **kwargs)

    monkeypatch.setattr(optuna.storages.RDBStorage, "_get_trials", count)
    return queried


def test_a_snapshot_reads_the_trials_once_for_its_thread_only(shared, monkeypatch):
    storage, study, _ = shared
    for _ in range(3):
        studies.ask(study)
    queried = _queries(monkeypatch, storage)
    with storage.snapshot():
        for _ in range(5):
            assert [t.number for t in study.get_trials(deepcopy=False)] == [0, 1, 2]
        assert queried[0] == 1
        elsewhere = threading.Thread(target=study.get_trials)
        elsewhere.start()
        elsewhere.join()
        assert queried[0] == 2, "another thread reads the database"
    for _ in range(3):
        study.get_trials(deepcopy=False)
    assert queried[0] == 5, "outside, each read reads"
    with pytest.raises(RuntimeError), storage.snapshot():
        study.get_trials(deepcopy=False)
        raise RuntimeError("a suggestion failed")
    study.get_trials(deepcopy=False)
    assert queried[0] == 7, "a snapshot that raised is over"


def test_a_snapshot_holds_what_was_written_before_it_and_a_read_after_it_sees_what_came_since(
    shared, monkeypatch
):
    storage, study, path = shared
    studies.ask(study)
    # another process's trial, started and finished before the snapshot
    other = optuna.load_study(study_name="s", storage=studies.storage(f"sqlite:///{path}", 10, 60))
    other.tell(studies.ask(other), 1)
    queried = _queries(monkeypatch, storage)
    with storage.snapshot():
        seen = [[(t.number, t.state) for t in study.get_trials(deepcopy=False)] for _ in range(3)]
        studies.ask(other)  # and one started during it
        during = [t.number for t in study.get_trials(deepcopy=False)]
    # Optuna's cache asks for other trials after its first read, all within that one read
    assert queried[0] == 1
    assert seen == [[(0, TrialState.RUNNING), (1, TrialState.COMPLETE)]] * 3 and during == [0, 1]
    assert [t.number for t in study.get_trials(deepcopy=False)] == [0, 1, 2]


def _search(path, snapshot: bool) -> list[tuple[dict, TrialState]]:
    """15 trials of a TPE study on conditional knobs, each asked as `Tuner._ask` asks: owner and
    suggestions in one batch (in a snapshot or not), then the claim."""
    storage = studies.storage(f"sqlite:///{path}", heartbeat_s=10, grace_s=60)
    space = {"a": [1, 2], "b": [16, 32, 64], "c": [1, 2, 3], "d": [4, 8]}
    sampler = make_sampler("tpe", 7, space)
    study = optuna.create_study(study_name="s", storage=storage, sampler=sampler)
    for _ in range(15):
        trial = studies.ask(study)
        with storage.batched(), storage.snapshot() if snapshot else contextlib.nullcontext():
            trial.set_user_attr("owner", "me")
            params = {name: trial.suggest_categorical(name, space[name]) for name in ("a", "b")}
            knob = "c" if params["a"] == 1 else "d"  # another group of knobs
            params[knob] = trial.suggest_categorical(knob, space[knob])
        reason = claims.claim(storage, study, trial, repr(params), 15)
        if reason is not None:
            studies.conclude(storage, study, trial, {"reason": reason}, state=TrialState.PRUNED)
        else:
            studies.conclude(storage, study, trial, {"evaluated": True}, values=params["b"] * params[knob])
    return [(t.params, t.state) for t in study.trials]


def test_the_ask_path_suggests_from_a_snapshot_what_it_did_from_reads_spread_over_it(tmp_path):
    searched = _search(tmp_path / "snapshot.db", snapshot=True)
    assert len(searched) == 15 and {s for _, s in searched} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert searched == _search(tmp_path / "reads.db", snapshot=False)


def test_a_run_creates_each_study_once_with_its_default_first_and_its_processes_join_without_the_lock(
    tmp_path,
):
    """The host creates every study of a run before its ranks start (`create_studies`): each once,
    its first trial the default Variant, however often asked; a rank then joins one by reading
    only, while another process holds the write lock (creating them together, ranks queued for it
    0.2-0.7 s at their start)."""
    from helpers import tiny_problems
    from tunegen.kernels.families import get
    from tunegen.kernels.gpu import interpreter_gpu
    from tunegen.tuning.opening import create_studies, open_study
    from tunegen.tuning.options import TuneOptions

    path, gpu, problems = tmp_path / "run.db", interpreter_gpu(), tiny_problems()
    url = f"sqlite:///{path}"
    studies.prepare(url)
    options = TuneOptions(url=url)
    for _ in range(2):
        create_studies(url, [gpu, gpu], problems, options)
    storage = studies.storage(url, heartbeat_s=10, grace_s=60)
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(storage))
    assert names == sorted(studies.study_name(gpu, p, options.sampler) for p in problems)
    for problem in problems:
        study = optuna.load_study(
            study_name=studies.study_name(gpu, problem, options.sampler), storage=storage
        )
        (queued,) = study.get_trials(states=(TrialState.WAITING,))
        default = get(problem.family).default_variant(problem, gpu).as_dict()
        assert all(default[knob] == value for knob, value in queued.params.items())
    joined = []
    seconds = _while_locked(path, lambda: joined.append(open_study(storage, gpu, problems[0], "tpe", 0)))
    assert seconds < HOLD_S / 2, "joining waited for the write lock"
    assert len(joined[0].get_trials(states=(TrialState.WAITING,))) == 1, "joined, not queued again"
