"""Local attention masks (sliding window, chunked local attention) with FlashAttention's conventions,
as exact boolean masks for the references and as pair counts for the work a Problem does.

Masks are bottom-right aligned: query row i sits at key position p = i + seqlen_k - seqlen_q and sees
key j (0 <= j < seqlen_k) iff j <= p under causal, p - left <= j when left >= 0, j <= p + right when
right >= 0, and, with a chunk C > 0, c0 <= j < c0 + C where c0 = floor(p / C) * C (floor division,
so rows at negative positions get a chunk of negative keys and see nothing). A side of -1 is
unbounded and a chunk of 0 means no chunks (FlashAttention's `window_size` and `attention_chunk`).
"""

from __future__ import annotations

import torch


def _check(left: int, right: int, chunk: int) -> None:
    """Refuse values that mean nothing: sides below -1 and negative chunks."""
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size: expected two ints of at least -1 (-1: unbounded), got {(left, right)}"
        )
    if chunk < 0:
        raise ValueError(f"attention_chunk: expected an int >= 0 (0: no chunks), got {chunk}")


def normalize_local(
    causal: bool, left: int, right: int, chunk: int, seqlen_q: int, seqlen_k: int
) -> tuple[bool, int, int, int]:
    """The canonical `(causal, left, right, chunk)` that tunegen stores: the same mask, with every
    bound that excludes no key of any row dropped (FlashAttention's `flash_api.cpp` rules), so that
    a window wider than the sequences is the plain Problem and reuses its Winners.

    Positions run over [seqlen_k - seqlen_q, seqlen_k - 1], so the left side excludes nothing iff
    left >= seqlen_k - 1 (the last row reaches key 0) and the right side iff right >= seqlen_q - 1
    (the first row reaches the last key). Causal keeps `right` at -1 (causal bounds that side; a
    right side under causal is FA's silent override). A chunk bounds each side to C - 1, so wider
    sides are dropped; the chunk itself is dropped when C >= seqlen_k (every row at a position >= 0
    has chunk 0, holding all keys) and no row sits at a negative position that the chunk alone
    would blind (seqlen_q <= seqlen_k, or causal). A right side of 0 is causal's mask, so it is
    stored as causal, with or without a left side or chunk: one key for one mask.
    """
    _check(left, right, chunk)
    causal = causal or right == 0
    if left >= seqlen_k - 1 or (chunk > 0 and left >= chunk - 1):
        left = -1
    if causal or right >= seqlen_q - 1 or (chunk > 0 and right >= chunk - 1):
        right = -1
    if chunk >= max(seqlen_k, 1) and (seqlen_q <= seqlen_k or causal):
        chunk = 0
    return causal, left, right, chunk


def _bounds(
    pos: torch.Tensor, seqlen_k: int, causal: bool, left: int, right: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last key (inclusive) each position sees; last < first for a row that sees none."""
    _check(left, right, chunk)
    lo = torch.zeros_like(pos)
    hi = torch.full_like(pos, seqlen_k - 1)
    if causal:
        hi = torch.minimum(hi, pos)
    if left >= 0:
        lo = torch.maximum(lo, pos - left)
    if right >= 0:
        hi = torch.minimum(hi, pos + right)
    if chunk > 0:
        start = torch.div(pos, chunk, rounding_mode="floor") * chunk
        lo = torch.maximum(lo, start)
        hi = torch.minimum(hi, start + chunk - 1)
    return lo, hi


def local_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool,
    left: int = -1,
    right: int = -1,
    chunk: int = 0,
    rows: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The (seqlen_q, seqlen_k) boolean mask (True = attend), or with `rows` (query row indices,
    on their own device) the (len(rows), seqlen_k) mask of those rows, for checks that sample
    rows of long sequences."""
    if rows is None:
        rows = torch.arange(seqlen_q, device=device)
    lo, hi = _bounds(rows.long() + (seqlen_k - seqlen_q), seqlen_k, causal, left, right, chunk)
    cols = torch.arange(seqlen_k, device=rows.device)[None, :]
    return (cols >= lo[:, None]) & (cols <= hi[:, None])


def attended_pairs(
    seqlen_q: int, seqlen_k: int, *, causal: bool, left: int = -1, right: int = -1, chunk: int = 0
) -> int:
    """How many (row, key) pairs attend, exactly: the work of one head, in O(seqlen_q) time and
    memory, never building the mask (it counts Problems of 128k tokens)."""
    pos = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    lo, hi = _bounds(pos, seqlen_k, causal, left, right, chunk)
    return int((hi - lo + 1).clamp_min(0).sum())


def keys_seen(
    seqlen_q: int, seqlen_k: int, *, causal: bool, left: int = -1, right: int = -1, chunk: int = 0
) -> int:
    """How many keys at least one row sees: what a kernel that skips every key no row sees must
    read of K and V (decode over a window reads those keys, not the whole cache). O(seqlen_q +
    seqlen_k), never building the mask."""
    pos = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    lo, hi = _bounds(pos, seqlen_k, causal, left, right, chunk)
    some = hi >= lo
    edges = torch.zeros(seqlen_k + 1, dtype=torch.int64)
    edges.index_add_(0, lo[some], torch.ones_like(lo[some]))
    edges.index_add_(0, hi[some] + 1, -torch.ones_like(hi[some]))
    return int((edges.cumsum(0)[:seqlen_k] > 0).sum())
