"""The order of each round when calls are timed in turn, round after round: apart from the timing
itself (CUDA, torch), so that every process that plans rounds can import it."""

from __future__ import annotations


def balanced_rounds(count: int) -> int:
    """How many rounds time `count` calls evenly (`round_order`): the count itself when even or
    1, one more when odd."""
    return count + count % 2 if count > 1 else count


def round_order(count: int, index: int, rounds: int) -> list[int]:
    """The order in which round `index` of `rounds` times `count` calls: a row of a Williams square
    of an even size (row r is 0, 1, size-1, 2, size-2, ... plus r, modulo size; for an odd count,
    of count + 1, the extra call left out), the rows spread by equal shares over the rounds.

    Over `balanced_rounds(count)` rounds each call is timed as often early as late (for an even
    count, once in every position) and follows other calls in turn (for an even count, each other
    call exactly once). A plain rotation would keep every call behind the same one, whose heat it
    would inherit: a GPU's clocks drift under load, and one kernel measured 4-10% slower than its
    own copy that way."""
    if count == 0:
        return []
    size = count + count % 2
    base = [0] + [(k + 1) // 2 if k % 2 else size - k // 2 for k in range(1, size)]
    shift = index * size // rounds
    return [call for call in ((k + shift) % size for k in base) if call < count]
