"""The prefill family: FlashAttention-2 style forward over whole query sequences."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunegen.fp8 import SCALE_BLOCK
from tunegen.gpu import Gpu
from tunegen.problem import Problem
from tunegen.variant import Variant

LOADS = ("ptr", "desc")
ORDERS = ("m_inner", "head_inner")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class PrefillVariant(Variant):
    """Knobs of templates/attention_fwd.py.j2.

    block_m, block_n: query and key tile sizes; num_warps, num_stages: Triton's launch knobs;
    causal_split: run the key blocks every row sees without masks, apart from the masked ones;
    load: "ptr" (pointer arithmetic) or "desc" (device-side tensor descriptors, TMA on Hopper);
    order: which index varies fastest over the 1-D grid, query blocks ("m_inner") or
    (batch, head) pairs ("head_inner"); reverse_m: visit the last query blocks first.
    FP8 Problems only: p_fp8: P enters the second product as e4m3 (scaled by 256, both products
    in FP8) rather than bf16 with V widened (one rounding fewer, half-rate second product);
    v_trans: the launcher writes V as (head_dim, seqlen), the K-major layout Hopper's FP8
    tensor cores take for the second product's right operand, instead of transposing on chip.
    """

    family: ClassVar[str] = "prefill"

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    causal_split: bool = True
    load: str = "ptr"
    order: str = "m_inner"
    reverse_m: bool = False
    p_fp8: bool = True
    v_trans: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not (_pow2(value) and 16 <= value <= 256):
                raise ValueError(f"{name}: expected a power of two from 16 to 256, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1 to 8, got {self.num_stages}")
        if self.load not in LOADS:
            raise ValueError(f"load: expected one of {LOADS}, got {self.load!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {self.order!r}")


def block_d(head_dim: int, fp8: bool = False) -> int:
    """The head-dim tile: the next power of two, at least tl.dot's smallest K on NVIDIA GPUs (16,
    or 32 for e4m3 operands)."""
    return max(32 if fp8 else 16, 1 << (head_dim - 1).bit_length())


def _check_fp8(variant: PrefillVariant, problem: Problem, gpu: Gpu) -> None:
    """What an fp8 Problem adds: padded batches, bf16 output, key tiles of at least 32 (e4m3
    products need K >= 32 on NVIDIA GPUs; checked on every backend so that the interpreter runs
    only what a GPU can), tiles inside one scale block, and a GPU with e4m3 tensor cores."""
    if problem.varlen:
        raise ValueError("problem.varlen: fp8 prefill takes (batch, heads, seqlen, head_dim) inputs")
    if problem.dtype != "bfloat16":
        raise ValueError(f"problem.dtype: fp8 prefill writes bfloat16, got {problem.dtype}")
    if variant.block_n < 32:
        raise ValueError(f"variant.block_n: fp8 key tiles need at least 32 rows, got {variant.block_n}")
    if max(variant.block_m, variant.block_n) > SCALE_BLOCK:
        raise ValueError(
            f"variant.block_m, variant.block_n: fp8 tiles must lie in one {SCALE_BLOCK}-row scale block, "
            f"got {variant.block_m} x {variant.block_n}"
        )
    if gpu.backend == "cuda" and gpu.capability < (8, 9):
        raise ValueError(
            f"problem.fp8: e4m3 tensor-core products need compute capability 8.9 or newer, "
            f"{gpu.name} has {gpu.capability}"
        )


class PrefillFamily:
    name = "prefill"
    template = "attention_fwd.py.j2"
    variant_type = PrefillVariant

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        interpreted = gpu.backend == "interpreter"
        return {
            "head_dim": problem.head_dim,
            "block_d": block_d(problem.head_dim, problem.fp8),
            "causal": problem.causal,
            "varlen": problem.varlen,
            "return_lse": problem.return_lse,
            "group": problem.group,
            "precision": "ieee" if problem.dtype == "float32" else None,
            "upcast": interpreted and problem.dtype == "bfloat16",
            "fp8": problem.fp8,
            "emulate_fp8": interpreted and problem.fp8,
            "scale_block": SCALE_BLOCK if problem.fp8 else 0,
        }

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        if not isinstance(variant, PrefillVariant):
            raise ValueError(f"variant: expected a PrefillVariant, got {type(variant).__name__}")
        if problem.fp8:
            _check_fp8(variant, problem, gpu)
        elif not variant.p_fp8 or variant.v_trans:
            raise ValueError("variant.p_fp8, variant.v_trans: FP8 knobs, for fp8 Problems only")
        if variant.load == "desc":
            if problem.dtype == "float32":
                raise ValueError("variant.load: 'desc' takes 16-bit inputs; float32 needs 'ptr'")
            if not problem.aligned:
                raise ValueError(
                    "variant.load: 'desc' needs 16-byte aligned base addresses and strides; "
                    "these inputs need 'ptr'"
                )
            if gpu.backend == "cuda" and gpu.capability < (9, 0):
                raise ValueError(
                    f"variant.load: 'desc' needs compute capability 9.0 or newer, "
                    f"{gpu.name} has {gpu.capability}"
                )

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        """The knobs the tuner searches and their values for this Problem on this Gpu.

        Knobs that cannot matter are pinned: the causal program order only for causal
        Problems, tensor descriptors only where the inputs and the GPU allow them.
        """
        if gpu.arch == "interpreter":
            tiles, warps, stages = [16, 32], [4], [1]
        else:
            tiles, warps, stages = [32, 64, 128], [4, 8], [2, 3, 4] + ([5] if problem.fp8 else [])
        loads = ["ptr"]
        if (
            problem.aligned
            and problem.dtype != "float32"
            and (gpu.arch == "interpreter" or gpu.capability >= (9, 0))
        ):
            loads.append("desc")
        return {
            "block_m": [t for t in tiles if t >= 16] if gpu.arch == "interpreter" else [64, 128],
            "block_n": [t for t in tiles if t >= 32] if problem.fp8 else tiles,
            "num_warps": warps,
            "num_stages": stages,
            "causal_split": [True],
            "load": loads,
            "order": list(ORDERS) if problem.causal else ["m_inner"],
            "reverse_m": [False, True] if problem.causal else [False],
            "p_fp8": [True, False] if problem.fp8 else [True],
            "v_trans": [False, True] if problem.fp8 else [False],
        }

    def constraint(self, variant: PrefillVariant, problem: Problem, gpu: Gpu) -> str | None:
        """Why `variant` cannot run well on `gpu`, judged before compiling; None if it may.

        Shared memory: the Q tile plus `num_stages` buffers of K and V tiles (matches what
        Triton 3.6 allocated on the H100 within a few KB). Registers: the float32 accumulator and
        score tiles spread over the threads; past 192 per thread the kernel spills.
        """
        try:
            self.check_variant(variant, problem, gpu)
        except ValueError as exc:
            return str(exc)
        if gpu.arch == "interpreter":
            return None
        d = block_d(problem.head_dim, problem.fp8)
        size = 1 if problem.fp8 else 4 if problem.dtype == "float32" else 2
        smem = variant.block_m * d * size + variant.num_stages * 2 * variant.block_n * d * size
        if smem > gpu.smem_per_block:
            return f"shared memory: needs about {smem} bytes, {gpu.name} has {gpu.smem_per_block} per block"
        threads = variant.num_warps * 32
        registers = (variant.block_m * d + variant.block_m * variant.block_n) // threads
        if registers > 192:
            return f"registers: about {registers} per thread for the accumulator and scores (over 192 spills)"
        return None

    def default_variant(self, problem: Problem, gpu: Gpu) -> PrefillVariant:
        """Hand-picked per GPU class and head dim until the dispatcher serves tuned Winners.

        The Hopper rows come from benchmarks/prefill_defaults.py on an H100 (bf16, N = 512 to
        4096; see benchmarks/results/prefill_h100.md); the others are conservative guesses.
        """
        d = block_d(problem.head_dim, problem.fp8)
        if gpu.arch == "interpreter":
            return PrefillVariant(block_m=32, block_n=32, num_warps=4, num_stages=1)
        if problem.dtype == "float32":
            return PrefillVariant(block_m=64, block_n=32, num_warps=4, num_stages=1)
        if problem.fp8:
            if gpu.arch in ("hopper", "blackwell"):
                load = "desc" if problem.aligned else "ptr"
                return PrefillVariant(
                    block_m=128, block_n=128, num_warps=8, num_stages=3, load=load, v_trans=True
                )
            return PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=2)
        if gpu.arch in ("hopper", "blackwell"):
            if d <= 128:
                if problem.seqlen_q <= 512:
                    return PrefillVariant(block_m=64, block_n=64, num_warps=4, num_stages=3)
                return PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=3)
            wide = PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=2)
            if problem.causal and problem.seqlen_q <= 2048:
                return wide
            load = "desc" if problem.aligned else "ptr"
            if problem.causal:
                return wide.replace(load=load, order="head_inner", reverse_m=True)
            return wide.replace(load=load)
        if d <= 64:
            return PrefillVariant(block_m=128, block_n=64, num_warps=4, num_stages=3)
        if d <= 128:
            return PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=2)
        return PrefillVariant(block_m=64, block_n=32, num_warps=4, num_stages=2)

    def measure(self, problem: Problem) -> tuple[str, float]:
        return "TFLOP/s", problem.flops()

    def case(self, problem: Problem, kernel: Any, device: Any, seed: int) -> Any:
        from tunegen.families.prefill_case import prefill_case

        return prefill_case(problem, kernel, device, seed)


FAMILY = PrefillFamily()
