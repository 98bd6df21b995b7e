"""The order in which a rank of `tunegen tune --gpus` goes through the Problems: its own first,
then the other ranks', skipping those their own ranks have searched (the host says which)."""

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
from tunegen.tuning.timeline import Timeline
from tunegen.tuning.tuner import TuneOptions

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
    """What rank_main asks of its Tuner: the searches it makes, with the Problems searched after,
    whose peers it times, and which Problems it holds trials of (`held`, set by the test)."""

    held: typing.ClassVar[set] = set()

    def __init__(self, gpu, options, *, times_peers, zygote) -> None:
        self.timeline = Timeline()
        self.flight = types.SimpleNamespace(holds=lambda problem: problem in _Tuner.held)
        _Tuner.times_peers = times_peers
        _Tuner.searches = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def search(self, problem, progress, later) -> None:
        _Tuner.searches.append((problem, list(later)))


@pytest.mark.parametrize("held", [False, True], ids=["nothing-held", "trials-held"])
def test_a_rank_skips_the_problems_another_rank_has_searched(monkeypatch, held):
    """Unless it holds trials of one, asked ahead: another rank's final round waits for them."""
    first, second = tiny_problems()
    problems = [first, second, dataclasses.replace(first, batch=3), dataclasses.replace(second, batch=3)]
    monkeypatch.setattr(rank_process, "Tuner", _Tuner)
    monkeypatch.setattr(rank_process, "usable", lambda: False)
    monkeypatch.setattr(_Tuner, "held", {problems[2]} if held else set())
    conn = _Conn(("go", [0, 1]), ("go", [0, 1, 2, 3]), ("stop",))
    with contextlib.suppress(SystemExit):
        rank_process.rank_main(placement.Rank(1, None, GPU), problems, TuneOptions(), 0, (1, 2), conn)
    searched = [(problems.index(p), [problems.index(q) for q in later]) for p, later in _Tuner.searches]
    # its own Problems, then the others' that are not settled, last first: 2 is left after 3
    assert searched == [(1, [3, 2, 0]), (3, [2])] + ([(2, [])] if held else [])
    assert conn.sent == [
        ("start", 1),
        ("ready", 1, True),
        ("start", 3),
        ("ready", 3, True),
        *([("start", 2), ("ready", 2, False)] if held else [("ready", None, False)]),
    ]
    assert [j for j, p in enumerate(problems) if _Tuner.times_peers(p)] == [1, 3], "it times its own peers"
