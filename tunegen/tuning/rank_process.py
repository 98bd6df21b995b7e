"""What one rank of `tunegen tune --gpus` does in its own process (host.py starts it): search the
Problems, and between them ask the host whether to finish one (its final round), help another
rank with the one it is finishing, go on, or stop."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tunegen.kernels.compiler import warm_compiler
from tunegen.kernels.gpu import set_meta_device
from tunegen.kernels.problem import Problem
from tunegen.tuning.interrupt import Interrupted, check, raising
from tunegen.tuning.options import MAX_SEED, TuneOptions
from tunegen.tuning.ranks import Rank
from tunegen.tuning.timeline import TUNER, WAIT_HOST
from tunegen.tuning.tuner import Tuner
from tunegen.tuning.zygote import Zygote, usable

# How often a rank waiting for the host looks whether a signal came or the host died.
POLL_S = 0.5


class HostHelpers:
    """The ranks of this rank's model with nothing left to do, through the host: one may take over
    a round of its final round on Problem `index` (retiming.Helpers). After its answer to the
    offer, the host may say that the round was taken (before it answers the withdrawal, with how
    many helpers took one) and pass on each helper's results (before or after that answer)."""

    def __init__(self, conn: Any, answer: Callable[[], tuple], index: int) -> None:
        self.conn = conn
        self.answer = answer
        self.index = index
        self.took = False
        self.withdrawn = False
        self.helped: list[list[dict[str, Any]] | None] = []
        self.helpers: int | None = None  # known once the host has answered the withdrawal

    def offer(self, payloads: list[dict[str, Any]]) -> bool:
        self.conn.send(("offer", self.index, payloads))
        kind, *args = self.answer()
        if kind != "offered":
            raise RuntimeError(f"the host answered {kind!r} to an offer")
        self.took = args[0]
        return self.took

    def taken(self) -> bool:
        while not self.took and self.conn.poll(0):
            self._take(self.conn.recv())
        return self.took

    def withdraw(self) -> None:
        if not self.withdrawn:
            self.withdrawn = True
            self.conn.send(("withdraw",))

    def results(self) -> list[list[dict[str, Any]] | None]:
        self.withdraw()
        while self.helpers is None or len(self.helped) < self.helpers:
            self._take(self.answer())
        return self.helped

    def _take(self, message: tuple) -> None:
        kind, *args = message
        if kind == "taken":
            self.took = True
        elif kind == "helped":
            self.helped.append(args[0])
        elif kind == "helpers":
            self.helpers = args[0]
        else:
            raise RuntimeError(f"the host sent {kind!r} during a final round")


def owner(problem: int, ranks: int) -> int:
    """The position, among its model's `ranks`, of the rank that owns Problem index `problem`."""
    return problem % ranks


def sampler_seed(seed: int, problem: int, position: int, ranks: int) -> int:
    """The seed of the sampler with which the rank at `position` of its model's `ranks` searches
    Problem index `problem`, in a run seeded `seed`: the run's own for the Problem's owner, which so
    proposes the Variants one GPU would (a Problem searched apart from the run's seed met another
    region of the space: a Winner 5.5% slower, in two runs of two, 2 x H200, 2026-11-27); another
    for each rank that joins it, so that ranks sharing a study do not keep proposing the same
    Variants."""
    return (seed + (position - owner(problem, ranks)) % ranks) % (MAX_SEED + 1)


def search_order(problems: int, position: int, ranks: int) -> list[int]:
    """The order in which the rank at `position` of its model's `ranks` goes through the Problems:
    its own first, searched as one GPU would search them, then the others', last first, where it
    takes the trials their ranks have not yet asked for. Last first, as work is stolen: one its rank
    has not reached yet is searched here alone, where joining the one that rank searches would ask
    for trials blind beside it."""
    own = [j for j in range(problems) if owner(j, ranks) == position]
    return own + [j for j in reversed(range(problems)) if owner(j, ranks) != position]


