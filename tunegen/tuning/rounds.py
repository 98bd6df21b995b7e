"""The order of each round when calls are timed in turn, round after round: apart from the timing
itself (CUDA, torch), so that every process that plans rounds can import it."""

from __future__ import annotations


def round_order(count: int, index: int, rounds: int) -> list[int]:
    """The order in which round `index` of `rounds` times `count` calls: a row of a Williams square
    of an even size (row r is 0, 1, size-1, 2, size-2, ... plus r, modulo size; for an odd count,
    of count + 1, the extra call left out), the rows spread by equal shares over the rounds. With
    as many rounds as calls, each call starts a round once, and follows a different call in most
    rounds (for an even count, each other call once, and is timed once in every position). A plain
    rotation would keep every call behind the same one, whose heat it would always inherit: a GPU's
    clocks drift under load, and one kernel measured 4-9% slower than its own copy that way."""
    size = count + count % 2
    base = [0] + [(k + 1) // 2 if k % 2 else size - k // 2 for k in range(1, size)]
    row = index * size // rounds
    return [call for call in ((k + row) % size for k in base) if call < count]
