"""Ctrl-C and SIGTERM: a tuning process (one process, or the host of `--gpus` and its ranks) gives
the trials it holds back to the shared study before it exits (failed, their Variants queued again),
exits with the signal's code and one line, and a rerun starts at once instead of waiting out the
heartbeat's grace period."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
import sqlalchemy
import torch
from conftest import NEEDS_GPU
from optuna.trial import TrialState

from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning import study as studies
from tunegen.tuning.claims import evaluated
from tunegen.tuning.interrupt import Interrupted, pause, raising
from tunegen.tuning.presets import dry_run, parse_shape, problems
from tunegen.tuning.study import study_name
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning.workers import Worker

INTERPRETING = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="tuner tests run kernels under the interpreter"
)
MAIN_THREAD = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only"
)
GPU = interpreter_gpu()
# The Problem `tunegen tune --dry-run --shape 4,2,32 --seqlens 512 --causal no` tunes.
PROBLEM = dry_run(problems([parse_shape("4,2,32")], causal=(False,), seqlens=(512,))[0])
TUNE = ["tune", "--dry-run", "--shape", "4,2,32", "--seqlens", "512", "--causal", "no", "--trials", "4"]


def _wait_for_signal() -> None:
    pause(10)


@MAIN_THREAD
def test_signals_raise_once_at_a_wait_and_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught, raising():
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_signal()
    assert caught.value.name == "SIGTERM" and caught.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before, "the previous handler is back"
    steps = []
    with pytest.raises(Interrupted, match="SIGINT"), raising():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        steps.append("work went on")
        pause(5)
        steps.append("after the wait")
    assert steps == ["work went on"], "the signal waited for the next wait, then stopped it"
    with pytest.raises(Interrupted, match="SIGTERM"), raising():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # no wait after it: raised as raising() ends
    with raising():  # once raised, a second signal does not cut the cleanup short
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_signal()
        os.kill(os.getpid(), signal.SIGTERM)
        pause(0.2)


@MAIN_THREAD
def test_a_signal_stops_the_main_threads_wait_for_a_worker():
    """The main thread waits for a worker in slices, so a signal stops it at once: never halfway
    through a lock or a transaction, never after the task's whole time limit."""
    worker = Worker(interpret=True)
    try:
        start = time.monotonic()
        with pytest.raises(Interrupted), raising():
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            worker.call(_hang, {}, timeout=60)
        assert time.monotonic() - start < 10
    finally:
        worker.kill()
        worker.close()


@MAIN_THREAD
def test_a_stopping_process_quiets_the_pool_log_until_it_is_done(caplog):
    """Interrupted surfacing in SQLAlchemy's pool as it resets a connection in a finalizer is
    logged there with a traceback before it is passed on (seen once under load): that log is
    quiet while the process stops, and as it was afterwards."""
    pool = logging.getLogger("sqlalchemy.pool")
    level = pool.level
    with raising():
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_signal()
        logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Exception during reset or similar")
    assert "Exception during reset" not in caplog.text
    assert pool.level == level


@MAIN_THREAD
def test_a_signal_the_process_was_told_to_ignore_stays_ignored():
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with raising():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def _hang(_payload):
    time.sleep(60)


def test_a_stopped_worker_is_not_the_variants_failure(zygote):
    """A worker given SIGTERM from outside (a SIGTERM to the whole process group) is replaced, and
    its task reported as stopped; one the tuner kills as it stops returns at once, not replaced."""
    worker = Worker(interpret=True, zygote=zygote)
    try:
        pid = worker._process.pid
        threading.Timer(2.0, os.kill, (pid, signal.SIGTERM)).start()
        result = worker.call(_hang, {}, timeout=60)
        assert result["status"] == "stopped" and "exit code -15" in result["reason"], result
        assert worker._process.pid != pid, "replaced"
        pid = worker._process.pid
        threading.Timer(2.0, worker.kill).start()
        start = time.monotonic()
        result = worker.call(_hang, {}, timeout=60)
        assert time.monotonic() - start < 30 and result["status"] == "stopped"
        assert worker._process.pid == pid, "not replaced: the tuner is stopping"
    finally:
        worker.close()


def test_a_worker_whose_host_is_gone_ends_quietly(capfd, zygote):
    """A host stopped by a signal may close its end of the pipe before its exit ends the workers
    (seen once under load): the worker ends without a traceback on the terminal."""
    worker = Worker(interpret=True, zygote=zygote)
    worker._killed = True  # close() sends nothing: the pipe just closes, as when the host dies
    worker._conn.close()
    worker._process.join(30)
    assert worker._process.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err
    worker.close()


