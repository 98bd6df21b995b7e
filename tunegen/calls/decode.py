"""A checked call of the decode family: `tunegen.decode_attention` (and `KVCache.attention`), in
FlashAttention's `flash_attn_with_kvcache` conventions, as every path that serves one sees it: the
Problem key, the outputs, the kernel's launch arguments and the PyTorch path (the checks are in
`decode_checks`)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from tunegen import checks
from tunegen.backends import backend_for
from tunegen.calls.decode_checks import check_decode, faults, used_from
from tunegen.calls.local import NONE, Local, check_local
from tunegen.kernels import fp8
from tunegen.kernels.launch_args import DecodeArgs
from tunegen.kernels.problem import DTYPE_NAMES, Problem
from tunegen.kernels.reference import attention_reference


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
        inputs = (q, k_cache, v_cache, cache_seqlens, k, v, block_table)
        check_decode(*inputs, read_lengths=False, k_descale=k_descale, v_descale=v_descale)
        descales = None
        if k_cache.dtype == fp8.E4M3:
            ones = unit_descales(q.shape[0], k_cache.shape[2], q.device)
            descales = (ones if k_descale is None else k_descale, ones if v_descale is None else v_descale)
        resolved = checks.check_scale(scale, q.shape[-1])
        local = check_local(
            q, window_size, attention_chunk, softcap, sinks, heads_dim=2, differentiable=False
        )
        mask = bool(causal)
        if local.any:
            capacity = (
                block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
            )
            mask, local = local.normalized(mask, q.shape[1], capacity, True)
        if read_lengths:  # pages before a window's first key are unused: checked with the features
            check_decode(*inputs, read_lengths=True, k_descale=k_descale, v_descale=v_descale, local=local)
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
    """The PyTorch path, with the kernels' promise: a sequence `faults` names reads and writes
    nothing and gets NaN (output and log-sum-exp); every other one gets its new tokens written in
    place (quantized for an e4m3 cache, whose `descales` are (k_descale, v_descale)), then, once
    all are written as the kernels do, attends in float32 over its gathered keys (with `local`'s
    window, chunks, cap and sinks; a sequence with no key gets zeros and the sink's log-sum-exp)."""
    batch, nq = q.shape[0], q.shape[1]
    n_new = 0 if k is None else k.shape[1]
    if descales and k is not None:
        k, v = fp8.quantize_kv(k, descales[0]), fp8.quantize_kv(v, descales[1])
    lengths = cache_seqlens.tolist()
    faulty = faults(k_cache, cache_seqlens, block_table, n_new, local, nq)
    used = [used_from(local, n, n_new, nq) for n in lengths]
    slots = [
        None if fault else _slots(k_cache, block_table, b, n + n_new, used[b])
        for b, (n, fault) in enumerate(zip(lengths, faulty, strict=True))
    ]
    for b, at in enumerate(slots):
        if at is not None and n_new:
            new = (at[0][lengths[b] - used[b] :], at[1][lengths[b] - used[b] :])
            k_cache[new] = k[b]
            v_cache[new] = v[b]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, q.shape[2], nq), float("-inf"), device=q.device)
    for b, at in enumerate(slots):
        if at is None:
            out[b], lse[b] = float("nan"), float("nan")
            continue
        if not len(at[0]) and not used[b]:
            if local.sinks is not None:
                lse[b] = local.sinks.to(lse.dtype)[:, None]
            continue
        # Keys before the used slots hold zeros (no row sees them; their pages may be free).
        unused = (used[b], *k_cache.shape[2:])
        keys, values = (
            torch.cat([c.new_zeros(unused), c[at]]).transpose(0, 1)[None] for c in (k_cache, v_cache)
        )
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


def _slots(k_cache, block_table, b: int, count: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Where sequence b's tokens `start` to `count` lie in the cache, as index tensors (row, slot):
    its own row of a contiguous cache, or the pages its block table names (checked by `faults`)."""
    positions = torch.arange(start, count, device=k_cache.device)
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
