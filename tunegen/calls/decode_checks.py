"""The decode call's input checks (`check_decode`), and why a sequence's lengths or pages cannot be
used (`faults`): the kernels test the same on the device and give such a sequence NaN; these read
the lengths and the block table back, for check=True and the PyTorch path."""

from __future__ import annotations

import torch

from tunegen import checks
from tunegen.calls.local import NONE, Local
from tunegen.kernels import fp8
from tunegen.kernels.problem import DTYPE_NAMES

MAX_QUERY_TOKENS = 16


def check_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k,
    v,
    block_table,
    *,
    read_lengths: bool,
    local: Local = NONE,
    k_descale=None,
    v_descale=None,
) -> None:
    """Check decode inputs; with `read_lengths`, also that the lengths and pages fit the cache.
    A float8_e4m3fn cache takes 16-bit queries and optional descales (batch, kv_heads)."""
    q = checks.tensor_arg("q", q, 4, "(batch, nq, heads, head_dim)")
    layout = (
        "(pages, page_size, kv_heads, head_dim)"
        if block_table is not None
        else "(batch, slots, kv_heads, head_dim)"
    )
    fp8_cache = isinstance(k_cache, torch.Tensor) and k_cache.dtype == fp8.E4M3
    cache_dtypes = (fp8.E4M3,) if fp8_cache else tuple(DTYPE_NAMES)
    k_cache = checks.tensor_arg("k_cache", k_cache, 4, layout, cache_dtypes)
    v_cache = checks.tensor_arg("v_cache", v_cache, 4, layout, cache_dtypes)
    checks.same_as_q(q, {"k_cache": k_cache, "v_cache": v_cache}, dtype=not fp8_cache)
    if fp8_cache and q.dtype == torch.float32:
        raise ValueError("q: a float8_e4m3fn cache takes float16 or bfloat16 queries, got float32")
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is None:
            continue
        if not fp8_cache:
            raise ValueError(f"{name}: descales apply to float8_e4m3fn caches; this cache is {k_cache.dtype}")
        checks.descale_arg(name, descale, [(q.shape[0], k_cache.shape[2])], q.device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: expected shape {tuple(k_cache.shape)} like k_cache, got {tuple(v_cache.shape)}"
        )
    checks.heads(q.shape[2], k_cache.shape[2], v_cache.shape[2], k_name="k_cache", v_name="v_cache")
    batch, nq = q.shape[0], q.shape[1]
    if nq > MAX_QUERY_TOKENS:
        raise ValueError(
            f"q: decode takes at most {MAX_QUERY_TOKENS} query tokens, got {nq}; use tunegen.attention"
        )
    seqlens = checks.int32_arg("cache_seqlens", cache_seqlens, 1, f"of {batch} lengths", q.device)
    if seqlens.shape[0] != batch:
        raise ValueError(
            f"cache_seqlens: expected {batch} lengths (one per sequence), got {seqlens.shape[0]}"
        )
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected batch {batch} like q, got {k_cache.shape[0]}")
        capacity = k_cache.shape[1]
    else:
        table = checks.block_table_arg(block_table, batch, "k_cache", k_cache)
        capacity = table.shape[1] * k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    n_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            t = checks.tensor_arg(name, t, 4, "(batch, new_tokens, kv_heads, head_dim)")
            checks.same_as_q(q, {name: t})
            if t.shape[0] != batch or t.shape[2] != k_cache.shape[2]:
                raise ValueError(
                    f"{name}: expected (batch {batch}, new_tokens, kv_heads {k_cache.shape[2]}, head_dim), "
                    f"got {tuple(t.shape)}"
                )
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"v: expected {k.shape[1]} new tokens like k, got {v.shape[1]}")
        n_new = k.shape[1]
        if n_new > capacity:
            raise ValueError(f"k: {n_new} new tokens do not fit the cache's {capacity} slots per sequence")
    if read_lengths:
        fault = next(filter(None, faults(k_cache, seqlens, block_table, n_new, local, q.shape[1])), None)
        if fault is not None:
            raise ValueError(fault)


def faults(
    k_cache, cache_seqlens, block_table, n_new: int, local: Local = NONE, nq: int = 1
) -> list[str | None]:
    """Per sequence, why its cache cannot be used (the argument, the sequence and the problem), or
    None: a negative length, no room for its new tokens, or a page it uses outside the cache (those
    before a window's or chunk's first key and its new tokens' are unused). The kernels test the same
    on the device and give such a sequence NaN; this reads the lengths and the block table back (a
    device-to-host copy), for check=True and the PyTorch path."""
    lengths = cache_seqlens.tolist()
    rows = [None] * len(lengths) if block_table is None else block_table.tolist()
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    return [
        _fault(
            b,
            length,
            row,
            n_new,
            capacity,
            k_cache.shape[0],
            k_cache.shape[1],
            used_from(local, length, n_new, nq),
        )
        for b, (length, row) in enumerate(zip(lengths, rows, strict=True))
    ]


def used_from(local: Local, length: int, n_new: int, nq: int) -> int:
    """The first slot a sequence of `length` cached tokens uses: where its new tokens go, or where
    its rows start to see keys, whichever comes first (0 without a window or chunk)."""
    return max(0, min(length, local.first_key(length + n_new, nq)))


def _fault(
    b: int, length: int, row, n_new: int, capacity: int, num_pages: int, page: int, used_from: int = 0
) -> str | None:
    """Why sequence b (its length, and its block table row or None) cannot be used, or None; pages
    before `used_from`'s are not used."""
    if length < 0:
        return f"cache_seqlens: sequence {b} has length {length}, expected 0 or more"
    if length > capacity - n_new:
        return (
            f"cache_seqlens: sequence {b} needs {length + n_new} slots ({length} cached + {n_new} new), "
            f"the cache holds {capacity}"
        )
    used = [] if row is None else row[used_from // page : -(-(length + n_new) // page)]
    bad = [p for p in used if not 0 <= p < num_pages]
    if bad:
        return f"block_table: sequence {b} names pages {bad}, outside the cache's pages 0..{num_pages - 1}"
    return None