def _trials(url, gpu, problem):
    return optuna.load_study(study_name=study_name(gpu, problem, "tpe"), storage=url).trials


class _EndedUnheld(AssertionError):
    """The tuning process finished before a poll caught it holding a trial: the run never reached
    what the test interrupts (on a loaded 2-core machine a 4-trial dry run can end that fast)."""


def _held(url, gpu, problem, process: subprocess.Popen) -> list[int]:
    """Wait until the tuning process holds a trial it is evaluating; their numbers. Forked workers
    get through a tiny trial in a fraction of a second, sooner than this notices it and a signal
    goes round: they are paused as they start, holding what they hold until the signal's
    give-back kills them."""
    done = threading.Event()

    def pausing() -> None:  # apart from the database's polls, which under load take 0.1 s and more
        while not done.is_set():
            _pause_workers(process.pid)
            time.sleep(0.002)

    pauser = threading.Thread(target=pausing, daemon=True)
    pauser.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise _EndedUnheld(
                    f"the tuning process ended before it held a trial:\n{process.stdout.read()}"
                )
            time.sleep(0.05)
            try:
                trials = _trials(url, gpu, problem)
            except KeyError:  # the study is not created yet
                continue
            except sqlalchemy.exc.SQLAlchemyError:  # this poll raced the tuning process creating the tables
                continue
            held = [t.number for t in trials if t.state == TrialState.RUNNING and "variant" in t.user_attrs]
            if held:
                return held
        raise AssertionError("the tuning process never held a trial")
    finally:
        done.set()
        pauser.join()


