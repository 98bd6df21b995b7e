"""The benchmark suites: the FlashAttention papers' prefill shapes (as SDPA-style Shapes, and as
backward Problems), and one-token decode Problems over bf16 and FP8 caches; either with the
attention of current models (window, chunks, cap, sinks) where asked."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tunegen.kernels.masks import normalize_local
from tunegen.kernels.problem import Problem


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark case in SDPA's (batch, heads, seqlen, head_dim) terms, with the attention of
    current models in FlashAttention's conventions (tunegen.kernels.masks), canonical (`featured`):
    a window of `window_left` keys before each row and `window_right` after (-1: unbounded), chunks
    of `attention_chunk` keys (0: none), the logit cap `softcap` (0: none), and `sinks`, whether
    one random logit per query head joins each row's softmax."""

    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    window_left: int = -1
    window_right: int = -1
    attention_chunk: int = 0
    softcap: float = 0.0
    sinks: bool = False

    def featured(
        self,
        window_size: tuple[int, int] = (-1, -1),
        attention_chunk: int = 0,
        softcap: float = 0.0,
        sinks: bool = False,
    ) -> Shape:
        """This shape with the features, the mask in its canonical form (`normalize_local`: a
        window wider than the sequence is dropped, a right side of 0 is causal), as tunegen
        dispatches it."""
        causal, left, right, chunk = normalize_local(
            self.causal, *window_size, attention_chunk, self.seqlen, self.seqlen
        )
        return dataclasses.replace(
            self,
            causal=causal,
            window_left=left,
            window_right=right,
            attention_chunk=chunk,
            softcap=float(softcap),
            sinks=sinks,
        )

    @property
    def features(self) -> dict[str, object]:
        """The features off their defaults, by the public calls' names (empty: a plain shape)."""
        named = {
            "window_size": (self.window_left, self.window_right),
            "attention_chunk": self.attention_chunk,
            "softcap": self.softcap,
            "sinks": self.sinks,
        }
        plain = {"window_size": (-1, -1), "attention_chunk": 0, "softcap": 0.0, "sinks": False}
        return {name: value for name, value in named.items() if value != plain[name]}

    def call_args(self, sinks: torch.Tensor | None) -> dict[str, object]:
        """`features` as `tunegen.attention`, the peers and the reference take them, `sinks` the
        tensor (heads,) drawn for this shape. Only those off their defaults: a plain shape's call
        is the plain call, with its fast path."""
        args = dict(self.features)
        if self.sinks:
            args["sinks"] = sinks
        return args

    def flops(self) -> float:
        """Forward FLOPs at this Shape's exact sizes (its Problem holds their buckets), counted on
        the (row, key) pairs attended: a window or chunk counts what it leaves, exactly."""
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
            window_left=self.window_left,
            window_right=self.window_right,
            attention_chunk=self.attention_chunk,
            softcap=self.softcap > 0,
            sinks=self.sinks,
        )


def prefill_suite(
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    tokens: int = 16384,
    hidden: int = 2048,
    kv_heads: int | None = None,
    **features: Any,
) -> list[Shape]:
    """The FlashAttention papers' suite: `tokens` per batch (B = tokens / N), `hidden` = H · D;
    `features` (`Shape.featured`'s arguments) apply to every shape, and shapes they make alike
    (a right side of 0 makes both masks causal) appear once."""
    shapes = []
    for d in head_dims:
        for c in causal:
            for n in seqlens:
                heads = hidden // d
                shapes.append(
                    Shape(max(1, tokens // n), heads, kv_heads or heads, n, d, c).featured(**features)
                )
    return list(dict.fromkeys(shapes))


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
    window_size: tuple[int, int] = (-1, -1),
) -> list[Problem]:
    """One-token decode Problems: each batch, cache length and layout (page size 0: contiguous),
    with a sliding `window_size` (FlashAttention's; canonical at the cache the case builds, the
    length's bucket, so a window that holds the whole cache is the plain Problem)."""
    problems = []
    for b in batches:
        for n in cache_lengths:
            for page in page_sizes:
                plain = Problem.of(
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
                _, left, right, _ = normalize_local(True, *window_size, 0, 1, plain.seqlen_k)
                problems.append(dataclasses.replace(plain, window_left=left, window_right=right))
    return problems


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
