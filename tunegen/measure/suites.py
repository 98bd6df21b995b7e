"""The benchmark suites: the FlashAttention papers' prefill shapes (as SDPA-style Shapes, and as
backward Problems), and one-token decode Problems over bf16 and FP8 caches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tunegen.kernels.problem import Problem


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark case in SDPA's (batch, heads, seqlen, head_dim) terms."""

    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def flops(self) -> float:
        """Forward FLOPs at this Shape's exact sizes (its Problem holds their buckets)."""
        return self.problem("bfloat16").flops(self.seqlen, self.seqlen, self.batch)

    def problem(self, dtype: str) -> Problem:
        return Problem.of(
            family="prefill",
            dtype=dtype,
            head_dim=self.head_dim,
            causal=self.causal,
            num_heads_q=self.heads,
            num_heads_kv=self.kv_heads,
            batch=self.batch,
            seqlen_q=self.seqlen,
            seqlen_k=self.seqlen,
        )


def prefill_suite(
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    tokens: int = 16384,
    hidden: int = 2048,
    kv_heads: int | None = None,
) -> list[Shape]:
    """The FlashAttention papers' suite: `tokens` per batch (B = tokens / N), `hidden` = H · D."""
    shapes = []
    for d in head_dims:
        for c in causal:
            for n in seqlens:
                heads = hidden // d
                shapes.append(Shape(max(1, tokens // n), heads, kv_heads or heads, n, d, c))
    return shapes


def backward_suite(
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    tokens: int = 16384,
    hidden: int = 2048,
    kv_heads: int | None = None,
    dtype: str = "bfloat16",
) -> list[Problem]:
    """The prefill suite's shapes as backward Problems, for `bench_cases` (TFLOP/s counted as 2.5
    times the forward's FLOPs; peers: the SDPA backends' backward and FlexAttention's)."""
    shapes = prefill_suite(seqlens, head_dims, causal, tokens, hidden, kv_heads)
    return [dataclasses.replace(s.problem(dtype), family="backward") for s in shapes]


def decode_suite(
    batches: Sequence[int] = (1, 16, 64),
    cache_lengths: Sequence[int] = (4096, 32768),
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_sizes: Sequence[int] = (0, 64),
    dtype: str = "bfloat16",
) -> list[Problem]:
    """One-token decode Problems: each batch, cache length and layout (page size 0: contiguous)."""
    return [
        Problem.of(
            family="decode",
            dtype=dtype,
            head_dim=head_dim,
            causal=True,
            num_heads_q=heads,
            num_heads_kv=kv_heads,
            batch=b,
            seqlen_q=1,
            seqlen_k=n,
            paged=page > 0,
            page_size=page,
        )
        for b in batches
        for n in cache_lengths
        for page in page_sizes
    ]


def fp8_decode_suite(
    batches: Sequence[int] = (1, 16, 64),
    cache_lengths: Sequence[int] = (4096, 32768),
    page_sizes: Sequence[int] = (0, 64),
) -> list[Problem]:
    """`decode_suite`'s Problems (Llama-3 8B's heads) over a bf16 cache, each followed by the same
    over an FP8 cache."""
    return [
        p
        for base in decode_suite(batches, cache_lengths, page_sizes=page_sizes)
        for p in (base, dataclasses.replace(base, fp8=True))
    ]
