"""The decode family: a few query tokens per sequence against a KV cache (contiguous or paged),
split over the cache with an exact combine, query heads of a KV head packed into one tile."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunegen.kernels import masks
from tunegen.kernels.families.operands import block_d, dot_precision
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import MODEL_FEATURES, Problem
from tunegen.kernels.variant import Variant


@dataclasses.dataclass(frozen=True)
class DecodeVariant(Variant):
    """Knobs of templates/attention_decode.py.j2.

    block_n: key tile; num_splits: programs per (sequence, head unit) over the cache, merged by
    the combine kernel (1: no combine); pack_gqa: one tile holds every query head of a KV head.
    """

    family: ClassVar[str] = "decode"

    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = True

    def __post_init__(self) -> None:
        if self.block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_n: expected a power of two from 16 to 256, got {self.block_n}")
        if not 1 <= self.num_splits <= 128:
            raise ValueError(f"num_splits: expected 1 to 128, got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1 to 8, got {self.num_stages}")


def key_tile(page_size: int, usual: int) -> int:
    """The key tile for a cache of `page_size` (0: contiguous): the largest power of two up to
    `usual` that divides the page, since a tile must lie in one page (16 at least, for a page
    that is a multiple of 16: 48, 80 or 208 take 16, 96 takes 32)."""
    tile = usual
    while page_size % tile:
        tile //= 2
    return tile


class DecodeFamily:
    name = "decode"
    model_features: ClassVar[frozenset[str]] = frozenset(MODEL_FEATURES)
    fp8_model_features: ClassVar[frozenset[str]] = frozenset(MODEL_FEATURES)  # an FP8 cache's too
    template = "attention_decode.py.j2"
    variant_type = DecodeVariant
    conditions: ClassVar[dict[str, tuple[str, tuple]]] = {}

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        return {
            "head_dim": problem.head_dim,
            "block_d": block_d(problem.head_dim),
            "causal": problem.causal,
            "group": problem.group,
            "nq": problem.seqlen_q,
            "paged": problem.paged,
            "page_size": problem.page_size,
            "return_lse": problem.return_lse,
            "upcast": gpu.backend == "interpreter" and problem.dtype == "bfloat16",
            "precision": dot_precision(problem),
            "fp8": problem.fp8,
            "emulate_fp8": gpu.backend == "interpreter" and problem.fp8,
            "window_left": problem.window_left,
            "window_right": problem.window_right,
            "attention_chunk": problem.attention_chunk,
            "softcap": problem.softcap,
            "sinks": problem.sinks,
        }

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        if not isinstance(variant, DecodeVariant):
            raise ValueError(f"variant: expected a DecodeVariant, got {type(variant).__name__}")
        if problem.fp8 and gpu.backend == "cuda" and gpu.capability < (8, 9):
            raise ValueError(
                f"problem.fp8: e4m3 caches need compute capability 8.9 or newer, "
                f"{gpu.name} has {gpu.capability}"
            )
        if problem.paged and (problem.page_size < 16 or problem.page_size % 16):
            raise ValueError(
                f"problem.page_size: expected a positive multiple of 16, got {problem.page_size}"
            )
        if problem.paged and problem.page_size % variant.block_n:
            raise ValueError(
                f"variant.block_n: {variant.block_n} must divide the page size {problem.page_size} "
                "(a tile lies in one page)"
            )

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        tiles = [16, 32] if gpu.arch == "interpreter" else [32, 64, 128]
        if problem.paged:
            page = problem.page_size
            tiles = [t for t in tiles if page % t == 0] or [key_tile(page, tiles[0])]
        return {
            "block_n": tiles,
            "num_splits": [1, 2, 4] if gpu.arch == "interpreter" else [1, 2, 4, 8, 16, 32],
            "num_warps": [4] if gpu.arch == "interpreter" else [2, 4, 8],
            "num_stages": [1] if gpu.arch == "interpreter" else [2, 3, 4],
            "pack_gqa": [True, False] if problem.group > 1 else [True],
        }

    def constraint(self, variant: Variant, problem: Problem, gpu: Gpu) -> str | None:
        try:
            self.check_variant(variant, problem, gpu)
        except ValueError as exc:
            return str(exc)
        return None

    def default_variant(self, problem: Problem, gpu: Gpu) -> DecodeVariant:
        """Enough programs to fill the GPU once: split the cache until batch x KV heads x splits
        covers the SMs (flash-decoding's rule, at one wave rather than two), within the cache's
        tiles; paged caches take at least two splits (each tile waits on a block-table read, and
        more programs in flight hide it); three pipeline stages. Measured on an H100 over `tunegen
        bench decode`'s Problems (benchmarks/results/decode_defaults_h100.md): 0.95 to 1.00 of
        the best Variant of the sweep, where two waves and two stages gave 0.90 to 1.00. Key tiles
        of 64 (32 interpreted), or the largest power of two below that divides the page.

        A contiguous cache under a window or chunk, where each split reads a share of the window
        only, takes fewer, longer programs: key tiles of 128 and splits only while the programs
        stay within one wave. On an H100 at a 32k cache with a window of 4096
        (benchmarks/results/issue32_decode_window_defaults_h100.json), 0.98 to 1.00 of the
        sweep's best Variant at batches 1, 8 and 32, where the whole-cache rule gave 0.94 to 1.00;
        a paged one at batch 8 lost 12% that way (issue32_h100.md), and keeps the rule."""
        interpreted = gpu.arch == "interpreter"
        # The kernel skips the keys before a window's left side or a chunk (not a right side).
        windowed = (problem.window_left >= 0 or problem.attention_chunk > 0) and not problem.paged
        block_n = key_tile(problem.page_size, 32 if interpreted else 128 if windowed else 64)
        units = problem.batch * problem.num_heads_kv
        tiles = max(1, (_keys_seen(problem) if windowed else problem.seqlen_k) // block_n)
        splits = 2 if problem.paged and tiles >= 2 else 1
        # Doubled while the programs stay short of the SMs, or for `windowed` within one wave.
        most = gpu.sm_count // 2 if windowed else gpu.sm_count - 1
        while units * splits <= most and splits * 2 <= min(32, tiles):
            splits *= 2
        return DecodeVariant(
            block_n=block_n, num_splits=splits, num_warps=4, num_stages=1 if interpreted else 3, pack_gqa=True
        )

    def deterministic(self, variant: DecodeVariant, problem: Problem, gpu: Gpu) -> DecodeVariant:
        """Every decode Variant gives the same bits on every run: a split cache's partial results
        are merged by one program, all splits at once, in a fixed order."""
        return variant

    def measure(self, problem: Problem) -> tuple[str, float]:
        """Bytes of K and V read: the keys and values of each cached token some query row sees
        (all of them, or a window's or chunk's: the kernel reads no other page), once."""
        size = 1 if problem.fp8 else {"float16": 2, "bfloat16": 2, "float32": 4}[problem.dtype]
        keys = _keys_seen(problem)
        return "GB/s", 2.0 * problem.batch * keys * problem.num_heads_kv * problem.head_dim * size

    def case(self, problem: Problem, kernel: Any, device: Any, seed: int) -> Any:
        from tunegen.kernels.families.decode_case import decode_case

        return decode_case(problem, kernel, device, seed)


def _keys_seen(problem: Problem) -> int:
    """How many of a sequence's cached keys some query row sees: all, or a window's or chunk's."""
    if not problem.local:
        return problem.seqlen_k
    sides = {"left": problem.window_left, "right": problem.window_right, "chunk": problem.attention_chunk}
    return masks.keys_seen(problem.seqlen_q, problem.seqlen_k, causal=problem.causal, **sides)


FAMILY = DecodeFamily()
