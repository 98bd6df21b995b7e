"""Work a tuning process moves ahead so that its GPU does not wait: the next Problem's first trials
asked for and compiled while a final round runs, a rank's first peers timed while its first
compiles run; and the command's exit, which skips the interpreter's teardown."""

from __future__ import annotations

import collections
import concurrent.futures
import subprocess
import sys
import threading
import time

import pytest
from conftest import NEEDS_INTERPRETER

from helpers import assert_each_variant_evaluated_once, tiny_problems
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning import final
from tunegen.tuning.flight import Flight, Pending
from tunegen.tuning.interrupt import SLICE_S
from tunegen.tuning.presets import dry_run, parse_shape, problems
from tunegen.tuning.retiming import Retiming
from tunegen.tuning.timeline import problem_label
from tunegen.tuning.tuner import TuneOptions, Tuner

GPU = interpreter_gpu()
PROBLEMS = tiny_problems()
# How long the stand-in final round holds the GPU: longer than an interpreted compile.
FINAL_S = 4.0


def _causal(shape: str):
    """A causal Problem of `shape` shrunk for the interpreter: apart from PROBLEMS (not causal)."""
    return dry_run(problems([parse_shape(shape)], causal=(True,), seqlens=(1024,))[0])


def _slow_final_round(tuner: Tuner, spans: list):
    """A final round as on a GPU (the interpreter has none): the fastest trial re-timed on the
    timing thread, holding it FINAL_S, at a time of 1 ms so that its result shows in the Winner."""

    def final_round(problem, complete, helpers=None):
        best = min(complete, key=lambda t: (t.value, t.number))

        def on_gpu(payload):
            start = time.time()
            time.sleep(FINAL_S)
            spans.append((start, time.time()))
            return {"status": "ok", "ms": 1.0}

        return [best], Retiming(
            lambda payload: tuner._timing.submit(on_gpu, payload), [{"rep_ms": 1.0}], None
        )

    return final_round


@NEEDS_INTERPRETER
def test_the_next_problem_is_asked_for_and_compiles_while_a_final_round_runs(tmp_path, monkeypatch):
    """While a Problem's final round holds the GPU, the Problem searched next (the first of
    `later`) is asked for and compiled, and its compiled trials are queued on the GPU behind the
    final round; the Winner takes the final round's time; the next search loses and repeats
    nothing (asked afterwards, the asks and compiles left the GPU idle 1-1.4 s after each final
    round on 2 x H200)."""
    url = f"sqlite:///{tmp_path / 'final.db'}"
    options = TuneOptions(trials=3, workers=2, url=url, trial_timeout=300)
    final_spans: list = []
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        tuner.timeline.take()
        monkeypatch.setattr(tuner, "_final_round", _slow_final_round(tuner, final_spans))
        on_gpu_queue, queued = tuner._on_gpu_queue, []

        def queue(pending):
            queued.append((pending.problem, time.time()))
            on_gpu_queue(pending)

        monkeypatch.setattr(tuner, "_on_gpu_queue", queue)
        outcome = tuner.finalize(PROBLEMS[0], later=[PROBLEMS[1]])
        spans = tuner.timeline.take()
        second = tuner.tune(PROBLEMS[1])
    assert outcome.winner is not None and outcome.winner.median_ms == 1.0, "the final round's time"
    (_, final_end) = final_spans[0]
    label = problem_label(PROBLEMS[1])
    asked = [s for s in spans if s.lane == "sampler" and s.problem == label]
    compiled = [s for s in spans if s.lane.startswith("compile") and s.problem == label]
    # the round's thread may start it a moment after the first ask: what matters is before its end
    assert asked and min(s.start for s in asked) < final_end, "asked during the final round"
    assert any(s.end < final_end for s in compiled), "compiled during the final round"
    assert any(p == PROBLEMS[1] and when < final_end for p, when in queued), "queued behind the round"
    assert second.winner is not None
    assert_each_variant_evaluated_once(url, GPU, PROBLEMS[1], 3)


@NEEDS_INTERPRETER
def test_a_final_round_asks_for_the_problem_after_one_that_others_have_taken_whole(tmp_path, monkeypatch):
    """Another process may have taken the next Problem's last trials: the final round then asks
    for the one after it (on 2 x H200 the GPU otherwise waited 1 s after such a final round)."""
    url = f"sqlite:///{tmp_path / 'after.db'}"
    options = TuneOptions(trials=2, workers=2, url=url, trial_timeout=300)
    third = _causal("4,2,32")
    with Tuner(GPU, options) as tuner:
        tuner.tune(PROBLEMS[1])  # every trial of the next Problem taken
        tuner.search(PROBLEMS[0])
        tuner.timeline.take()
        monkeypatch.setattr(tuner, "_final_round", _slow_final_round(tuner, []))
        tuner.finalize(PROBLEMS[0], later=[PROBLEMS[1], third])
        asked = {s.problem for s in tuner.timeline.take() if s.lane == "sampler"}
        assert asked == {problem_label(third)}
        tuner.tune(third)
    assert_each_variant_evaluated_once(url, GPU, third, 2)


