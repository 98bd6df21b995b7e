"""A final round's re-timings of its finalists, shared with a process that has nothing left to do
where one is, or comes, while they run (final.py runs them; rank_process.HostHelpers finds the
helper through the host).

Where a helper may come, the re-timings are split into ROUNDS rounds, each of which times every
finalist for 1/ROUNDS of the final round's time, each round in its own order. This process queues
all of them; a helper that comes before the last round has started here takes that round over (it
is withdrawn from this process's GPU) and times it on its own. Every round, whoever ran it, timed
every finalist for as long, so the mean over the rounds favours none of them, even where one GPU
is a little faster than the other. Run by one process, the last final round of a run held its GPU
1.4-1.6 s while the other GPU of the host stood idle (2 x H200, 2026-11-26)."""

from __future__ import annotations

import concurrent.futures
import statistics
from collections.abc import Callable
from typing import Any, Protocol

from tunegen.tuning.rounds import round_order

# Rounds of a final round that a helper may share: one for this process, one for a helper.
ROUNDS = 2

Result = dict[str, Any]
# What a re-timing found of its finalist, as against what kept it from finding anything.
DECIDED = ("ok", "wrong")


class Helpers(Protocol):
    """The processes that may take over a round of a final round (rank_process.HostHelpers)."""

    def offer(self, payloads: list[Result]) -> bool:
        """Offer the last round of the finalists' re-timings (`payloads`); whether a helper took
        it at once."""

    def taken(self) -> bool:
        """Whether a helper has taken the round offered (without waiting)."""

    def withdraw(self) -> None:
        """Offer it no more: this process times it itself (without waiting)."""

    def results(self) -> list[list[Result] | None]:
        """The rounds the helpers timed, in the finalists' order (None: the helper died first),
        once every helper that took one is done."""


def combined(rounds: list[list[Result]]) -> list[Result]:
    """Each finalist's re-timing over the `rounds`: ok where every round found it ok, at the mean
    of their times."""
    out = []
    for results in zip(*rounds, strict=True):
        failed = next((r for r in results if r["status"] != "ok"), None)
        out.append(failed or {**results[0], "ms": statistics.fmean(r["ms"] for r in results)})
    return out


def queue(
    submit: Callable[[Result], concurrent.futures.Future], payloads: list[Result], index: int, rounds: int
) -> list[concurrent.futures.Future]:
    """Queue round `index` of `rounds` on the GPU (`submit`): every finalist, each for 1/`rounds`
    of its time, in the order `round_order` gives that round, so that the rounds time each
    finalist early and late alike; futures in `payloads` order."""
    futures: dict[int, concurrent.futures.Future] = {}
    for k in round_order(len(payloads), index, rounds):
        futures[k] = submit({**payloads[k], "rep_ms": payloads[k]["rep_ms"] / rounds})
    return [futures[k] for k in range(len(payloads))]


class Retiming:
    """The re-timings of one final round: queued on this process's GPU at once, the last round
    handed to a helper where one takes it before it starts here (`poll`)."""

    def __init__(
        self,
        submit: Callable[[Result], concurrent.futures.Future],
        payloads: list[Result],
        helpers: Helpers | None,
    ) -> None:
        self.helpers = helpers
        rounds = 1 if helpers is None else ROUNDS
        self.rounds = [queue(submit, payloads, 0, rounds)]
        taken = helpers is not None and helpers.offer(payloads)
        self.rounds += [queue(submit, payloads, i, rounds) for i in range(1, rounds - 1 if taken else rounds)]
        self.offered = helpers is not None and not taken  # the last round, still on offer

    def futures(self) -> list[concurrent.futures.Future]:
        """This process's re-timings, queued on its GPU."""
        return [f for each in self.rounds for f in each]

    def poll(self) -> None:
        """Hand the last round to a helper that has taken it, withdrawn from this GPU where it has
        not started here; once it has started, offer it no more."""
        if not self.offered:
            return
        last = self.rounds[-1]
        started = any(f.running() or f.done() for f in last)
        if self.helpers.taken():
            self.offered = False
            # A round counts whole: one that has started here runs on (the helper's counts too);
            # one cut short (started between the look and the cut) is the helper's alone.
            if not started and any([f.cancel() for f in last]):
                self.rounds.pop()
        elif started:
            self.offered = False
            self.helpers.withdraw()

    def results(self) -> list[Result]:
        """Each finalist's result over this process's rounds and the helpers' (`combined`), once
        all are done."""
        if self.offered:
            self.offered = False
            self.helpers.withdraw()
        own = [[f.result() for f in each] for each in self.rounds]
        helped = self.helpers.results() if self.helpers is not None else []
        # A helper's round counts where it timed or verified every finalist: one its process could
        # not finish (it died, stopped, or lost its timing worker) says nothing of them.
        return combined(
            [*own, *(r for r in helped if r is not None and all(x["status"] in DECIDED for x in r))]
        )
