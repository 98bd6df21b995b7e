"""Problem: what a caller asks for, as a hashable key.

A Problem holds the features that change the kernel's code (rendered away by the template)
and the sizes in buckets, so that nearby shapes share a Winner.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from tunegen.kernels import masks

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def bucket(n: int, floor: int = 16) -> int:
    """The size bucket of `n`: the next power of two, at least `floor` (16 for sequence lengths,
    1 for batch sizes); 0 stays 0."""
    if n <= 0:
        return 0
    return max(floor, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Problem:
    """The key under which a family's Winners are stored and looked up."""

    family: str
    dtype: str
    head_dim: int
    causal: bool
    num_heads_q: int
    num_heads_kv: int
    batch: int
    seqlen_q: int
    seqlen_k: int
    varlen: bool = False
    paged: bool = False
    page_size: int = 0
    # float8 e4m3 operands with float32 descales (prefill: q, k, v; decode: the KV cache); dtype
    # is then the output's (prefill: bfloat16) or the query's (decode).
    fp8: bool = False
    return_lse: bool = False
    aligned: bool = True
    # The attention of current models, in FlashAttention's conventions and exact (they set the work
    # and the best tiles): a window of `window_left` keys before each row's position and
    # `window_right` after it (-1: unbounded; the right side stays -1 under causal), chunks of
    # `attention_chunk` keys (0: none); whether scores are capped by tanh (the cap is an argument,
    # as the scale is) and whether one sink logit per query head joins the softmax.
    window_left: int = -1
    window_right: int = -1
    attention_chunk: int = 0
    softcap: bool = False
    sinks: bool = False

    @classmethod
    def of(cls, *, family: str, batch: int, seqlen_q: int, seqlen_k: int, **features: Any) -> Problem:
        """The Problem of a call with these exact sizes: batch and lengths in their buckets, but for
        decode's few query tokens, which change its code and stay exact."""
        return cls(
            family=family,
            batch=bucket(batch, floor=1),
            seqlen_q=seqlen_q if family == "decode" else bucket(seqlen_q),
            seqlen_k=bucket(seqlen_k),
            **features,
        )

    @property
    def group(self) -> int:
        """Query heads per KV head (1 for MHA, num_heads_q for MQA)."""
        return self.num_heads_q // self.num_heads_kv

    @property
    def local(self) -> bool:
        """Whether each row sees only a window or chunk of the keys."""
        return self.window_left >= 0 or self.window_right >= 0 or self.attention_chunk > 0

    @property
    def model_features(self) -> dict[str, Any]:
        """The features of current models this Problem asks for: `MODEL_FEATURES`'s fields off
        their defaults."""
        return {
            name: getattr(self, name) for name, off in MODEL_FEATURES.items() if getattr(self, name) != off
        }

    def as_dict(self) -> dict[str, Any]:
        """Every field but `MODEL_FEATURES`'s at their defaults: Problems stored before those
        fields existed keep their keys, and serve as before."""
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if k not in MODEL_FEATURES or v != MODEL_FEATURES[k]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    def flops(
        self, seqlen_q: int | None = None, seqlen_k: int | None = None, batch: int | None = None
    ) -> float:
        """Forward FLOPs as the FlashAttention papers count them: 4·B·H·Nq·Nk·D, halved for causal;
        under a window or chunk, 4·B·H·D per (row, key) pair attended.

        Exact sizes can be passed in place of the buckets.
        """
        nq = self.seqlen_q if seqlen_q is None else seqlen_q
        nk = self.seqlen_k if seqlen_k is None else seqlen_k
        b = self.batch if batch is None else batch
        per_pair = 4.0 * b * self.num_heads_q * self.head_dim
        if self.local:  # the pairs a window or chunk leaves, counted exactly
            sides = {"left": self.window_left, "right": self.window_right, "chunk": self.attention_chunk}
            return per_pair * masks.attended_pairs(nq, nk, causal=self.causal, **sides)
        return per_pair * nq * nk / (2 if self.causal else 1)


# The fields of current models' attention, each at the value that leaves a Problem as it was.
MODEL_FEATURES: dict[str, Any] = {
    "window_left": -1,
    "window_right": -1,
    "attention_chunk": 0,
    "softcap": False,
    "sinks": False,
}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_text(problem: dict) -> str:
    """What a Problem computes in: its dtype, or for FP8 Problems what is FP8 and what is not."""
    dtype = str(problem.get("dtype"))
    if not problem.get("fp8"):
        return dtype
    if problem.get("family") == "decode":
        return f"{dtype} over an fp8 e4m3 KV cache"
    return f"fp8 e4m3 inputs, {SHORT.get(dtype, dtype)} output"


def problem_text(problem: dict) -> str:
    """A Problem (its `as_dict()`, or a Winner's record of it) on one line, as commands print it."""
    heads = f"{problem.get('num_heads_q')}/{problem.get('num_heads_kv')}"
    flags = [name for name in ("causal", "varlen", "paged", "return_lse") if problem.get(name)]
    left, right = problem.get("window_left", -1), problem.get("window_right", -1)
    if left != -1 or right != -1:
        flags.append(f"window({left},{right})")
    if problem.get("attention_chunk"):
        flags.append(f"chunk {problem['attention_chunk']}")
    flags += [name for name in ("softcap", "sinks") if problem.get(name)]
    sizes = f"B{problem.get('batch')} {problem.get('seqlen_q')}x{problem.get('seqlen_k')}"
    return f"{dtype_text(problem)} D{problem.get('head_dim')} H{heads} {sizes} {' '.join(flags)}".strip()