@NEEDS_INTERPRETER
def test_without_a_next_problem_a_final_round_asks_for_nothing(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'last.db'}"
    options = TuneOptions(trials=2, workers=1, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        tuner.search(PROBLEMS[0])
        tuner.timeline.take()
        monkeypatch.setattr(tuner, "_final_round", _slow_final_round(tuner, []))
        assert tuner.finalize(PROBLEMS[0]).winner is not None
        spans = tuner.timeline.take()
        assert not [s for s in spans if s.lane == "sampler"] and not tuner.flight.futures()


@NEEDS_INTERPRETER
def test_a_final_round_waits_for_its_rest_without_spinning(tmp_path, monkeypatch):
    """Once the first re-timing of a final round is done, the wait for the others still sleeps
    between looks (a wait that included the finished one returned at once, 200,000 times a
    second)."""
    looks = []
    monkeypatch.setattr(final, "check", lambda: looks.append(1))
    options = TuneOptions(trials=2, workers=1, url=f"sqlite:///{tmp_path / 'wait.db'}", trial_timeout=300)
    with Tuner(GPU, options) as tuner, concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(lambda: None), pool.submit(time.sleep, 0.6)]
        tuner._search_ahead(running, [])
    assert len(looks) < 0.6 / SLICE_S + 10, len(looks)


@NEEDS_INTERPRETER
def test_a_process_times_the_peers_of_its_next_problems_while_its_first_trials_compile(tmp_path):
    """At a run's start the GPU waits for the first compiles: the peers of the next Problems this
    process times (not those it leaves to others) are timed then, in order, ahead of any trial,
    and each once."""
    url = f"sqlite:///{tmp_path / 'peers.db'}"
    options = TuneOptions(trials=2, workers=2, url=url, trial_timeout=300)
    third, fourth = _causal("4,2,32"), _causal("8,2,64")
    mine = [PROBLEMS[1], third, fourth]
    with Tuner(GPU, options, times_peers=mine.__contains__) as tuner:
        tuner.search(PROBLEMS[0], later=[PROBLEMS[1], third, fourth])
        spans = tuner.timeline.take()
    work = sorted((s for s in spans if s.lane == "gpu" and s.name != "warm-up"), key=lambda s: s.start)
    assert (work[0].name, work[0].problem) == ("peers", problem_label(PROBLEMS[1]))
    peers = [s.problem for s in work if s.name == "peers"]
    assert peers == [problem_label(p) for p in mine[: len(peers)]], "in order, each once, only its own"


class _Idle(final.FinalRound):
    """The part of a Tuner that `_peers_while_idle` reads: what is in flight, the Problem searched,
    the later ones, which peers were timed; the peers it queues are collected."""

    def __init__(self, searching, later, timed=()):
        self.flight = Flight(2)
        self._searching, self._later_peers, self._peers = searching, list(later), {}
        self._peers_tried = set()
        self.times_peers = set(later).__contains__
        self.timed, self.queued = set(timed), []
        self.options = TuneOptions(trials=2)

    def _study(self, problem):
        return problem

    def _peer(self, study, problem):
        return {"ms": 1.0} if problem in self.timed else None

    def _payload(self, problem, variant, seed):
        return {}

    def _on_gpu_queue(self, pending):
        self.queued.append(pending.problem)
        self.flight.timing[concurrent.futures.Future()] = pending


def _compiling(tuner: _Idle, problem, since: float | None = None) -> None:
    pending = Pending(problem, object(), None, {}, **({} if since is None else {"since": since}))
    tuner.flight.compiling[concurrent.futures.Future()] = pending


