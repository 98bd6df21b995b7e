"""The Optuna side of tuning: study names, the storage with heartbeats, and how trials are
concluded by several processes sharing one study (how they are claimed and counted: claims.py;
samplers: samplers.py).

A process records a heartbeat for every trial it holds; a trial whose heartbeat stops (the process
was killed) is failed by whoever next looks, and its Variant is queued again, so a dead worker
leaves nothing running for good.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import optuna
import sqlalchemy
from optuna.storages._rdb import models as _models
from optuna.storages._rdb import storage as _rdb
from optuna.trial import FrozenTrial, TrialState

from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem

# A Variant whose trial was abandoned (its process died) this many times is not queued again.
MAX_RETRIES = 2
log = logging.getLogger("tunegen")


def study_name(gpu: Gpu, problem: Problem, sampler: str) -> str:
    """One study per (Gpu, Problem, Triton version, sampler): what fleet workers share."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.name.lower()).strip("-")
    digest = hashlib.sha256(problem.to_json().encode()).hexdigest()[:16]
    return f"tunegen-{problem.family}-{slug}-{gpu.backend}-triton{gpu.triton_version}-{sampler}-{digest}"


def _requeue(study: optuna.Study, trial: FrozenTrial, *, died: bool = True) -> None:
    """Queue an abandoned trial's Variant again: its process died (which the Variant may have
    caused, so this happens `MAX_RETRIES` times at most), or it gave the trial back as it stopped
    (`died` False: not the Variant's doing, not counted)."""
    retries = int(trial.user_attrs.get("retries", 0))
    if trial.params and retries < MAX_RETRIES:
        attrs = {"retries": retries + 1 if died else retries, "retry_of": trial.number}
        study.enqueue_trial(trial.params, user_attrs=attrs)


# RDBStorage's methods that only read: their transactions need not take SQLite's write lock.
_READS = (
    "get_all_studies", "get_study_id_from_name", "get_study_name_from_id", "get_study_directions",
    "get_study_user_attrs", "get_study_system_attrs", "get_all_trials", "_get_trials", "get_trial",
    "get_n_trials", "get_best_trial", "get_trial_id_from_study_id_trial_number",
    "get_trial_number_from_id", "get_trial_param", "get_trial_params", "get_trial_user_attrs",
    "get_trial_system_attrs", "_get_stale_trial_ids",
)  # fmt: skip


