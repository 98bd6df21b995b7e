"""A final round shared with a rank that has nothing left to do (retiming.py): split into rounds,
each of which times every finalist for its part of the time, in its own order; the last round on
offer through the host, taken over by a rank left idle before it starts, or timed here; the
Winner chosen on the mean over the rounds; a helper that dies counts for nothing."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time

import pytest
from conftest import NEEDS_INTERPRETER

from helpers import tiny_problems
from tunegen.kernels.families import get
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning import host, rank_process
from tunegen.tuning import ranks as placement
from tunegen.tuning.final import FINAL_REP_MS, FinalRound
from tunegen.tuning.retiming import ROUNDS, Retiming, combined
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning_db import Store

GPU = interpreter_gpu()
PROBLEMS = tiny_problems()
FAST = TuneOptions(trials=4, workers=1, trial_timeout=300, heartbeat_s=1, grace_s=3)
PAYLOADS = [{"variant": name, "rep_ms": FINAL_REP_MS} for name in ("a", "b", "c")]
HALF = FINAL_REP_MS / ROUNDS
WRONG = {"status": "wrong", "reason": "relative error 1 against float64", "rel_err": 1.0}


def _ok(ms):
    return {"status": "ok", "ms": ms, "rel_err": 0.0}


def test_each_finalist_is_timed_at_the_mean_of_the_rounds_and_fails_if_any_round_failed():
    own = [_ok(1.0), _ok(2.0), _ok(3.0)]
    got = combined([own, [_ok(3.0), WRONG, _ok(3.0)]])
    assert [r["status"] for r in got] == ["ok", "wrong", "ok"]
    assert [r["ms"] for r in got if r["status"] == "ok"] == [2.0, 3.0]
    assert combined([own]) == own
    with pytest.raises(ValueError):
        combined([own, own[:2]])


class _Gpu:
    """A timing thread whose re-timings wait for `go` and take the code of the finalist's letter
    as their time; `ran` records what each ran, in order."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.go = threading.Event()
        self.ran: list[tuple[str, float]] = []

    def submit(self, payload):
        return self.pool.submit(self._run, payload)

    def _run(self, payload):
        self.go.wait(30)
        self.ran.append((payload["variant"], payload["rep_ms"]))
        return _ok(float(ord(payload["variant"])))


class _Helpers:
    """A helper that takes the round on offer at once (`now`), or once `take` is set, and timed
    it at `times`."""

    def __init__(self, times, now=False) -> None:
        self.times, self.now = times, now
        self.take = False
        self.withdrawn = False
        self.offered = None

    def offer(self, payloads):
        self.offered = payloads
        return self.now

    def taken(self):
        return self.now or self.take

    def withdraw(self):
        self.withdrawn = True

    def results(self):
        return [self.times] if self.taken() else []


STOPPED = {"status": "stopped", "reason": "the tuning process is stopping"}


@pytest.mark.parametrize("lost", [None, [_ok(1.0), STOPPED, _ok(3.0)]], ids=["died", "stopped"])
def test_a_helper_s_round_that_could_not_finish_counts_for_nothing(lost):
    gpu = _Gpu()
    gpu.go.set()
    results = Retiming(gpu.submit, PAYLOADS, _Helpers(lost, now=True)).results()
    assert [r["ms"] for r in results] == [97.0, 98.0, 99.0], "this process's round alone"


def test_alone_a_final_round_times_each_finalist_once_for_the_whole_time_in_order():
    gpu = _Gpu()
    gpu.go.set()
    retiming = Retiming(gpu.submit, PAYLOADS, None)
    assert [r["ms"] for r in retiming.results()] == [97.0, 98.0, 99.0]
    assert gpu.ran == [(p["variant"], FINAL_REP_MS) for p in PAYLOADS]


def test_a_helper_there_at_once_times_the_second_round_and_this_process_the_first():
    gpu = _Gpu()
    gpu.go.set()
    helpers = _Helpers([_ok(1.0), _ok(2.0), _ok(3.0)], now=True)
    results = Retiming(gpu.submit, PAYLOADS, helpers).results()
    assert helpers.offered == PAYLOADS and gpu.ran == [("a", HALF), ("b", HALF), ("c", HALF)]
    assert [r["ms"] for r in results] == [49.0, 50.0, 51.0]


def test_a_helper_that_comes_before_the_second_round_starts_takes_it_over():
    gpu = _Gpu()
    helpers = _Helpers([_ok(1.0), _ok(2.0), _ok(3.0)])
    retiming = Retiming(gpu.submit, PAYLOADS, helpers)
    retiming.poll()
    assert not helpers.withdrawn and len(retiming.futures()) == 6, "both rounds queued, one on offer"
    helpers.take = True
    retiming.poll()
    gpu.go.set()
    results = retiming.results()
    assert gpu.ran == [("a", HALF), ("b", HALF), ("c", HALF)], "the second round never ran here"
    assert [r["ms"] for r in results] == [49.0, 50.0, 51.0]


