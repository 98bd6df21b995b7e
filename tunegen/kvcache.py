"""KVCache: a preallocated key/value cache for model code, contiguous or paged, that
`tunegen.decode_attention` reads in place. It never grows by concatenation: a contiguous cache
holds `capacity` slots per sequence; a paged cache hands out fixed-size pages from a pool as
sequences grow and takes them back on reset. An FP8 cache (dtype float8_e4m3fn) stores half the
bytes of bf16, with one descale per (layer, sequence, KV head) set from each sequence's first
append and applied by the kernels."""

from __future__ import annotations

import dataclasses

import torch

from tunegen import checks
from tunegen.calls.decode_checks import check_decode
from tunegen.calls.local import NO_WINDOW, check_local
from tunegen.decode import decode_attention
from tunegen.kernels import fp8
from tunegen.kernels.problem import DTYPE_NAMES

# An FP8 cache's scales let values reach this multiple of the largest magnitude in a sequence's
# first append before they saturate at e4m3's ±448.
FP8_HEADROOM = 2.0


@dataclasses.dataclass(frozen=True)
class CacheMemory:
    """Bytes the cache holds, bytes its tokens fill, and (paged) its pages."""

    allocated_bytes: int
    used_bytes: int
    tokens: int
    pages_used: int | None = None
    pages_free: int | None = None