class _Storage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage that marks, per thread, when one of its calls only reads, that writes
    what a trial's process sets in a row (parameters, attributes) in one transaction (`batched`)
    rather than one each, and can answer a trial's suggestions' reads from one (`snapshot`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reading = threading.local()
        self._batch = threading.local()
        self._snap = threading.local()
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Inside, this thread's reads of a study's trials are answered from its first: one read
        for an ask up to its claim (the count, a queued trial, TPE's read per knob group and for its
        search space). As valid as reads spread over it: another process's trial written meanwhile
        is a race either way, a queued trial is taken only if its state still says queued (checked
        under the write lock), and this trial's parameters are in neither read (its batch holds
        them). Not for `claims.claim`, which reads afresh. Other threads unaffected."""
        outer = getattr(self._snap, "reads", None)
        self._snap.reads = [] if outer is None else outer  # nested: the outer one's
        try:
            yield
        finally:
            self._snap.reads = outer

    def _get_trials(self, study_id: int, states: Any, included_trial_ids: set, trial_id_greater_than: int):
        """RDBStorage's; in a `snapshot`, cut from a read there of the same study and states that
        asked for all this one does. Not copies: Optuna's cache and samplers only read them (a live
        trial's own record comes from `get_trial`); deep copies were a third of an ask's time."""
        reads, above = getattr(self._snap, "reads", None), trial_id_greater_than
        ids = {i for i in included_trial_ids if i <= above}  # as RDBStorage counts them
        for study, kept_states, kept_ids, kept_above, trials in reads or ():
            covers = kept_above <= above and all(i in kept_ids or i > kept_above for i in ids)
            if covers and (study, kept_states) == (study_id, states):
                return [t for t in trials if t._trial_id in ids or t._trial_id > above]
        trials = super()._get_trials(study_id, states, included_trial_ids, above)
        if reads is not None:
            reads.append((study_id, states, ids, above, trials))
        return trials

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """The parameters and user attributes this thread sets inside are written as it ends, in
        one transaction; none if it raises (a trial left without parameters is not queued again)."""
        if not all(hasattr(self, m) for m in _BATCHED):  # another Optuna: one by one
            yield
            return
        self._batch.pending = pending = []
        try:
            yield
        finally:
            self._batch.pending = None
        if pending:
            with _rdb._create_scoped_session(self.scoped_session) as session:
                for write, args in pending:
                    write(session, *args)

    def _pending(self) -> list | None:
        return getattr(self._batch, "pending", None)

    def _set_trial_param(self, *args: Any) -> None:
        pending = self._pending()
        if pending is None:
            super()._set_trial_param(*args)
        else:
            pending.append((self._set_trial_param_without_commit, args))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        pending = self._pending()
        if pending is None:
            super().set_trial_user_attr(trial_id, key, value)
        else:
            pending.append((self._set_user_attr, (trial_id, key, value)))

    def _set_user_attr(self, session: Any, trial_id: int, key: str, value: Any) -> None:
        self._set_trial_attr_without_commit(session, _models.TrialUserAttributeModel, trial_id, key, value)


# What `_Storage.batched` calls of RDBStorage inside one session (Optuna 5's private methods).
_BATCHED = ("_set_trial_param", "_set_trial_param_without_commit", "_set_trial_attr_without_commit")


def _read_only(method: Any) -> Any:
    @functools.wraps(method)
    def read(self: _Storage, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(self.reading, "on", False)
        self.reading.on = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self.reading.on = outer

    return read


for _name in _READS:
    if hasattr(optuna.storages.RDBStorage, _name):  # names differ between Optuna releases
        setattr(_Storage, _name, _read_only(getattr(_Storage, _name)))


def storage(url: str, heartbeat_s: int, grace_s: int) -> optuna.storages.RDBStorage:
    """Optuna's storage on the tuning database, with heartbeats: a trial not heard from for
    `grace_s` seconds is failed and its Variant queued again."""
    engine: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several tuning processes write one SQLite file: wait for its lock, as the store does.
        engine["connect_args"] = {"timeout": 60}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        rdb = _Storage(
            url,
            engine_kwargs=engine,
            heartbeat_interval=heartbeat_s,
            grace_period=grace_s,
            heartbeat_stale_trial_callback=_requeue,
        )
    if rdb.engine.dialect.name == "sqlite":
        _serialize(rdb.engine, rdb.reading)
    return rdb


def _serialize(engine: sqlalchemy.engine.Engine, reading: threading.local) -> None:
    """Make each SQLite transaction that may write take the database's write lock when it begins.
    Optuna checks a trial's state, then changes it (a queued trial handed out, a stale one failed)
    under a row lock that SQLite does not have: without this, two processes can both take the
    same queued trial. SQLAlchemy's recipe: pysqlite's own transaction handling off, BEGIN
    IMMEDIATE on begin. A call that only reads (`reading.on`, set by `_Storage`) begins a plain
    transaction instead: in WAL mode it reads a snapshot while another process writes, and the
    processes sharing a study, which read every trial several times per trial they run, do not
    queue behind each other's reads.

    And keep each transaction short: a trial still takes about a dozen (its creation, its
    heartbeats, its owner, parameters and claim as one batch, its result), and each that writes
    holds the lock the other processes sharing the study wait for. With the default rollback
    journal each commit waits for the disk twice; in WAL mode with `synchronous=NORMAL` it waits
    for none (the log reaches the disk at checkpoints): a crash of the process loses nothing, a
    power cut at most the last transactions, never the file. WAL mode stays with the file;
    SQLite folds the log back in when the last connection closes."""

    @sqlalchemy.event.listens_for(engine, "connect")
    def _manual(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    @sqlalchemy.event.listens_for(engine, "begin")
    def _immediate(connection: sqlalchemy.engine.Connection) -> None:
        connection.exec_driver_sql("BEGIN" if getattr(reading, "on", False) else "BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners existed


def prepare(url: str) -> None:
    """Create Optuna's tables in the tuning database now: processes that start together and find
    them missing would race to create them. Another program creating them at the same moment (a
    second `tunegen tune` on the same new database) makes this try fail; the next finds them."""
    for attempt in range(3):
        try:
            optuna.storages.RDBStorage(url).engine.dispose()
            return
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == 2:
                raise
            time.sleep(0.5)


def ask(study: optuna.Study) -> optuna.Trial:
    """A new trial (a queued one first). Optuna warns that heartbeats are meant for optimize();
    the tuner asks and tells, and records the heartbeats itself (Heartbeat)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask()


