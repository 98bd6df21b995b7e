"""The order in which a rank of `tunegen tune --gpus` goes through the Problems: its own first,
then the other ranks', skipping those their own ranks have searched (the host says which); and the
seed with which it samples each: one GPU's for the Problems it owns."""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing

import pytest

from helpers import tiny_problems
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning import rank_process
from tunegen.tuning import ranks as placement
from tunegen.tuning import tuner as tuner_module
from tunegen.tuning.options import MAX_SEED
from tunegen.tuning.timeline import Timeline
from tunegen.tuning.tuner import TuneOptions, Tuner

GPU = interpreter_gpu()


def test_each_rank_searches_its_own_problems_first_then_joins_the_others():
    assert rank_process.search_order(5, 0, 2) == [0, 2, 4, 3, 1]
    assert rank_process.search_order(5, 1, 2) == [1, 3, 4, 2, 0], "the others' last first"
    assert rank_process.search_order(3, 0, 1) == [0, 1, 2]
    assert rank_process.search_order(2, 2, 3) == [1, 0], "more ranks than Problems: it only joins"


class _Conn:
    """A rank's end of its pipe: the host's answers queued, what the rank sent recorded."""

    def __init__(self, *answers: tuple) -> None:
        self.answers = list(answers)
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        if message[0] != "spans":
            self.sent.append(message)

    def poll(self, timeout: float | None = None) -> bool:
        return bool(self.answers)

    def recv(self) -> tuple:
        return self.answers.pop(0)


class _Tuner:
    """What rank_main asks of its Tuner: the searches and final rounds it makes, with the Problems
    searched after, the Problems it is told are settled, whose peers it times, and which Problems
    it holds trials of (`held`, set by the test), and with which seed it samples each."""

    held: typing.ClassVar[set] = set()

    def __init__(self, gpu, options, *, times_peers, seeds, zygote) -> None:
        self.timeline = Timeline()
        self.flight = types.SimpleNamespace(holds=lambda problem: problem in _Tuner.held)
        _Tuner.times_peers, _Tuner.seeds = times_peers, seeds
        _Tuner.searches, _Tuner.finals, _Tuner.settled = [], [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def search(self, problem, progress, later) -> None:
        _Tuner.searches.append((problem, list(later)))

    def finalize(self, problem, *, later, helpers):
        _Tuner.finals.append((problem, list(later)))

    def settle(self, problem) -> None:
        _Tuner.settled.append(problem)


def _run(monkeypatch, problems, answers, *, held=(), settled=(), seed=0):
    """rank_main as rank 1 of 2 over `problems`, the host answering `answers` in turn; what it sent
    the host, and its searches and final rounds as (Problem index, indices searched after)."""
    monkeypatch.setattr(rank_process, "Tuner", _Tuner)
    monkeypatch.setattr(rank_process, "usable", lambda: False)
    monkeypatch.setattr(_Tuner, "held", {problems[k] for k in held})
    conn = _Conn(*answers)
    with contextlib.suppress(SystemExit):
        rank = placement.Rank(1, None, GPU)
        rank_process.rank_main(rank, problems, TuneOptions(seed=seed), 0, (1, 2), conn, settled)

    def indices(calls):
        return [(problems.index(p), [problems.index(q) for q in later]) for p, later in calls]

    return conn.sent, indices(_Tuner.searches), indices(_Tuner.finals)


def _four():
    first, second = tiny_problems()
    return [first, second, dataclasses.replace(first, batch=3), dataclasses.replace(second, batch=3)]


@pytest.mark.parametrize("held", [False, True], ids=["nothing-held", "trials-held"])
def test_a_rank_skips_the_problems_another_rank_has_searched(monkeypatch, held):
    """Unless it holds trials of one, asked ahead: another rank's final round waits for them. It
    asks for no more of those (`settle`)."""
    problems = _four()
    answers = [("go", [0, 1]), ("go", [0, 1, 2, 3]), ("stop",)]
    sent, searched, _ = _run(monkeypatch, problems, answers, held=[2] if held else [])
    # its own Problems, then the others' that are not settled, last first: 2 is left after 3
    assert searched == [(1, [3, 2, 0]), (3, [2])] + ([(2, [])] if held else [])
    assert sent == [
        ("start", 1),
        ("ready", 1, True),
        ("start", 3),
        ("ready", 3, True),
        *([("start", 2), ("ready", 2, False)] if held else [("ready", None, False)]),
    ]
    assert _Tuner.settled == [problems[k] for k in [0, 1, 0, 1, 2, 3]]
    assert [j for j, p in enumerate(problems) if _Tuner.times_peers(p)] == [1, 3], "it times its own peers"


def test_a_final_round_asks_ahead_for_what_is_left_but_its_own_problem(monkeypatch):
    """Handed Problem 0 (its owner searched it) before any "go" named it settled: the final round
    does not ask ahead for Problem 0 itself, nor does the rank search it after."""
    problems = _four()
    sent, searched, finals = _run(monkeypatch, problems, [("finalize", 0), ("go", [0, 1]), ("stop",)])
    assert finals == [(0, [3, 2])]
    assert searched == [(1, [3, 2, 0]), (3, [2])]
    assert ("start", 0) not in sent and ("outcome", 0, None) in sent


def test_a_rank_started_again_skips_what_was_settled_before(monkeypatch):
    sent, searched, _ = _run(monkeypatch, _four(), [("go", [0, 1, 2]), ("stop",)], settled=[0, 2])
    assert searched == [(1, [3]), (3, [])], "2 and 0, settled, are neither searched nor asked ahead"
    assert sent[:2] == [("start", 1), ("ready", 1, True)]


def test_the_owner_of_a_problem_samples_it_as_one_gpu_would_and_each_joiner_apart():
    """A Problem searched with another seed than one GPU's meets another region of the space (the
    D64 4096 causal Winner was 5.5% slower with two GPUs, twice): its owner takes the run's seed."""
    seeds = [[rank_process.sampler_seed(7, j, position, 3) for position in range(3)] for j in range(4)]
    assert [row[rank_process.owner(j, 3)] for j, row in enumerate(seeds)] == [7] * 4
    assert all(sorted(row) == [7, 8, 9] for row in seeds), "ranks that join a study sample apart"
    assert rank_process.sampler_seed(7, 5, 0, 1) == 7, "one GPU: the run's seed"
    assert rank_process.sampler_seed(MAX_SEED, 0, 1, 2) == 0, "within Optuna's range"


def test_a_rank_seeds_each_problems_sampler_by_its_owner(monkeypatch):
    problems = _four()
    _run(monkeypatch, problems, [("go", [0, 1, 2, 3]), ("stop",)], seed=11)
    assert [_Tuner.seeds(p) for p in problems] == [12, 11, 12, 11], "rank 1 of 2 owns Problems 1 and 3"


def test_a_tuner_opens_each_problems_study_with_that_problems_seed(tmp_path, monkeypatch):
    opened = []

    def recorded(storage, gpu, problem, sampler, seed):
        opened.append((problem, seed))
        return object()

    monkeypatch.setattr(tuner_module, "open_study", recorded)
    first, second = tiny_problems()
    options = TuneOptions(seed=3, workers=1, url=f"sqlite:///{tmp_path / 'seeds.db'}")
    with Tuner(GPU, options, seeds={first: 3, second: 4}.__getitem__) as tuner:
        tuner._study(first), tuner._study(second), tuner._study(first)
    with Tuner(GPU, options) as tuner:
        tuner._study(second)
    assert opened == [(first, 3), (second, 4), (second, 3)], "opened once each; the run's seed by default"
