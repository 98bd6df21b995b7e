"""What the defaults sweeps (`*_defaults.py`) share with `tunegen bench`: the candidates and peers
of one shape, each checked first, are timed together in rounds, each in its own order
(`tunegen.tuning.timing.interleaved_ms`, as the bench times), never one after another:
a GPU's clocks drift under sustained load, by more than separates the candidates."""

from __future__ import annotations

from collections.abc import Callable

from tunegen.tuning.timing import interleaved_ms

# Rounds per shape: each candidate timed early, midway and late in the shape's run (bench's
# compare a handful of implementations in as many rounds; a sweep's 40 to 100 candidates cannot).
ROUNDS = 3
REP_MS = 100.0


def time_in_rounds(timed: list[tuple[dict, Callable[[], object]]], rounds: int = ROUNDS) -> None:
    """Time the checked calls of one shape together and write each record's median "ms". A record
    with an "impl" is a peer's, timed under that name (so inside its setting, see
    `tunegen.kernels.peers.pinned`); the others are the sweep's candidates."""
    calls = {rec.get("impl") or f"candidate {i}": call for i, (rec, call) in enumerate(timed)}
    times = interleaved_ms(calls, rep_ms=REP_MS, rounds=rounds)
    for (rec, _), ms in zip(timed, times.values(), strict=True):
        rec["ms"] = ms