def rank_main(
    rank: Rank,
    problems: list[Problem],
    options: TuneOptions,
    start: int,
    share: tuple[int, int],
    conn: Any,
    settled: Sequence[int] = (),
) -> None:
    """A rank: search the Problems in its `search_order` from position `start` on, asking this
    host's process between Problems whether to finish one (finalize), help finish another rank's, go
    on (told which Problems a rank has searched, `settled` ones included: skipped here), or stop.
    Of its model's `share` = (its position, the model's ranks) it owns and times the peers of every
    so many Problems, and samples them as one GPU would (`sampler_seed`). It talks through a pipe of
    its own, which dies with it: nothing it sent can be mistaken for its successor's."""
    # Forked, it inherits the progress display's proxies of stdout and stderr: its warnings and
    # tracebacks go to the streams themselves, never through the display (or its lock).
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    parent = multiprocessing.parent_process()
    if options.cpus and len(options.cpus) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, options.cpus[1:])  # the first core is the timing worker's alone

    def answer() -> tuple:
        while not conn.poll(POLL_S):
            check()
            if parent is not None and not parent.is_alive():
                raise SystemExit(1)
        return conn.recv()

    # Its workers are forked by a copy of it made now, with one thread and no CUDA (zygote.py).
    zygote = None
    try:
        if usable():
            with contextlib.suppress(OSError):  # no process to spare: its workers are spawned
                cuda = rank.gpu.backend == "cuda"
                zygote = Zygote(functools.partial(warm_workers, rank) if cuda else None)
        position, ranks = share
        order = search_order(len(problems), position, ranks)
        peers = {p for j, p in enumerate(problems) if owner(j, ranks) == position}
        seeds = {p: sampler_seed(options.seed, j, position, ranks) for j, p in enumerate(problems)}
        settled = set(settled)  # searched by a rank: none left to ask for

        with (
            raising(),
            Tuner(
                rank.gpu, options, times_peers=peers.__contains__, seeds=seeds.__getitem__, zygote=zygote
            ) as tuner,
        ):

            def left(j: int) -> bool:
                """Whether Problem `j` is left to search here: not settled, or holding trials asked
                ahead here (which another rank's final round waits for)."""
                return j not in settled or tuner.flight.holds(problems[j])

            def ahead(after: int) -> list[int]:
                return [j for j in order[after:] if left(j)]

            def checkpoint(searched: int | None, after: int) -> str:
                conn.send(("spans", tuner.timeline.take()))
                conn.send(("ready", searched, bool(ahead(after))))
                while True:
                    with tuner.timeline.span(TUNER, WAIT_HOST):
                        kind, *args = answer()
                    if kind == "help":
                        j, payloads, index, rounds = args
                        conn.send(("helped", tuner.help_final(problems[j], payloads, index, rounds)))
                    elif kind == "finalize":
                        (j,) = args
                        settled.add(j)
                        # the Problems searched next, whose trials compile during the final round
                        later = [problems[k] for k in ahead(after) if k != j]
                        # Split into rounds only where it searches nothing after: a split costs
                        # its GPU a little (each finalist set up twice), and only at the end of
                        # a run does another rank wait with nothing to do.
                        helpers = HostHelpers(conn, answer, j) if ranks > 1 and not later else None
                        conn.send(("outcome", j, tuner.finalize(problems[j], later=later, helpers=helpers)))
                    else:
                        if kind == "go":
                            settled.update(args[0])
                            for k in args[0]:
                                tuner.settle(problems[k])
                        conn.send(("spans", tuner.timeline.take()))
                        return kind
                    conn.send(("spans", tuner.timeline.take()))
                    conn.send(("ready", None, bool(ahead(after))))

            for step in range(start, len(order)):
                i = order[step]
                if not left(i):
                    continue
                conn.send(("start", i))
                later = [problems[k] for k in ahead(step + 1)]
                tuner.search(problems[i], lambda state, i=i: conn.send(("progress", i, state)), later)
                if checkpoint(i, step + 1) == "stop":
                    return
            # Here the host was last told of Problems left (a rank told none is never told to go
            # on: what is left only shrinks), or nothing.
            checkpoint(None, len(order))
    except Interrupted as exc:  # its trials went back to the study as the Tuner closed
        raise SystemExit(exc.exit_code) from None
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        if zygote is not None:
            zygote.close()


def warm_workers(rank: Rank) -> None:
    """Run in a rank's zygote once it has forked the timing worker: the compile workers it forks
    next start with the compiler loaded, and compile for the rank's device asking CUDA nothing."""
    if rank.facts is not None:
        set_meta_device(rank.facts)
    warm_compiler(rank.gpu.capability)