def test_peers_fill_the_gpu_only_while_it_would_wait_for_the_searched_problems_compiles():
    """The next later Problem's peers not yet timed are queued, one at a time, only while the GPU
    has nothing queued nor compiled waiting and the searched Problem has trials compiling: not
    after the search (nor before it holds any trial), whose final round would wait for them."""
    now, second, third = PROBLEMS[0], PROBLEMS[1], _causal("4,2,32")
    tuner = _Idle(now, [second, third], timed={second})
    tuner._peers_while_idle()
    assert tuner.queued == [], "the searched Problem holds nothing"
    _compiling(tuner, now)
    tuner._peers_while_idle()
    tuner._peers_while_idle()
    assert tuner.queued == [third], "the first not yet timed, once: the GPU then has it to time"
    tuner.flight.timing.clear()  # its peers failed: they are not tried again in a later search
    tuner._peers_first(now, [second, third])
    tuner._peers_while_idle()
    assert tuner.queued == [third]
    tuner = _Idle(now, [second, third])
    _compiling(tuner, now)
    tuner.flight.ready[now] = collections.deque([Pending(now, object(), None, {})])
    tuner._peers_while_idle()
    assert tuner.queued == [], "a compiled trial waits"
    tuner.flight.ready.clear()
    tuner._searching = None
    tuner._peers_while_idle()
    assert tuner.queued == [], "no search"


def test_peers_wait_for_a_compile_about_to_end_not_for_a_straggler():
    """With compiles measured at 1 s, the peers are not queued in front of a compile due within
    PEERS_S, are behind one due later, and behind a straggler (running twice its estimate and
    more), which is not counted as coming."""
    now, later = PROBLEMS[0], PROBLEMS[1]
    for age, queued in [(1.0 - final.PEERS_S / 2, []), (0.2, [later]), (2.5, [later])]:
        tuner = _Idle(now, [later])
        tuner.flight.compiled(1.0)
        _compiling(tuner, now, since=time.monotonic() - age)
        tuner._peers_while_idle()
        assert tuner.queued == queued, age


@pytest.mark.parametrize(("code", "status"), [(0, 0), (3, 3), (None, 0), ("'stopped'", 1)])
def test_the_command_exits_with_its_code_its_output_flushed_and_its_exit_handlers_run(tmp_path, code, status):
    """`run` skips the interpreter's teardown, not what the program asked for at its exit: its
    status as Python's own exit gives it (a message printed, status 1), output, exit handlers."""
    marker = tmp_path / "handler_ran"
    script = (
        "import atexit, sys\n"
        "from tunegen.cli import main as cli\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "sys.stdout.write('unflushed output')\n"
        f"cli.main = lambda: sys.exit({code})\n"
        "cli.run()\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed output"
    assert marker.read_text() == "yes"
    assert done.stderr == ("stopped\n" if status == 1 else "")


class _Settling(final.FinalRound):
    """The part of a Tuner that a final round's wait for other processes' trials drives: what is
    in flight; what it tells the studies and queues on the GPU is collected."""

    def __init__(self):
        self.flight = Flight(2)
        self.told, self.queued = [], []

    def _take(self, done, current, progress):
        for future in done:
            if future in self.flight.compiling:
                pending = self.flight.compiling.pop(future)
                self.flight.ready.setdefault(pending.problem, collections.deque()).append(pending)
            else:
                self.told.append(self.flight.timing.pop(future).problem)

    def _on_gpu_queue(self, pending):
        self.queued.append(pending.problem)


def test_a_final_round_waiting_for_other_processes_times_its_own_trials_meanwhile():
    """Its trials of a later Problem go to the GPU and are told as they come: the process it waits
    for may be waiting, in its own final round, for exactly those (both waited 15 minutes)."""
    tuner = _Settling()
    compiling, timed = concurrent.futures.Future(), concurrent.futures.Future()
    tuner.flight.compiling[compiling] = Pending(PROBLEMS[1], object(), None, {})
    tuner.flight.timing[timed] = Pending(PROBLEMS[0], object(), None, {})
    threading.Timer(0.1, compiling.set_result, [{"status": "ok"}]).start()
    threading.Timer(0.2, timed.set_result, [{"status": "ok"}]).start()
    start = time.monotonic()
    tuner._time_own(0.5)
    assert 0.5 <= time.monotonic() - start < 0.5 + 2 * SLICE_S
    assert tuner.queued == [PROBLEMS[1]] and tuner.told == [PROBLEMS[0]]
    assert not tuner.flight.futures(), "nothing left in flight to wait on: the rest of the wait sleeps"


def test_a_final_round_waiting_queues_its_compiled_trials_with_nothing_in_flight():
    tuner = _Settling()
    tuner.flight.ready[PROBLEMS[1]] = collections.deque([Pending(PROBLEMS[1], object(), None, {})])
    tuner._time_own(0.1)
    assert tuner.queued == [PROBLEMS[1]], "a compiled trial another final round may wait for"
