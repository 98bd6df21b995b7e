"""Tuning on several GPUs of one host, with interpreter stand-ins for the GPUs: choosing the GPUs,
keeping GPU models apart, dividing the trials without duplicates, and a process killed mid-trial
leaving nothing running (its trials failed after the heartbeat's grace, its Variants queued
again), on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time

import optuna
import pytest
import sqlalchemy
from click.testing import CliRunner
from optuna.trial import TrialState

from helpers import tiny_problems
from tunegen.cli.main import main
from tunegen.kernels import gpu
from tunegen.kernels.gpu import DeviceFacts, interpreter_gpu
from tunegen.tuning import host, rank_process, study
from tunegen.tuning import ranks as placement
from tunegen.tuning.claims import evaluated, holds_claim
from tunegen.tuning.study import study_name
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning_db import Store

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="tuner tests run kernels under the interpreter"
)
GPU = interpreter_gpu()
PROBLEMS = tiny_problems()
# A short heartbeat, so that a killed process's trials go stale within seconds.
FAST = TuneOptions(trials=6, workers=1, trial_timeout=300, heartbeat_s=1, grace_s=3)


def _url(backend, tmp_path, request):
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'host.db'}"
    return request.getfixturevalue("postgres_url")


def _trials(url, problem, *, made=True):
    """The Problem's trials; with `made` False, none where its study is not made yet."""
    try:
        return optuna.load_study(study_name=study_name(GPU, problem, "tpe"), storage=url).trials
    except KeyError:
        if made:
            raise
        return []


def test_selecting_gpus():
    assert placement.select("all", 4) == [0, 1, 2, 3]
    assert placement.select("2", 4) == [0, 1]
    assert placement.select("0,2,3", 4) == [0, 2, 3] and placement.select("3,", 4) == [3]
    for spec, message in [
        ("5", "this host has 4 GPU"),
        ("0", "this host has 4 GPU"),
        ("0,4", r"GPUs are 0\.\.3"),
        ("1,1", "distinct"),
        ("some", "expected all, a count or indices"),
        ("", "expected all, a count or indices"),
    ]:
        with pytest.raises(ValueError, match=message):
            placement.select(spec, 4)


def _topology(root, siblings):
    """A /sys/devices/system/cpu of 32 logical CPUs, each physical core `siblings` hyper-threads,
    numbered as Linux does (a core's threads 16 apart)."""
    for cpu in range(32):
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        core = cpu % 16 if siblings == 2 else cpu
        listed = f"{core},{core + 16}" if siblings == 2 else f"{cpu}"
        (folder / "thread_siblings_list").write_text(f"{listed}\n")


@pytest.mark.parametrize("siblings", [1, 2])
def test_ranks_share_physical_cores_out_and_the_timing_worker_has_its_own(tmp_path, monkeypatch, siblings):
    _topology(tmp_path, siblings)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    shares = [placement.cores(position, 2, tmp_path) for position in range(2)]
    threads = {cpu: cpu % 16 if siblings == 2 else cpu for cpu in range(32)}
    assert not {threads[c] for c in shares[0]} & {threads[c] for c in shares[1]}, "no physical core shared"
    for share in shares:
        timing, *rest = share
        assert threads[timing] not in {threads[c] for c in rest}, "the timing worker's core is its own"
        assert len(rest) == 16 - siblings
    alone = placement.cores(0, 1, tmp_path)
    assert alone[0] == 0 and set(alone) == set(range(32)) - ({16} if siblings == 2 else set())
    # Few cores: the timing worker's hyper-thread is kept; more ranks than cores: none pinned.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 16, 17}, raising=False)
    few = placement.cores(0, 1, tmp_path)
    assert few == ((0, 16, 1, 17) if siblings == 2 else (0, 1, 16, 17))
    assert placement.cores(2, 3, tmp_path) == (None if siblings == 2 else (16,))
    # Without a topology to read, every logical CPU counts as a core.
    assert placement.cores(1, 2, tmp_path / "none") == (16, 17)