class KVCache:
    """Keys and values of `num_layers` layers for `batch` sequences.

    Contiguous (page_size None): (layers, batch, capacity, kv_heads, head_dim) per tensor.
    Paged: (layers, num_pages, page_size, kv_heads, head_dim), page_size any multiple of 16, with
    a block table row per sequence (-1 past its pages) and pages given out as sequences grow
    (`num_pages` defaults to enough for every sequence to reach `capacity`). Every layer of a
    sequence grows together: attend each layer, then `advance` once per step.

    dtype float8_e4m3fn makes an FP8 cache: queries and new tokens stay 16-bit, the cache holds
    e4m3 values and `k_descale`/`v_descale` (layers, batch, kv_heads) float32. A sequence's first
    append (after creation or `reset`) sets its descales so that FP8_HEADROOM times the largest
    magnitude of those tokens per head maps to 448; later tokens are quantized with them.
    """

    def __init__(
        self,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        *,
        num_layers: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        page_size: int | None = None,
        num_pages: int | None = None,
    ) -> None:
        for name, value in (
            ("batch", batch),
            ("capacity", capacity),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("num_layers", num_layers),
        ):
            _count(name, value, 1)
        if dtype not in (*DTYPE_NAMES, fp8.E4M3):
            raise ValueError(f"dtype: expected float16, bfloat16, float32 or float8_e4m3fn, got {dtype}")
        self.batch, self.capacity, self.num_layers = batch, capacity, num_layers
        self.page_size = page_size
        self._lengths = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        if page_size is None:
            if num_pages is not None:
                raise ValueError(f"num_pages: applies to a paged cache (give page_size), got {num_pages!r}")
            shape = (num_layers, batch, capacity, kv_heads, head_dim)
            self.block_table = None
        else:
            if not _is_int(page_size) or page_size < 16 or page_size % 16:
                raise ValueError(f"page_size: expected a positive multiple of 16, got {page_size!r}")
            pages_per_seq = -(-capacity // page_size)
            num_pages = _count("num_pages", batch * pages_per_seq if num_pages is None else num_pages, 1)
            shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
            # Entries past a sequence's pages name no page (-1): a length beyond them reads NaN,
            # never another sequence's page.
            self.block_table = torch.full((batch, pages_per_seq), -1, dtype=torch.int32, device=device)
            self._pages: list[list[int]] = [[] for _ in range(batch)]
            self._free = list(range(num_pages - 1, -1, -1))
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.fp8 = dtype == fp8.E4M3
        if self.fp8:
            self.k_descale = torch.ones((num_layers, batch, kv_heads), dtype=torch.float32, device=device)
            self.v_descale = torch.ones_like(self.k_descale)

    def lengths(self) -> list[int]:
        """Tokens cached per sequence (kept on the host: no device read)."""
        return list(self._lengths)

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more per sequence (pages are taken from the pool)."""
        self._take(self._pages_needed(_count("new_tokens", new_tokens, 0), "new_tokens"))

    def _pages_needed(self, new_tokens: int, name: str) -> list[int]:
        """Pages each sequence lacks for `new_tokens` more (contiguous: none); a ValueError naming
        `name` if a sequence would pass the capacity or the pool holds too few, before any change."""
        for b, length in enumerate(self._lengths):
            if length + new_tokens > self.capacity:
                raise ValueError(
                    f"{name}: sequence {b} would hold {length + new_tokens} tokens, "
                    f"capacity is {self.capacity}"
                )
        if self.block_table is None:
            return []
        needs = [
            max(0, -(-(length + new_tokens) // self.page_size) - len(pages))
            for length, pages in zip(self._lengths, self._pages, strict=True)
        ]
        if sum(needs) > len(self._free):
            raise ValueError(
                f"{name}: the page pool is exhausted ({len(self._free)} free, {sum(needs)} needed)"
            )
        return needs

    def _take(self, needs: list[int]) -> None:
        """Give each sequence the pages `_pages_needed` counted, and write the block table."""
        if not any(needs):
            return
        for pages, need in zip(self._pages, needs, strict=True):
            pages.extend(self._free.pop() for _ in range(need))
        self._write_table()

    def _write_table(self) -> None:
        width = self.block_table.shape[1]
        table = [pages + [-1] * (width - len(pages)) for pages in self._pages]
        self.block_table.copy_(torch.tensor(table, dtype=torch.int32))

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        causal: bool = True,
        scale: float | None = None,
        window_size: tuple[int, int] = NO_WINDOW,
        attention_chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention for `layer`: writes `k`/`v` (batch, new, kv_heads, head_dim) after each
        sequence's cached tokens, then attends q (batch, nq, heads, head_dim) over them, with the
        layer's window, chunks, cap and sinks as `tunegen.decode_attention` takes them. A call
        refused changes nothing: the arguments are checked before pages are taken or (FP8) the
        descales set."""
        if not (_is_int(layer) and 0 <= layer < self.num_layers):
            raise ValueError(f"layer: expected an int from 0 to {self.num_layers - 1}, got {layer!r}")
        local = {
            "window_size": window_size,
            "attention_chunk": attention_chunk,
            "softcap": softcap,
            "sinks": sinks,
        }
        checks.tensor_arg("q", q, 4, "(batch, nq, heads, head_dim)")
        checks.check_scale(scale, q.shape[-1])
        check_local(q, **local, heads_dim=2, differentiable=False)
        descales = {}
        if self.fp8:
            descales = {"k_descale": self.k_descale[layer], "v_descale": self.v_descale[layer]}
        if k is not None:
            new = checks.tensor_arg("k", k, 4, "(batch, new_tokens, kv_heads, head_dim)").shape[1]
            needs = self._pages_needed(new, "k")
            fresh = [b for b, n in enumerate(self._lengths) if n == 0] if self.fp8 else []
            if any(needs) or fresh:
                check_decode(
                    q, self.k[layer], self.v[layer], self.seqlens, k, v, self.block_table, read_lengths=False
                )
            self._take(needs)
            if fresh:
                rows = torch.tensor(fresh, device=self.k_descale.device)
                self.k_descale[layer, rows] = fp8.calibrate_kv(k[rows], FP8_HEADROOM)
                self.v_descale[layer, rows] = fp8.calibrate_kv(v[rows], FP8_HEADROOM)
        return decode_attention(
            q,
            self.k[layer],
            self.v[layer],
            self.seqlens,
            k=k,
            v=v,
            block_table=self.block_table,
            causal=causal,
            scale=scale,
            **descales,
            **local,
        )

    def advance(self, new_tokens: int) -> None:
        """Count `new_tokens` more per sequence, once every layer has written them (taking the
        pages they lie in if `attend` or `reserve` has not)."""
        self.reserve(new_tokens)
        self._lengths = [n + new_tokens for n in self._lengths]
        self.seqlens += new_tokens

    def reset(self, sequence: int | None = None) -> None:
        """Empty one sequence (or all), returning its pages to the pool."""
        if sequence is not None and not (_is_int(sequence) and 0 <= sequence < self.batch):
            raise ValueError(
                f"sequence: expected None or an int from 0 to {self.batch - 1}, got {sequence!r}"
            )
        for b in range(self.batch) if sequence is None else [sequence]:
            self._lengths[b] = 0
            if self.block_table is not None:
                self._free.extend(reversed(self._pages[b]))
                self._pages[b] = []
        if self.block_table is not None:
            self._write_table()
        self.seqlens.copy_(torch.tensor(self._lengths, dtype=torch.int32))

    def memory(self) -> CacheMemory:
        """What the cache holds and what its tokens use."""
        per_token = 2 * self.num_layers * self.k.shape[-2] * self.k.shape[-1] * self.k.element_size()
        tokens = sum(self._lengths)
        allocated = 2 * self.k.numel() * self.k.element_size()
        if self.fp8:
            allocated += 2 * self.k_descale.numel() * self.k_descale.element_size()
        if self.block_table is None:
            return CacheMemory(allocated, tokens * per_token, tokens)
        used = sum(len(p) for p in self._pages)
        return CacheMemory(allocated, tokens * per_token, tokens, used, len(self._free))


def _count(name: str, value: object, least: int) -> int:
    """`value` if it is an int (not a bool) of at least `least`, else a ValueError naming `name`."""
    if not _is_int(value) or value < least:
        expected = "a positive int" if least == 1 else f"an int of at least {least}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
