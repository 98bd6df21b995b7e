"""A checked call of the decode family: `tunegen.decode_attention` (and `KVCache.attention`), in
FlashAttention's `flash_attn_with_kvcache` conventions, as every path that serves one sees it: the
checks, the Problem key, the outputs, the kernel's launch arguments and the PyTorch path."""

from __future__ import annotations

import dataclasses
import functools

import torch

from tunegen import checks
from tunegen.backends import backend_for
from tunegen.calls.local import NONE, Local, check_local
from tunegen.kernels import fp8
from tunegen.kernels.launch_args import DecodeArgs
from tunegen.kernels.problem import DTYPE_NAMES, Problem
from tunegen.kernels.reference import attention_reference

MAX_QUERY_TOKENS = 16


def _int32(name: str, t: object, rank: int, what: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype != torch.int32:
        got = (
            f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        )
        raise ValueError(f"{name}: expected a {rank}-D int32 tensor {what}, got {got}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like q, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit last stride; call .contiguous() on it")
    return t


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
    seqlens = _int32("cache_seqlens", cache_seqlens, 1, f"of {batch} lengths", q.device)
    if seqlens.shape[0] != batch:
        raise ValueError(
            f"cache_seqlens: expected {batch} lengths (one per sequence), got {seqlens.shape[0]}"
        )
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected batch {batch} like q, got {k_cache.shape[0]}")
        capacity = k_cache.shape[1]
    else:
        table = _int32("block_table", block_table, 2, "(batch, max_pages)", q.device)
        if table.shape[0] != batch:
            raise ValueError(f"block_table: expected {batch} rows (one per sequence), got {table.shape[0]}")
        page = k_cache.shape[1]
        if page % 16:
            raise ValueError(
                f"k_cache: the page size (dimension 1) must be a positive multiple of 16, got {page}"
            )
        capacity = table.shape[1] * page
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
        fault = next(filter(None, _faults(k_cache, seqlens, block_table, n_new)), None)
        if fault is not None:
            raise ValueError(fault)


def _faults(k_cache, cache_seqlens, block_table, n_new: int) -> list[str | None]:
    """Per sequence, why its cache cannot be used (the argument, the sequence and the problem), or
    None: a negative length, no room for its new tokens, or a page it uses outside the cache. The
    kernels test the same on the device and give such a sequence NaN; this reads the lengths and
    the block table back (a device-to-host copy), for check=True and the PyTorch path."""
    lengths = cache_seqlens.tolist()
    rows = [None] * len(lengths) if block_table is None else block_table.tolist()
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    return [
        _fault(b, length, row, n_new, capacity, k_cache.shape[0], k_cache.shape[1])
        for b, (length, row) in enumerate(zip(lengths, rows, strict=True))
    ]


def _fault(b: int, length: int, row, n_new: int, capacity: int, num_pages: int, page: int) -> str | None:
    """Why sequence b (its length, and its block table row or None) cannot be used, or None."""
    if length < 0:
        return f"cache_seqlens: sequence {b} has length {length}, expected 0 or more"
    if length > capacity - n_new:
        return (
            f"cache_seqlens: sequence {b} needs {length + n_new} slots ({length} cached + {n_new} new), "
            f"the cache holds {capacity}"
        )
    bad = [] if row is None else [p for p in row[: -(-(length + n_new) // page)] if not 0 <= p < num_pages]
    if bad:
        return f"block_table: sequence {b} names pages {bad}, outside the cache's pages 0..{num_pages - 1}"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """What a decode call asks for, checked: q (batch, nq, heads, head_dim) over k_cache, v_cache
    (contiguous, or pages named by `block_table`) holding `cache_seqlens` tokens per sequence, new
    `k`, `v` to append first (or None); `scale` resolved; `return_lse`, whether the kernel writes
    the log-sum-exp; an e4m3 cache's `descales` (k_descale, v_descale; ones where None was
    given), else None."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    block_table: torch.Tensor | None
    causal: bool
    scale: float
    return_lse: bool
    strict: bool | None = None
    descales: tuple[torch.Tensor, torch.Tensor] | None = None
    local: Local = NONE

    @classmethod
    def checked(
        cls,
        q: object,
        k_cache: object,
        v_cache: object,
        cache_seqlens: object,
        *,
        k: object = None,
        v: object = None,
        block_table: object = None,
        causal: object = True,
        scale: object = None,
        return_lse: object = False,
        strict: bool | None = None,
        k_descale: object = None,
        v_descale: object = None,
        read_lengths: bool = False,
        window_size: object = (-1, -1),
        attention_chunk: object = 0,
        softcap: object = 0.0,
        sinks: object = None,
    ) -> DecodeCall:
        """`tunegen.decode_attention`'s call, checked (see `check_decode`); the features in their
        canonical form for this cache (its capacity bounds every sequence; a chunk stays unless
        causal, since a sequence may hold fewer keys than queries)."""
        check_decode(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k,
            v,
            block_table,
            read_lengths=read_lengths,
            k_descale=k_descale,
            v_descale=v_descale,
        )
        descales = None
        if k_cache.dtype == fp8.E4M3:
            ones = unit_descales(q.shape[0], k_cache.shape[2], q.device)
            descales = (ones if k_descale is None else k_descale, ones if v_descale is None else v_descale)
        resolved = checks.check_scale(scale, q.shape[-1])
        local = check_local(q, window_size, attention_chunk, softcap, sinks, heads_dim=2)
        mask = bool(causal)
        if local.any:
            capacity = (
                block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
            )
            mask, local = local.normalized(mask, q.shape[1], capacity, True)
        return cls(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k,
            v,
            block_table,
            mask,
            resolved,
            bool(return_lse),
            strict,
            descales,
            local,
        )

    def backend(self) -> str:
        """Which path serves the call (tunegen.backends.backend_for)."""
        return backend_for(self.q.device, self.strict)

    def problem(self) -> Problem:
        """The decode Problem; an e4m3 cache makes it an fp8 one (dtype stays the query's)."""
        q, k_cache, table = self.q, self.k_cache, self.block_table
        paged = table is not None
        return Problem.of(
            family="decode",
            dtype=DTYPE_NAMES[q.dtype],
            head_dim=q.shape[3],
            causal=self.causal,
            num_heads_q=q.shape[2],
            num_heads_kv=k_cache.shape[2],
            batch=q.shape[0],
            seqlen_q=q.shape[1],
            seqlen_k=table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1],
            paged=paged,
            page_size=k_cache.shape[1] if paged else 0,
            fp8=self.descales is not None,
            return_lse=self.return_lse,
            aligned=False,
            **self.local.key(),
        )

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fresh output (like q) and log-sum-exp ((batch, heads, nq) float32, or None unless kept)."""
        q = self.q
        lse = (
            torch.empty((q.shape[0], q.shape[2], q.shape[1]), device=q.device, dtype=torch.float32)
            if self.return_lse
            else None
        )
        return torch.empty_like(q), lse

    def args(self, out: torch.Tensor, lse: torch.Tensor | None) -> DecodeArgs:
        """The kernel's launch arguments, writing `out` and `lse`."""
        k_descale, v_descale = self.descales if self.descales is not None else (None, None)
        return DecodeArgs(
            self.q,
            self.k_cache,
            self.v_cache,
            self.cache_seqlens,
            out,
            lse,
            self.scale,
            self.block_table,
            self.k,
            self.v,
            k_descale,
            v_descale,
            self.local.softcap,
            self.local.sinks,
        )

    def fallback(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch path (`reference`), new tokens appended in place as the kernels do."""
        return reference(
            self.q,
            self.k_cache,
            self.v_cache,
            self.cache_seqlens,
            self.k,
            self.v,
            self.block_table,
            self.causal,
            self.scale,
            self.descales or (),
            self.local,
        )


def reference(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, descales=(), local=NONE):
    """The PyTorch path, with the kernels' promise: a sequence `_faults` names reads and writes
    nothing and gets NaN (output and log-sum-exp); every other one gets its new tokens written in
    place (quantized for an e4m3 cache, whose `descales` are (k_descale, v_descale)), then, once
    all are written as the kernels do, attends in float32 over its gathered keys (with `local`'s
    window, chunks, cap and sinks; a sequence with no key gets zeros and the sink's log-sum-exp)."""
    batch, nq = q.shape[0], q.shape[1]
    n_new = 0 if k is None else k.shape[1]
    if descales and k is not None:
        k, v = fp8.quantize_kv(k, descales[0]), fp8.quantize_kv(v, descales[1])
    lengths = cache_seqlens.tolist()
    faults = _faults(k_cache, cache_seqlens, block_table, n_new)
    slots = [
        None if fault else _slots(k_cache, block_table, b, n + n_new)
        for b, (n, fault) in enumerate(zip(lengths, faults, strict=True))
    ]
    for b, at in enumerate(slots):
        if at is not None and n_new:
            new = (at[0][lengths[b] :], at[1][lengths[b] :])
            k_cache[new] = k[b]
            v_cache[new] = v[b]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, q.shape[2], nq), float("-inf"), device=q.device)
    for b, at in enumerate(slots):
        if at is None:
            out[b], lse[b] = float("nan"), float("nan")
            continue
        if not len(at[0]):
            if local.sinks is not None:
                lse[b] = local.sinks.to(lse.dtype)[:, None]
            continue
        keys, values = k_cache[at].transpose(0, 1)[None], v_cache[at].transpose(0, 1)[None]
        if descales:
            keys = keys.float() * descales[0][b, None, :, None, None]
            values = values.float() * descales[1][b, None, :, None, None]
        o, s = attention_reference(
            q[b].transpose(0, 1)[None],
            keys,
            values,
            causal=causal,
            scale=scale,
            compute_dtype=torch.float32,
            **local.reference_args(),
        )
        out[b] = o[0].transpose(0, 1)
        lse[b] = s[0]
    return out.to(q.dtype), lse


def _slots(k_cache, block_table, b: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where sequence b's first `count` tokens lie in the cache, as index tensors (row, slot): its
    own row of a contiguous cache, or the pages its block table names (checked by `_faults`)."""
    positions = torch.arange(count, device=k_cache.device)
    if block_table is None:
        return torch.full_like(positions, b), positions
    page = k_cache.shape[1]
    return block_table[b, positions // page].long(), positions % page


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((1, 1), device=device, dtype=torch.float32)


def unit_descales(batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """The descales None stands for: read only, so one float of each device serves every call,
    expanded (strides 0) to (batch, kv_heads)."""
    return _one(device).expand(batch, kv_heads)