def test_gpu_models_are_tuned_apart_and_ranks_see_their_own_device(monkeypatch):
    h100 = DeviceFacts("NVIDIA H100", 9, 0, 132, 50 * 2**20, 232448, 49152)
    h200 = dataclasses.replace(h100, name="NVIDIA H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    ranks = placement.cuda_ranks([0, 1, 2], lambda i: h200 if i == 1 else h100)
    assert [(r.index, r.visible) for r in ranks] == [(0, "3"), (1, "5"), (2, "7")]
    assert [(r.gpu, r.facts) for r in ranks] == [(h100.gpu(), h100), (h200.gpu(), h200), (h100.gpu(), h100)]
    grouped = placement.groups(ranks)
    assert [[r.index for r in members] for members in grouped.values()] == [[0, 2], [1]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [r.visible for r in placement.cuda_ranks([1], lambda i: h100)] == ["1"]


def _no_trial_left_running(url):
    for problem in PROBLEMS:
        assert not [t.number for t in _trials(url, problem) if t.state == TrialState.RUNNING]


def _held(url, pid):
    """The trials the process `pid` holds a claim on, by Problem index (those holding any)."""
    held = []
    for k, problem in enumerate(PROBLEMS):
        trials = _trials(url, problem, made=False)
        numbers = [t.number for t in trials if holds_claim(t) and f":{pid}:" in t.user_attrs["owner"]]
        if numbers:
            held.append((k, numbers))
    return held


def _kill_if_holding(url, pid):
    """Kill the process `pid` if it holds a trial, looked at while it is stopped: a held trial
    cannot be concluded between the look and the kill (pruned just after its claim was written,
    or evaluated). What it held."""
    os.kill(pid, signal.SIGSTOP)
    held = []
    try:
        held = _held(url, pid)
    finally:
        os.kill(pid, signal.SIGKILL if held else signal.SIGCONT)
    return held


def _kill_while_holding(url, done, killed):
    """Until `done`, look at the ranks' claims every 0.1 s and kill the first rank seen holding a
    trial, noting what it held in `killed`. Polled rather than hooked on progress reports, which
    may all come while a rank holds none; looked at while the ranks run, since a rank stopped at
    every look fell behind the other, which took all its trials."""
    while not (killed or done.wait(0.1)):
        for rank in [p for p in multiprocessing.active_children() if p.name.startswith("tunegen-gpu")]:
            # Gone: it ended and was reaped meanwhile. Locked: stopped while it wrote.
            with contextlib.suppress(ProcessLookupError, sqlalchemy.exc.OperationalError):
                if _held(url, rank.pid):
                    killed.extend(_kill_if_holding(url, rank.pid))
            if killed:
                return


@pytest.mark.parametrize("kill", [False, True], ids=["both-live", "one-killed"])
def test_two_stand_ins_divide_the_trials(tmp_path, kill):
    """Two ranks, each owning one Problem and joining the other's: every Variant evaluated once,
    both take part, each Problem finished once. Killed mid-trial, a rank is replaced and its trials
    do not stay running."""
    url = f"sqlite:///{tmp_path / 'host.db'}"
    options = dataclasses.replace(FAST, url=url)
    ranks = [placement.Rank(i, None, GPU) for i in range(2)]
    killed: list[tuple[int, list[int]]] = []
    finished = []
    over = threading.Event()
    watcher = threading.Thread(target=_kill_while_holding, args=(url, over, killed), daemon=True)
    if kill:
        watcher.start()
    try:
        outcomes = host.tune_on(PROBLEMS, ranks, options, lambda *a: None, lambda g, j, o: finished.append(j))
    finally:
        over.set()
    if kill:
        watcher.join()
    assert sorted(finished) == [0, 1], "each Problem finished once"
    assert all(outcomes[(GPU, j)].winner is not None for j in range(2))
    owners = set()
    for problem in PROBLEMS:
        trials = _trials(url, problem)
        done = [t.user_attrs["variant"] for t in trials if evaluated(t)]
        assert len(done) == len(set(done)), "no Variant evaluated twice"
        assert 6 <= len(done) <= 7, "the target, overshot by at most one trial per other rank"
        owners |= {t.user_attrs["owner"].rsplit(":", 1)[0] for t in trials if evaluated(t)}
    if not kill:
        assert len(owners) >= 2, "both ranks evaluated trials"
    _no_trial_left_running(url)
    with Store(url) as store:
        assert len(store.winners()) == 2
    if kill:
        assert killed, "a rank was killed while it held a trial"
        for j, held in killed:
            trials = {t.number: t for t in _trials(url, PROBLEMS[j])}
            for number in held:
                assert trials[number].state == TrialState.FAIL and not evaluated(trials[number])


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def _two_ranks(problems):
    """A host of two ranks of one model over `problems` (indices into PROBLEMS), its ranks' pipes
    recorded; and `say`, which hands it a rank's "ready" (the Problem it searched, whether it has
    more) and returns what the host answered."""
    ranks = [placement.Rank(i, None, GPU) for i in range(2)]
    run = host._Host([PROBLEMS[k] for k in problems], ranks, FAST, *[lambda *a: None] * 3)
    for state in run.states:
        state.conn = _Pipe()

    def say(state, searched, more):
        before = len(state.conn.sent)
        run._handle(state, ("ready", searched, more))
        return state.conn.sent[before:]

    return *run.states, say


def test_a_problem_s_final_round_is_handed_out_once_a_rank_has_searched_it():
    """Not once every rank has been through it: a rank that owns no Problem near the end would hold
    it back. A Problem another rank took before its owner reached it is settled too. The ranks
    still searching are told which Problems are settled, and skip them."""
    a, b, say = _two_ranks([0, 1, 0])  # a owns Problems 0 and 2, b owns 1 and takes 2 after
    assert say(a, 0, True) == [("finalize", 0)], "searched by its own rank, b has not been through it"
    assert say(b, 1, True) == [("go", [0, 1])], "one of the last two while b searches on; 0 is settled"
    assert say(b, 2, False) == [("finalize", 1)], "b, done, takes a last one, its own first"
    assert say(a, None, True) == [("go", [0, 1, 2])], "2 was searched by b: a skips it"
    assert say(a, None, False) == [("finalize", 2)], "and takes the other last one, side by side"
    assert (a.finals, b.finals) == (2, 1)


def test_final_rounds_are_spread_over_the_ranks_of_a_model():
    """The rank that finishes searching a Problem takes its final round, unless it has had more of
    them than a rank with Problems left to search, which takes it at its next stop."""
    a, b, say = _two_ranks([0, 1, 0, 1, 0, 1])
    assert say(a, 0, True) == [("finalize", 0)]
    assert say(a, None, True) == [("go", [0])]
    assert say(a, 2, True) == [("go", [0, 2])], "a had one more final round than b, which will stop"
    assert say(b, 1, True) == [("finalize", 1)], "its own first"
    assert say(b, None, True) == [("finalize", 2)]
    assert say(b, None, True) == [("go", [0, 1, 2])]
    assert (a.finals, b.finals) == (1, 2)


def _tune_forever(url):
    with Tuner(GPU, dataclasses.replace(FAST, trials=50, url=url)) as tuner:
        tuner.tune(PROBLEMS[0])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_killed_worker_leaves_no_trial_running(tmp_path, backend, request):
    """SIGKILL a tuning process mid-trial: its trials are failed once their heartbeat is older than
    the grace period, and their Variants are evaluated again by the next run."""
    url = _url(backend, tmp_path, request)
    Store(url).close()
    process = multiprocessing.get_context("spawn").Process(target=_tune_forever, args=(url,))
    process.start()
    held: list[optuna.trial.FrozenTrial] = []
    deadline = time.monotonic() + 300
    while not held and time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            trials = _trials(url, PROBLEMS[0])
        except KeyError:  # the study is not created yet
            continue
        held = [t for t in trials if t.state == TrialState.RUNNING and "variant" in t.user_attrs]
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert held, "the process held a trial when it was killed"
    with Tuner(GPU, dataclasses.replace(FAST, url=url)) as tuner:
        outcome = tuner.tune(PROBLEMS[0])
    assert outcome.winner is not None
    trials = {t.number: t for t in _trials(url, PROBLEMS[0])}
    assert not [n for n, t in trials.items() if t.state == TrialState.RUNNING]
    for trial in held:
        assert trials[trial.number].state == TrialState.FAIL and not evaluated(trials[trial.number])
        retried = [t for t in trials.values() if t.user_attrs.get("retry_of") == trial.number]
        assert len(retried) == 1 and evaluated(retried[0]), "the abandoned Variant was queued and evaluated"
        assert retried[0].user_attrs["variant"] == trial.user_attrs["variant"]


def test_cli_tunes_on_two_stand_ins(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    args = ["tune", "--db", url, "--shape", "4,2,32", "--seqlens", "512", "--causal", "no", "--dry-run"]
    result = CliRunner().invoke(main, [*args, "--trials", "3", "--workers", "2", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert "triton-interpreter (2 stand-in(s))" in result.output and "inserted" in result.output
    assert "┃ gpu" in result.output, "the table says which GPU each Winner belongs to"
    bad = CliRunner().invoke(main, [*args, "--gpus", "1,1"])
    assert bad.exit_code != 0 and "--gpus" in bad.output and "distinct" in bad.output
    for option, value in (("--trials", "0"), ("--trial-timeout", "0"), ("--workers", "0")):
        refused = CliRunner().invoke(main, [*args, option, value])
        assert refused.exit_code == 2 and option in refused.output, refused.output


def test_the_ranks_are_forked_while_no_display_thread_runs(tmp_path, monkeypatch):
    """A thread writing to the terminal as a rank is forked would leave the rank, its zygote and
    its workers the stream's lock held for good: the progress display has no thread of its own."""
    seen = []
    real = host._Host._start

    def start(self, state):
        seen.append([t for t in threading.enumerate() if type(t).__name__ == "_RefreshThread"])
        real(self, state)

    monkeypatch.setattr(host._Host, "_start", start)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    args = ["tune", "--db", url, "--shape", "4,2,32", "--seqlens", "512", "--causal", "no", "--dry-run"]
    result = CliRunner().invoke(main, [*args, "--trials", "2", "--workers", "1", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert seen == [[], []]


def test_preparing_a_database_another_program_is_creating_tries_again(tmp_path, monkeypatch):
    """Two tuning runs started together on one new database race to create its tables: the one
    that loses finds them made by the other, and goes on."""
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    real, tries = optuna.storages.RDBStorage, []

    def racing(*args, **kwargs):
        tries.append(args)
        if len(tries) == 1:
            real(*args, **kwargs).engine.dispose()  # the other program, first
            raise sqlalchemy.exc.IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE"))
        return real(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    monkeypatch.setattr(study.time, "sleep", lambda _: None)
    study.prepare(url)
    assert len(tries) == 2
    monkeypatch.setattr(optuna.storages, "RDBStorage", real)
    optuna.create_study(study_name="after", storage=url)


def test_a_ranks_compile_workers_are_told_its_device_before_the_compiler_warms(monkeypatch):
    """The zygote's warm-up gives the workers it forks next the rank's device (else each would
    ask CUDA for it: 0.9 s of its first compile), before the compile that may be cut short."""
    facts = DeviceFacts("NVIDIA H100", 9, 0, 132, 50 * 2**20, 232448, 49152)
    seen = []
    monkeypatch.setattr(gpu, "_meta_device", None)
    monkeypatch.setattr(
        rank_process, "warm_compiler", lambda capability: seen.append((capability, gpu.meta_device_given()))
    )
    rank_process.warm_workers(placement.Rank(0, "0", facts.gpu(), facts))
    assert seen == [((9, 0), facts)]