def _pause_workers(host: int) -> None:
    """SIGSTOP the workers the ranks under `host` forked (tuning/zygote.py names them). A rank run
    in the host itself spawns its workers, which take seconds to start: they are left alone."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    name, rest = stat.read().split(" (", 1)[1].rsplit(") ", 1)
                parents[int(entry)], names[int(entry)] = int(rest.split()[1]), name
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
    for pid, name in names.items():
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, host):
            ancestor = parents.get(ancestor)
        if ancestor == host and name == "tunegen-worker":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)


def _last_copy(trials, number):
    """The last of the queued copies of trial `number` (itself if it has none). A copy given back
    is queued again: another rank may take a copy in the moment before the signal reaches it."""
    while True:
        copies = [t for t in trials.values() if t.user_attrs.get("retry_of") == number]
        if not copies:
            return trials[number]
        (copy,) = copies
        number = copy.number


def _interrupt_and_rerun(tmp_path, gpu, problem, args, signum, group) -> None:
    """Run `tunegen tune ARGS` until it holds a trial, send `signum` (to its process group, as a
    terminal's Ctrl-C does, or to it alone), check what it left, then rerun the Problem. A run that
    ends before it is caught holding a trial is run again on a fresh database, three times at most."""
    for attempt in range(3):
        url = f"sqlite:///{tmp_path / f'tune-{attempt}.db'}"
        try:
            _interrupt_and_check(url, gpu, problem, args, signum, group)
            return
        except _EndedUnheld:
            if attempt == 2:
                raise


def _interrupt_and_check(url, gpu, problem, args, signum, group) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tunegen.cli.main", *args, "--db", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # A test runner may ignore SIGINT, and its children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        held = _held(url, gpu, problem, process)
        if group:
            os.killpg(process.pid, signum)
        else:
            os.kill(process.pid, signum)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signum, output
    name = signal.Signals(signum).name
    assert f"Error: stopped by {name}: the trials this run held are marked failed" in output
    assert "Traceback" not in output, output
    trials = {t.number: t for t in _trials(url, gpu, problem)}
    assert not [n for n, t in trials.items() if t.state == TrialState.RUNNING], "no trial left running"
    # A held trial may end on its own before the signal: evaluated, or pruned as a duplicate of a
    # Variant another trial is evaluating.
    abandoned = [n for n in held if not evaluated(trials[n]) and trials[n].state != TrialState.PRUNED]
    assert abandoned, f"a held trial was cut short: {held}"
    for number in abandoned:
        assert trials[number].state == TrialState.FAIL
        assert _last_copy(trials, number).state == TrialState.WAITING, "its Variant is queued again"
    # Trials enough for every queued Variant; a trial left running would hold the rerun for 900 s.
    target = sum(1 for t in trials.values() if evaluated(t) or t.state == TrialState.WAITING)
    options = TuneOptions(trials=target, workers=2, url=url, heartbeat_s=10, grace_s=900)
    start = time.monotonic()
    with Tuner(gpu, options) as tuner:
        outcome = tuner.tune(problem)
    assert time.monotonic() - start < 300, "the rerun did not wait for the grace period"
    assert outcome.winner is not None
    trials = {t.number: t for t in _trials(url, gpu, problem)}
    assert not [n for n, t in trials.items() if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for number in abandoned:
        retry = _last_copy(trials, number)
        assert retry.number != number and evaluated(retry)
        assert retry.user_attrs.get("variant") == trials[number].user_attrs["variant"]


@INTERPRETING
@pytest.mark.parametrize(
    ("signum", "ranks", "group"),
    [
        (signal.SIGINT, [], True),
        (signal.SIGINT, ["--gpus", "2"], True),
        (signal.SIGTERM, ["--gpus", "2"], False),
    ],
    ids=["ctrl-c", "ctrl-c-two-ranks", "sigterm-to-the-host"],
)
def test_an_interrupted_tune_gives_its_trials_back(tmp_path, signum, ranks, group):
    """Ctrl-C reaches every process of the terminal's group; a SIGTERM to the host alone is
    passed on to its ranks. Either way nothing is left running, each held Variant is queued again,
    and a rerun whose grace period is long finishes without waiting for it."""
    args = [*TUNE, "--workers", "2", *ranks]
    _interrupt_and_rerun(tmp_path, GPU, PROBLEM, args, signum, group)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize(
    ("signum", "ranks", "group"),
    [(signal.SIGINT, [], True), (signal.SIGTERM, ["--gpus", "1"], False)],
    ids=["ctrl-c", "sigterm-to-the-host-of-one-rank"],
)
def test_an_interrupted_gpu_tune_gives_its_trials_back(tmp_path, signum, ranks, group):
    """The same on a GPU, its compile and timing workers cut short mid-trial."""
    from tunegen.kernels.gpu import cuda_gpu

    problem = problems([parse_shape("4,2,64")], causal=(False,), seqlens=(1024,))[0]
    args = ["tune", "--shape", "4,2,64", "--seqlens", "1024", "--causal", "no", "--trials", "8"]
    gpu = cuda_gpu(torch.cuda.current_device())
    _interrupt_and_rerun(tmp_path, gpu, problem, [*args, "--workers", "2", *ranks], signum, group)


def test_a_trial_given_back_counts_as_a_retry_only_where_its_process_failed(tmp_path):
    """An interrupted process's trials come back as they were (it, not the Variant, stopped); a
    Variant whose process failed or died is queued again `MAX_RETRIES` times at most (it may be
    the cause)."""
    url = f"sqlite:///{tmp_path / 'retries.db'}"
    storage = studies.storage(url, heartbeat_s=60, grace_s=120)
    study = optuna.create_study(study_name="retries", storage=storage)
    heartbeat = studies.Heartbeat(storage, 60)
    trial = studies.ask(study)
    trial.suggest_categorical("block", [64, 128])
    heartbeat.hold(trial)
    heartbeat.close(abandon=True)
    frozen = {t.number: t for t in study.get_trials()}
    assert frozen[trial.number].state == TrialState.FAIL
    (copy,) = [t for t in frozen.values() if t.state == TrialState.WAITING]
    assert copy.user_attrs == {"retries": 0, "retry_of": trial.number}
    assert copy.system_attrs["fixed_params"] == frozen[trial.number].params
    trial = studies.ask(study)  # the copy, asked by a process that then fails: counted
    trial.suggest_categorical("block", [64, 128])
    heartbeat = studies.Heartbeat(storage, 60)
    heartbeat.hold(trial)
    heartbeat.close(abandon=True, counted=True)
    (copy,) = [t for t in study.get_trials() if t.state == TrialState.WAITING]
    assert copy.user_attrs == {"retries": 1, "retry_of": trial.number}
    for _ in range(studies.MAX_RETRIES):  # each copy asked, and its process dies
        trial = studies.ask(study)
        trial.suggest_categorical("block", [64, 128])
        study.tell(trial, state=TrialState.FAIL)
        studies._requeue(study, study.get_trials()[trial.number])
    copies = [t for t in study.get_trials() if "retry_of" in t.user_attrs]
    assert [t.user_attrs["retries"] for t in copies] == [0, *range(1, studies.MAX_RETRIES + 1)]
    assert [t.user_attrs["retry_of"] for t in copies[1:]] == [t.number for t in copies[:-1]]
    assert not study.get_trials(states=(TrialState.WAITING,)), "not queued past its retries"