@pytest.mark.parametrize("taken", [False, True], ids=["withdrawn", "taken-as-it-started"])
def test_once_the_second_round_has_started_here_it_runs_here(taken):
    """Started here, the second round is offered no more. Where the host handed it on as it
    started, it runs on here (cut short, the re-timing running would be lost and this GPU left
    waiting for the helper), and the helper's round counts too."""
    gpu = _Gpu()
    helpers = _Helpers([_ok(1.0), _ok(2.0), _ok(3.0)])
    retiming = Retiming(gpu.submit, PAYLOADS, helpers)
    gpu.go.set()
    while not any(f.running() or f.done() for f in retiming.rounds[1]):
        time.sleep(0.01)
    helpers.take = taken
    retiming.poll()
    assert helpers.withdrawn != taken
    results = retiming.results()
    assert gpu.ran == [(v, HALF) for v in ("a", "b", "c", "c", "b", "a")], "the second round in its own order"
    assert [r["ms"] for r in results] == ([65.0, 66.0, 67.0] if taken else [97.0, 98.0, 99.0])


def test_a_helper_times_the_round_it_took_over_in_its_order():
    """The helper's side: each finalist for its part of the time, in the second round's order
    (`round_order`: the last first); the results in the finalists' order."""
    gpu = _Gpu()
    gpu.go.set()

    class Helper(FinalRound):
        def _submit_final(self, problem):
            return gpu.submit

    results = Helper().help_final(PROBLEMS[0], PAYLOADS, 1, ROUNDS)
    assert gpu.ran == [("c", HALF), ("b", HALF), ("a", HALF)]
    assert [r["ms"] for r in results] == [97.0, 98.0, 99.0]


@NEEDS_INTERPRETER
def test_a_helper_s_times_count_in_the_choice_of_the_winner(tmp_path, monkeypatch):
    """The finalist the helper found fastest by far wins at the mean of both rounds' times; one it
    found wrong is out, whatever this process measured."""
    monkeypatch.setattr(Tuner, "_retimes", lambda self: True)
    options = dataclasses.replace(FAST, trials=6, url=f"sqlite:///{tmp_path / 'share.db'}")
    # the first wrong, the last fastest by far (this process's own times are a few ms each)
    helpers = _Helpers([WRONG, _ok(1e7), _ok(1e3)], now=True)
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        outcome = tuner.finalize(PROBLEMS[0], helpers=helpers)
        spans = [s for s in tuner.timeline.take() if s.name == "final round"]
    assert helpers.offered is not None and len(helpers.offered) == 3 == len(spans), "one round here"
    last = get(PROBLEMS[0].family).variant_type.from_json(helpers.offered[-1]["variant"])
    assert outcome.winner is not None and outcome.winner.variant == last.as_dict()
    assert 500 < outcome.winner.median_ms < 1000, "the mean of both rounds' times"


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)

    def close(self) -> None:
        pass


def _host(ranks=3):
    stand_ins = [placement.Rank(i, None, GPU) for i in range(ranks)]
    run = host._Host([PROBLEMS[0]], stand_ins, FAST, *[lambda *a: None] * 3)
    for state in run.states:
        state.conn = _Pipe()
    return run


def test_the_host_hands_an_offered_round_to_a_rank_with_nothing_left_to_do():
    run = _host()
    finalizer, idle, busy = run.states
    idle.waiting, idle.more = True, False
    busy.waiting, busy.more = False, False  # finishing a final round of its own
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    assert idle.conn.sent == [("help", 0, PAYLOADS, 1, ROUNDS)] and not busy.conn.sent
    assert finalizer.conn.sent == [("offered", True)] and not idle.waiting
    run._handle(idle, ("helped", ["times"]))
    run._handle(finalizer, ("withdraw",))
    assert finalizer.conn.sent[1:] == [("helped", ["times"]), ("helpers", 1)] and idle.helping is None


def test_a_round_on_offer_goes_to_the_first_rank_left_with_nothing_to_do():
    run = _host()
    finalizer, searching, late = run.states
    run.assigned.add((GPU, 0))  # the finalizer's final round
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    assert finalizer.conn.sent == [("offered", False)]
    run._handle(searching, ("ready", 0, True))
    assert searching.conn.sent == [("go", [0])], "a rank with Problems to search goes on"
    run._handle(late, ("ready", None, False))
    assert late.conn.sent == [("help", 0, PAYLOADS, 1, ROUNDS)] and finalizer.conn.sent[-1] == ("taken",)
    run._handle(finalizer, ("withdraw",))
    assert finalizer.conn.sent[-1] == ("helpers", 1)
    run._handle(late, ("helped", ["times"]))
    run._handle(late, ("ready", None, False))
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    assert finalizer.conn.sent[-2:] == [("helped", ["times"]), ("offered", True)], "it helps again"
    run._handle(late, ("helped", ["again"]))
    run._handle(late, ("ready", None, False))
    run._handle(finalizer, ("withdraw",))
    assert finalizer.conn.sent[-2:] == [("helped", ["again"]), ("helpers", 1)]
    run._handle(searching, ("ready", None, False))
    assert len(late.conn.sent) == 2 and searching.conn.sent == [("go", [0])], "nothing on offer now"


