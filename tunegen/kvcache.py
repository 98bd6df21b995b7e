"""KVCache: a preallocated key/value cache for model code, contiguous or paged, that
`tunegen.decode_attention` reads in place. It never grows by concatenation: a contiguous cache
holds `capacity` slots per sequence; a paged cache hands out fixed-size pages from a pool as
sequences grow and takes them back on reset. An FP8 cache (dtype float8_e4m3fn) stores half the
bytes of bf16, with one descale per (layer, sequence, KV head) set from each sequence's first
append and applied by the kernels."""

from __future__ import annotations

import dataclasses

import torch

from tunegen.decode import check_decode, decode_attention
from tunegen.kernels import fp8

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
    Paged: (layers, num_pages, page_size, kv_heads, head_dim), with a block table per sequence
    and pages given out as sequences grow (`num_pages` defaults to enough for every sequence
    to reach `capacity`). Every layer of a sequence grows together: attend each layer, then
    `advance` once per step.

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
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.batch, self.capacity, self.num_layers = batch, capacity, num_layers
        self.page_size = page_size
        self._lengths = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        if page_size is None:
            shape = (num_layers, batch, capacity, kv_heads, head_dim)
            self.block_table = None
        else:
            if not isinstance(page_size, int) or page_size < 16 or page_size % 16:
                raise ValueError(f"page_size: expected a multiple of 16, got {page_size!r}")
            pages_per_seq = -(-capacity // page_size)
            num_pages = num_pages if num_pages is not None else batch * pages_per_seq
            if num_pages < 1:
                raise ValueError(f"num_pages: expected a positive int, got {num_pages!r}")
            shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
            self.block_table = torch.zeros(batch, pages_per_seq, dtype=torch.int32, device=device)
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
        for b, length in enumerate(self._lengths):
            if length + new_tokens > self.capacity:
                raise ValueError(
                    f"new_tokens: sequence {b} would hold {length + new_tokens} tokens, "
                    f"capacity is {self.capacity}"
                )
        if self.block_table is None:
            return
        changed = False
        for b, length in enumerate(self._lengths):
            need = -(-(length + new_tokens) // self.page_size) - len(self._pages[b])
            if need > len(self._free):
                raise ValueError(
                    f"new_tokens: the page pool is exhausted ({len(self._free)} free, {need} needed)"
                )
            for _ in range(need):
                self._pages[b].append(self._free.pop())
                changed = True
        if changed:
            table = [pages + [0] * (self.block_table.shape[1] - len(pages)) for pages in self._pages]
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
    ) -> torch.Tensor:
        """Decode attention for `layer`: writes `k`/`v` (batch, new, kv_heads, head_dim) after each
        sequence's cached tokens, then attends q (batch, nq, heads, head_dim) over them."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 to {self.num_layers - 1}, got {layer}")
        if k is not None:
            self.reserve(k.shape[1])
        descales = {}
        if self.fp8:
            fresh = [b for b, n in enumerate(self._lengths) if n == 0]
            if fresh and k is not None:
                check_decode(
                    q, self.k[layer], self.v[layer], self.seqlens, k, v, self.block_table, read_lengths=False
                )
                rows = torch.tensor(fresh, device=self.k_descale.device)
                self.k_descale[layer, rows] = fp8.calibrate_kv(k[rows], FP8_HEADROOM)
                self.v_descale[layer, rows] = fp8.calibrate_kv(v[rows], FP8_HEADROOM)
            descales = {"k_descale": self.k_descale[layer], "v_descale": self.v_descale[layer]}
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
        )

    def advance(self, new_tokens: int) -> None:
        """Count `new_tokens` more per sequence, once every layer has written them."""
        if any(n + new_tokens > self.capacity for n in self._lengths):
            raise ValueError(f"new_tokens: {new_tokens} more would pass the capacity {self.capacity}")
        self._lengths = [n + new_tokens for n in self._lengths]
        self.seqlens += new_tokens

    def reset(self, sequence: int | None = None) -> None:
        """Empty one sequence (or all), returning its pages to the pool."""
        for b in range(self.batch) if sequence is None else [sequence]:
            self._lengths[b] = 0
            if self.block_table is not None:
                self._free.extend(reversed(self._pages[b]))
                self._pages[b] = []
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
