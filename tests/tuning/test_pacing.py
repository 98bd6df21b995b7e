"""How a tuning run paces its work and accounts for its time: the timeline (spans per lane, the
per-GPU summary, the Chrome trace `--timeline` writes), the flight's depth, compile workers
started as needed, the next Problem compiled while one finishes, the peers timed by one rank
per Problem, and the study's SQLite file in WAL mode."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sqlite3
import time
from collections import deque

import optuna
import pytest
from click.testing import CliRunner
from conftest import NEEDS_INTERPRETER

from helpers import assert_each_variant_evaluated_once, tiny_problems
from tunegen.cli.main import main
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning import study, timeline
from tunegen.tuning import tuner as tuner_module
from tunegen.tuning.flight import FIRST_AHEAD, STRAGGLER, Flight, Pending
from tunegen.tuning.study import study_name
from tunegen.tuning.timeline import Span, Timeline, problem_label
from tunegen.tuning.trial import compile_task
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning.workers import WorkerPool

GPU = interpreter_gpu()
PROBLEMS = tiny_problems()
IMPORTED = time.time()


def test_summary_counts_overlapping_gpu_work_once_and_adds_up_waits():
    spans = {
        "GPU 0": [
            Span("gpu", "trial 1", "p", 0.0, 2.0),
            Span("gpu", "trial 2", "p", 1.0, 3.0),  # queued behind trial 1: overlaps its span
            Span("gpu", "final round", "p", 5.0, 6.0),
            Span("compile 0", "trial 1", "p", 0.0, 1.0),
            Span("compile 1", "trial 2", "p", 0.0, 4.0),
            Span("compile 1", "warm-up", "", 0.0, 1.0),
            Span("tuner", timeline.WAIT_HOST, "", 8.0, 10.0),
        ]
    }
    (row,) = timeline.summary(spans, 0.0, 10.0)
    assert row["gpu_busy_s"] == pytest.approx(4.0) and row["gpu_busy"] == pytest.approx(0.4)
    assert row["gpu_s_by_kind"] == {"trials": pytest.approx(4.0), "final round": pytest.approx(1.0)}
    assert row["compile_workers"] == 2 and row["compile_busy"] == pytest.approx(6.0 / 20.0)
    assert row["waits_s"][timeline.WAIT_HOST] == pytest.approx(2.0)
    assert row["trials_timed"] == 2 and row["trials_compiled"] == 2


def test_chrome_trace_names_a_process_per_gpu_and_a_thread_per_lane(tmp_path):
    recorded = Timeline()
    with recorded.span("gpu", "trial 3", "problem"):
        time.sleep(0.01)
    (span,) = recorded.take()
    assert span.end - span.start >= 0.01 and recorded.take() == [], "take() hands each span over once"
    recorded.add("gpu", "trial 4", 1.0, 1.25, "problem")
    recorded.add("compile 0", "trial 4", 0.5, 1.0, "problem")
    spans = {"GPU 1": recorded.take()}
    path = tmp_path / "trace.json"
    timeline.write(path, spans, 0.0, 2.0)
    trace = json.loads(path.read_text())
    meta = {(e["name"], e.get("tid")): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", None)] == {"name": "GPU 1"}
    lanes = {args["name"] for (name, _), args in meta.items() if name == "thread_name"}
    assert lanes == {"gpu", "compile 0"}
    work = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["name"], e["ts"], e["dur"]) for e in work} == {
        ("trial 4", 1_000_000, 250_000),
        ("trial 4", 500_000, 500_000),
    }
    assert trace["summary"][0]["gpu"] == "GPU 1"


def test_flight_keeps_a_compile_over_a_timing_ahead_of_the_gpu():
    flight = Flight(compile_workers=16)
    assert flight.depth() == FIRST_AHEAD, "before anything is measured"
    assert Flight(compile_workers=16, first_ahead=16).depth() == 16
    flight.compiled(1.0)
    flight.timed(0.25)
    assert flight.depth() == 4 + 2
    for _ in range(20):  # the estimates follow what is measured: a slow GPU needs one compiling, two ready
        flight.timed(5.0)
    assert flight.depth() == 3
    slow = Flight(compile_workers=3)
    slow.compiled(30.0)
    slow.timed(0.1)
    assert slow.depth() == 3, "never more than there are compile workers"


def test_flight_keeps_more_ahead_of_the_gpu_where_compiles_vary():
    """Compiles vary (one in ten takes two to three times the median): the trials kept ahead cover
    a slow compile, not the mean one."""
    steady, varied = Flight(compile_workers=32), Flight(compile_workers=32)
    steady.timed(0.25)
    varied.timed(0.25)
    for _ in range(20):
        steady.compiled(1.0)
    for seconds in [0.5, 1.5] * 10:  # the same mean, each 0.5 s off it
        varied.compiled(seconds)
    assert steady.depth() == 4 + 2
    # The estimate, near 1.0-1.15 s, plus two deviations of 0.5-0.6 s: 2-2.4 s of compile.
    assert 8 + 2 <= varied.depth() <= 10 + 2, (varied.compile_s, varied.compile_deviation)


def test_a_straggling_compile_is_not_counted_as_coming_for_the_gpu():
    """One compile in ten takes several times the median: the GPU is not left to wait on it."""
    flight = Flight(compile_workers=8)
    flight.compiled(1.0)
    flight.timed(0.5)
    assert flight.depth() == 4
    now = time.monotonic()

    def pending(age: float, problem=PROBLEMS[0]) -> Pending:
        return Pending(problem, None, None, {}, since=now - age)

    flight.compiling = {object(): pending(0.5) for _ in range(3)}
    assert flight.short() and flight.short(PROBLEMS[0]), "three coming, four wanted"
    flight.compiling[object()] = pending(0.5)
    assert not flight.short(), "four coming"
    flight.compiling = {object(): pending(STRAGGLER * 1.0 + 1) for _ in range(3)}
    flight.compiling[object()] = pending(0.5)
    assert flight.short(), "three stragglers count for none"
    flight.ready[PROBLEMS[0]] = deque(pending(0) for _ in range(3))
    assert not flight.short() and not flight.short(PROBLEMS[0]), "one coming, three compiled"
    assert flight.short(PROBLEMS[1]), "none of the next Problem's"
    flight.compiling.update({object(): pending(STRAGGLER * 1.0 + 1) for _ in range(4)})
    assert not flight.short(PROBLEMS[1]), "no compile worker free"


def _wait(payload):
    time.sleep(payload.get("sleep", 0))
    return {"status": "ok", "pid": os.getpid()}


def test_pool_starts_workers_as_the_work_needs_them_and_reuses_warm_ones():
    pool = WorkerPool(3, interpret=True, start=1)
    try:
        assert pool.started == 1 and pool.size == 3
        first = {pool.submit(_wait, {}, timeout=60).result()["pid"] for _ in range(3)}
        assert pool.started == 1 and len(first) == 1, "one task at a time: the warm worker does each"
        busy = [pool.submit(_wait, {"sleep": 2.0}, timeout=60) for _ in range(4)]
        pids = {f.result()["pid"] for f in busy}
        assert pool.started == 3 and len(pids) == 3, "busy workers: more start, up to the size"
    finally:
        pool.close()


def test_the_study_database_runs_in_wal_mode(tmp_path):
    url = f"sqlite:///{tmp_path / 'wal.db'}"
    storage = study.storage(url, 10, 60)
    optuna.create_study(study_name="s", storage=storage)
    with sqlite3.connect(tmp_path / "wal.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@NEEDS_INTERPRETER
def test_an_ask_reads_the_study_once(tmp_path, monkeypatch):
    """Every read of the trials costs a query of every unfinished one (all ranks' in flight): the
    count against the target, a queued trial to take and the suggestions share one; the claim
    reads only the others' claims, in its own transaction (study.claim)."""
    url = f"sqlite:///{tmp_path / 'reads.db'}"
    with Tuner(GPU, TuneOptions(trials=6, workers=1, url=url, trial_timeout=300)) as tuner:
        asks = tuner._asks[PROBLEMS[0]] = tuner._asking(PROBLEMS[0])
        submitted = []
        monkeypatch.setattr(tuner.pool, "submit", lambda *args: submitted.append(args) or object())
        reads = []
        real = optuna.storages.RDBStorage._get_trials
        monkeypatch.setattr(
            optuna.storages.RDBStorage, "_get_trials", lambda *a, **k: reads.append(1) or real(*a, **k)
        )
        for _ in range(3):
            before = len(reads)
            assert tuner._ask(PROBLEMS[0], asks)
            assert len(reads) - before == 1
        assert len(submitted) == 3 - sum(1 for t in asks.study.trials if t.state.name == "PRUNED")
        tuner.flight.compiling.clear()


@NEEDS_INTERPRETER
def test_the_next_problem_compiles_while_one_finishes_and_loses_no_trial(tmp_path):
    """tune(p0, later=[p1]) may start p1's first trials while p0's last are timed (when is checked
    apart: test_asks_for_the_next_problem_never_hold_its_compiled_trials_off_the_gpu); tune(p1)
    times them: every p1 Variant is evaluated once and nothing stays running."""
    url = f"sqlite:///{tmp_path / 'ahead.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        first = tuner.tune(PROBLEMS[0], later=[PROBLEMS[1]])
        second = tuner.tune(PROBLEMS[1])
        spans = tuner.timeline.take()
    assert first.winner is not None and second.winner is not None
    assert_each_variant_evaluated_once(url, GPU, PROBLEMS[1], 3)
    lanes = {s.lane for s in spans}
    assert {"gpu", "sampler", "tuner"} <= lanes and any(lane.startswith("compile") for lane in lanes)


@NEEDS_INTERPRETER
def test_asks_for_the_next_problem_never_hold_its_compiled_trials_off_the_gpu(tmp_path, monkeypatch):
    """At a Problem's end the next Problem's trials are asked while the Problem still holds some,
    and its compiled ones are queued on the GPU between those asks; once it holds none, its search
    returns at once and the next search asks on (an ask takes 50-90 ms: a row of them left the
    GPU idle for 1-2 s at each Problem's end)."""
    url = f"sqlite:///{tmp_path / 'ends.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        tuner._asks[PROBLEMS[0]] = tuner._asking(PROBLEMS[0])
        events = []
        answers = iter([False, True, True, False])  # none left of p0, then two of p1

        def ask(problem, asks):
            events.append(("ask", problem))
            return next(answers)

        monkeypatch.setattr(tuner, "_ask", ask)
        monkeypatch.setattr(tuner, "_on_gpu_queue", lambda pending: events.append(("gpu", pending.problem)))
        monkeypatch.setattr(tuner.flight, "depth", lambda: 8)  # the GPU short of trials throughout
        held = concurrent.futures.Future()  # p0's last compile, still running
        tuner.flight.compiling[held] = Pending(PROBLEMS[0], None, None, {})
        tuner.flight.ready[PROBLEMS[1]] = deque([Pending(PROBLEMS[1], None, None, {})])  # compiled
        assert tuner._fill(PROBLEMS[0], [PROBLEMS[1]], None) is False
        p0, p1 = PROBLEMS[:2]
        assert events == [("ask", p0), ("ask", p1), ("gpu", p1), ("ask", p1), ("ask", p1)], (
            "p1's compiled trial queued on the GPU after the first ask, not after the row of them"
        )
        del tuner.flight.compiling[held]
        events.clear()
        answers = iter([False])
        assert tuner._fill(PROBLEMS[0], [PROBLEMS[1]], None) is False
        assert events == [("ask", p0)], "p0 holds nothing: no ask for p1 here"


@NEEDS_INTERPRETER
def test_compiled_trials_of_the_next_problem_are_timed_ahead_of_a_final_round(tmp_path, monkeypatch):
    """A rank finishing a Problem does not keep the next Problem's compiled trials waiting behind
    its final round: other ranks sharing that study may have none left to take meanwhile."""
    url = f"sqlite:///{tmp_path / 'final.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    waiting = []
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        asks = tuner._asks[PROBLEMS[1]] = tuner._asking(PROBLEMS[1])
        while not tuner.flight.compiling:  # one of the next Problem's trials, compiled, not taken
            assert tuner._ask(PROBLEMS[1], asks)
        concurrent.futures.wait(list(tuner.flight.compiling))
        final_round = tuner._final_round

        def watched(problem, complete, helpers=None):
            waiting.append(tuner.flight.ahead(PROBLEMS[1]))
            return final_round(problem, complete, helpers)

        monkeypatch.setattr(tuner, "_final_round", watched)
        tuner.finalize(PROBLEMS[0])
        second = tuner.tune(PROBLEMS[1])
    assert waiting[0] == 0, "on the GPU's queue before the final round, not compiled and waiting"
    assert second.winner is not None
    assert_each_variant_evaluated_once(url, GPU, PROBLEMS[1], 3)


@NEEDS_INTERPRETER
def test_a_rank_that_times_another_problems_peers_times_them_while_its_first_trials_compile(tmp_path):
    """At a run's start the GPU waits for the first compiles: a rank not timing the first
    Problem's peers times the next Problem's then, once, ahead of any trial (the first Problem's
    are timed at its end, where no other process timed them)."""
    url = f"sqlite:///{tmp_path / 'peers.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    with Tuner(GPU, options, times_peers=PROBLEMS[1].__eq__) as tuner:
        tuner.tune(PROBLEMS[0], later=[PROBLEMS[1]])
        tuner.tune(PROBLEMS[1])
        spans = tuner.timeline.take()
    work = sorted((s for s in spans if s.lane == "gpu" and s.name != "warm-up"), key=lambda s: s.start)
    assert work[0].name == "peers" and work[0].problem == problem_label(PROBLEMS[1]), work[:2]
    peers = [s.problem for s in work if s.name == "peers"]
    assert peers.count(problem_label(PROBLEMS[1])) == 1, "timed once"


def _slow_first_problem(payload):
    """compile_task, 1.5 s slower for the first Problem: its last compile is still running when
    the next Problem's first trials are compiled."""
    if payload["problem"] == PROBLEMS[0].as_dict():
        time.sleep(1.5)
    return compile_task(payload)


@NEEDS_INTERPRETER
def test_the_gpu_times_the_next_problem_while_the_last_compiles_finish(tmp_path, monkeypatch):
    """The first Problem's last compile does not leave the GPU idle: the next Problem's compiled
    trials are timed meanwhile (and told to its study), and none is lost or timed twice."""
    monkeypatch.setattr(tuner_module, "compile_task", _slow_first_problem)
    url = f"sqlite:///{tmp_path / 'tail.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        tuner.tune(PROBLEMS[0], later=[PROBLEMS[1]])
        spans = tuner.timeline.take()
        tuner.tune(PROBLEMS[1])
    labels = [problem_label(p) for p in PROBLEMS]
    timed = [s for s in spans if s.lane == "gpu" and s.name.startswith("trial")]
    last_first = max(s.start for s in timed if s.problem == labels[0])
    assert any(s.problem == labels[1] and s.start < last_first for s in timed), "timed in the tail"
    assert_each_variant_evaluated_once(url, GPU, PROBLEMS[1], 3)


@NEEDS_INTERPRETER
def test_cli_timeline_shows_both_stand_ins_and_times_each_problems_peers_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    trace = tmp_path / "timeline.json"
    args = ["tune", "--db", url, "--shape", "4,2,32", "--shape", "8,2,64", "--seqlens", "512"]
    args += ["--causal", "no", "--dry-run", "--trials", "3", "--workers", "2", "--gpus", "2"]
    result = CliRunner().invoke(main, [*args, "--timeline", str(trace)])
    assert result.exit_code == 0, result.output
    assert "where each GPU's time went" in result.output and f"timeline written to {trace}" in result.output
    data = json.loads(trace.read_text())
    rows = {row["gpu"]: row for row in data["summary"]}
    assert set(rows) == {"stand-in 0", "stand-in 1"}
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    work = [e for e in data["traceEvents"] if e["ph"] == "X"]
    peers = [(names[e["pid"]], e["args"]["problem"]) for e in work if e["name"] == "peers"]
    assert len(peers) == 2 and len({p for _, p in peers}) == 2, "each Problem's peers timed once"
    assert {rank for rank, _ in peers} == {"stand-in 0", "stand-in 1"}, "split between the ranks"
    timed = sum(row["trials_timed"] for row in rows.values())
    assert timed >= 6, "every evaluated trial shows on a GPU lane"
    starts = [e for e in work if e["name"] == timeline.STARTING]
    assert len(starts) == 2 and all(e["ts"] == 0 for e in starts), "the command's start, on each GPU's lanes"


def test_a_process_knows_when_it_started():
    started = timeline.process_start()
    if started is None:
        pytest.skip("this platform does not say when a process started")
    assert IMPORTED - 600 < started <= IMPORTED + 0.05, "before this module was imported, by this process"


@NEEDS_INTERPRETER
def test_a_problems_end_waits_out_a_trial_whose_process_died_before_claiming_it(tmp_path):
    """A process killed between asking for a trial and claiming it leaves the trial running with
    no owner. The final round waits until it is failed as stale (`grace_s` after it began), so
    that nothing stays running after a run."""
    url = f"sqlite:///{tmp_path / 'orphan.db'}"
    options = TuneOptions(trials=2, workers=1, url=url, trial_timeout=300, heartbeat_s=1, grace_s=2)
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        orphan = tuner._study(PROBLEMS[0]).ask()  # asked for, never claimed: its process died
        outcome = tuner.finalize(PROBLEMS[0])
    assert outcome.winner is not None
    trials = optuna.load_study(study_name=study_name(GPU, PROBLEMS[0], "tpe"), storage=url).trials
    assert trials[orphan.number].state == optuna.trial.TrialState.FAIL
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