def test_a_helper_that_dies_counts_as_none_and_a_finalizer_started_again_gets_nothing(monkeypatch):
    monkeypatch.setattr(host._Host, "_start", lambda self, state: None)

    class Dead:
        exitcode = -9

        def join(self):
            pass

    run = _host(ranks=2)
    finalizer, helper = run.states
    helper.waiting, helper.more = True, False
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    helper.process = Dead()
    run._revive(helper)
    assert finalizer.conn.sent[-1] == ("helped", None)
    helper.waiting, helper.more = True, False
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    finalizer.process = Dead()
    run._revive(finalizer)
    sent = len(finalizer.conn.sent)
    run._handle(helper, ("helped", ["late"]))
    assert len(finalizer.conn.sent) == sent, "the process that asked is gone"
    helper.waiting = False
    run._handle(finalizer, ("offer", 0, PAYLOADS))
    finalizer.process = Dead()
    run._revive(finalizer)
    run._handle(helper, ("ready", None, False))
    assert helper.conn.sent[-1][0] == "help" and len(helper.conn.sent) == 2, "no offer outlives its rank"


class _Conn:
    """A rank's end of its pipe, with the host's messages queued."""

    def __init__(self, *queued) -> None:
        self.queued = list(queued)
        self.sent: list[tuple] = []

    def send(self, message):
        self.sent.append(message)

    def poll(self, timeout=None):
        return bool(self.queued)

    def recv(self):
        return self.queued.pop(0)


@pytest.mark.parametrize(
    "after",
    [
        [("offered", False), ("taken",), ("helpers", 1), ("helped", ["times"])],
        [("offered", False), ("taken",), ("helped", ["times"]), ("helpers", 1)],
        [("offered", True), ("helped", ["times"]), ("helpers", 1)],
    ],
    ids=["results-last", "results-first", "taken-at-once"],
)
def test_a_rank_reads_the_host_s_messages_of_its_final_round_in_any_order_they_come(after):
    conn = _Conn(*after)
    helpers = rank_process.HostHelpers(conn, conn.recv, 4)
    at_once = helpers.offer(PAYLOADS)
    assert conn.sent == [("offer", 4, PAYLOADS)] and at_once == (after[0] == ("offered", True))
    assert helpers.taken()
    assert helpers.results() == [["times"]] and conn.sent[-1] == ("withdraw",)
    helpers.withdraw()
    assert conn.sent.count(("withdraw",)) == 1


def test_a_rank_refuses_a_message_out_of_place_in_its_final_round():
    conn = _Conn(("go",))
    with pytest.raises(RuntimeError, match="'go'"):
        rank_process.HostHelpers(conn, conn.recv, 0).offer(PAYLOADS)
    conn = _Conn(("offered", False), ("stop",))
    helpers = rank_process.HostHelpers(conn, conn.recv, 0)
    helpers.offer(PAYLOADS)
    with pytest.raises(RuntimeError, match="'stop'"):
        helpers.results()


@NEEDS_INTERPRETER
@pytest.mark.skipif(not hasattr(os, "fork"), reason="ranks forked with the patched Tuner")
def test_two_ranks_share_the_final_round_of_the_last_problem(tmp_path, monkeypatch):
    """With one Problem, both ranks end their search with nothing left to do; one takes the final
    round, and offers its second round, which the other takes over at once."""
    monkeypatch.setattr(Tuner, "_retimes", lambda self: True)
    url = f"sqlite:///{tmp_path / 'host.db'}"
    options = dataclasses.replace(FAST, url=url)
    spans: dict[str, list] = {}
    outcomes = host.tune_on(
        [PROBLEMS[0]],
        [placement.Rank(i, None, GPU) for i in range(2)],
        options,
        lambda *a: None,
        lambda *a: None,
        lambda rank, more: spans.setdefault(rank, []).extend(more),
    )
    assert outcomes[(GPU, 0)].winner is not None
    finals = {rank: [s for s in each if s.name == "final round"] for rank, each in spans.items()}
    assert sorted(len(f) for f in finals.values()) == [3, 3], "each rank re-timed every finalist once"
    with Store(url) as store:
        assert len(store.winners()) == 1