def fail_stale(study: optuna.Study, grace_s: float) -> None:
    """Fail the trials whose holder stopped beating (each is failed by one process only, which
    queues its Variant again); and those of a process killed between asking for a trial and its
    first heartbeat, which Optuna cannot see: no owner written `grace_s` after they started."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        start = trial.datetime_start
        if "owner" in trial.user_attrs or start is None or (now - start).total_seconds() < grace_s:
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            continue  # another process failed it first, and queued it again
        _requeue(study, trial)


def conclude(
    storage: _Storage, study: optuna.Study, trial: optuna.Trial, attrs: dict[str, Any], **tell: Any
) -> bool:
    """Record the trial's attributes (in one transaction) and result; False if another process had
    already failed it as abandoned (its heartbeat was late), in which case its queued copy stands."""
    try:
        with storage.batched():
            for name, value in attrs.items():
                trial.set_user_attr(name, value)
        study.tell(trial, **tell)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
        log.warning("tunegen tune: trial %d was concluded elsewhere (%s)", trial.number, exc)
        return False
    return True


class Heartbeat:
    """Records, every `interval_s` seconds, that this process still holds its trials."""

    def __init__(self, storage: optuna.storages.RDBStorage, interval_s: int) -> None:
        self._storage = storage
        self._interval = interval_s
        self._held: dict[int, optuna.Study] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tunegen-heartbeat", daemon=True)
        self._thread.start()

    def hold(self, trial: optuna.Trial) -> None:
        """Beat for `trial` from now on (the first beat at once, before any claim is written)."""
        with self._lock:
            self._held[trial._trial_id] = trial.study
        self._storage.record_heartbeat(trial._trial_id)

    def release(self, trial: optuna.Trial) -> None:
        with self._lock:
            self._held.pop(trial._trial_id, None)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                held = sorted(self._held)
            for trial_id in held:
                try:
                    self._storage.record_heartbeat(trial_id)
                except Exception as exc:  # a busy database: the next beat tries again
                    log.debug("tunegen tune: heartbeat of trial %d not recorded: %s", trial_id, exc)

    def abandon(self, trial: optuna.Trial) -> None:
        """Give back a held trial this process will not finish (its worker was stopped): failed,
        its Variant queued again, as `fail_stale` does for a dead process's, but at once. It stays
        held until then: a Ctrl-C reaching the worker and this process together must find it
        either given back or still held (and so given back by `close`), never neither."""
        self._give_back(trial._trial_id, trial.study)
        self.release(trial)

    def _give_back(self, trial_id: int, study: optuna.Study, *, counted: bool = False) -> None:
        try:
            if self._storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                _requeue(study, self._storage.get_trial(trial_id), died=counted)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # concluded a moment ago
        except Exception as exc:  # the database is unreachable: the grace period will do it
            log.warning("tunegen tune: trial %d left to the heartbeat's grace: %s", trial_id, exc)

    def close(self, *, abandon: bool = False, counted: bool = False) -> None:
        """Stop beating. With `abandon` (this process stops without finishing its trials), give
        back every trial it still holds (`abandon`): nobody waits out the grace period for them.
        `counted`: the process is failing, which a Variant may cause, so each requeue counts
        against its retries as a dead process's would."""
        self._stop.set()
        self._thread.join()
        if abandon:
            with self._lock:
                held, self._held = self._held, {}
            for trial_id, study in held.items():
                self._give_back(trial_id, study, counted=counted)
