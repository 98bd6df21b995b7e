"""The backward family: FlashAttention-2 style gradients of prefill attention (dQ, dK, dV)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunegen.families.prefill import block_d, dot_precision
from tunegen.gpu import Gpu
from tunegen.problem import Problem
from tunegen.variant import Variant

DQ_MODES = ("separate", "atomic")
TILES = (16, 32, 64, 128, 256)
# Float32 accumulator and score values per thread past which a pass spills registers.
MAX_REGISTERS_PER_THREAD = 192


@dataclasses.dataclass(frozen=True)
class BackwardVariant(Variant):
    """Knobs of templates/attention_bwd.py.j2.

    dkdv_block_m, dkdv_block_n: the query tile walked and the key tile kept resident by the dK/dV
    kernel; dq_block_m, dq_block_n: the query tile kept and the key tile walked by the dQ kernel;
    num_warps, num_stages: Triton's launch knobs for both; dq_mode: "separate" (a dQ pass of its
    own) or "atomic" (the dK/dV programs add dQ into a float32 buffer; the dq tiles are unused).
    """

    family: ClassVar[str] = "backward"

    dkdv_block_m: int = 32
    dkdv_block_n: int = 64
    dq_block_m: int = 64
    dq_block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    dq_mode: str = "separate"

    def __post_init__(self) -> None:
        for name in ("dkdv_block_m", "dkdv_block_n", "dq_block_m", "dq_block_n"):
            if getattr(self, name) not in TILES:
                raise ValueError(f"{name}: expected a power of two from 16 to 256, got {getattr(self, name)}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1 to 8, got {self.num_stages}")
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"dq_mode: expected one of {DQ_MODES}, got {self.dq_mode!r}")


class BackwardFamily:
    name = "backward"
    template = "attention_bwd.py.j2"
    variant_type = BackwardVariant
    conditions: ClassVar[dict[str, tuple[str, tuple]]] = {}

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        return {
            "head_dim": problem.head_dim,
            "block_d": block_d(problem.head_dim),
            "causal": problem.causal,
            "varlen": problem.varlen,
            "group": problem.group,
            "precision": dot_precision(problem),
            "upcast": gpu.backend == "interpreter" and problem.dtype == "bfloat16",
        }

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        if not isinstance(variant, BackwardVariant):
            raise ValueError(f"variant: expected a BackwardVariant, got {type(variant).__name__}")

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        """The knobs the tuner searches. Each pass keeps one tile resident and walks the other:
        the dK/dV pass a tall key tile over short query tiles, the dQ pass the reverse (as in
        FlashAttention-2), so the resident and walked sizes are searched as two lists."""
        if gpu.arch == "interpreter":
            resident, walked, warps, stages = [16, 32], [16, 32], [4], [1]
        elif problem.dtype == "float32":
            resident, walked, warps, stages = [32, 64], [16, 32], [4, 8], [1, 2, 3]
        else:
            resident, walked, warps, stages = [64, 128], [16, 32, 64], [4, 8], [1, 2, 3, 4, 5]
        return {
            "dkdv_block_m": walked,
            "dkdv_block_n": resident,
            "dq_block_m": resident,
            "dq_block_n": walked,
            "num_warps": warps,
            "num_stages": stages,
            "dq_mode": list(DQ_MODES),
        }

    def constraint(self, variant: BackwardVariant, problem: Problem, gpu: Gpu) -> str | None:
        """Why `variant` should not be compiled for `problem` on `gpu`; None if it may.

        Atomic Variants must name the dK/dV tiles as their dq tiles (which that mode does not use),
        so the tuner never times one kernel twice. Shared memory, per pass: the resident tiles
        plus `num_stages` buffers of the two walked tiles (and, with atomics, the transposed dS
        and the float32 dQ tile). Registers, per pass: the float32 accumulators (dK and dV, or
        dQ) and two score tiles spread over the threads; past 192 per thread ptxas spills
        (calibrated on sm_90 compiles: 320 spilled 3.3 KB, 160 to 192 spilled at most 60 bytes).
        """
        try:
            self.check_variant(variant, problem, gpu)
        except ValueError as exc:
            return str(exc)
        atomic = variant.dq_mode == "atomic"
        if atomic and (variant.dq_block_m, variant.dq_block_n) != (
            variant.dkdv_block_m,
            variant.dkdv_block_n,
        ):
            return "dq_block_m/dq_block_n: unused with dq_mode 'atomic'; only the dK/dV tiles are tried"
        if gpu.arch == "interpreter":
            return None
        d = block_d(problem.head_dim)
        size = 4 if problem.dtype == "float32" else 2
        passes = [("dK/dV", variant.dkdv_block_n, variant.dkdv_block_m, 2)]
        if not atomic:
            passes.append(("dQ", variant.dq_block_m, variant.dq_block_n, 1))
        threads = variant.num_warps * 32
        for name, resident, walked, accumulators in passes:
            smem = (2 * resident + variant.num_stages * 2 * walked) * d * size
            if atomic:
                smem += walked * resident * size + walked * d * 4
            if smem > gpu.smem_per_block:
                return (
                    f"shared memory: the {name} pass needs about {smem} bytes, "
                    f"{gpu.name} has {gpu.smem_per_block} per block"
                )
            registers = (accumulators * resident * d + 2 * resident * walked) // threads
            if registers > MAX_REGISTERS_PER_THREAD:
                return f"registers: the {name} pass holds about {registers} float32 values per thread"
        return None

    def default_variant(self, problem: Problem, gpu: Gpu) -> BackwardVariant:
        """Hand-picked per GPU class and head dim until tuned Winners exist.

        Hopper starts from the Triton fused-attention tutorial's H100 tiles (32 x 128 for dK/dV,
        128 x 32 for dQ); at head dim 128 with 8 warps and 3 stages rather than its 4 and 5, which
        spill 3.3 KB in the dK/dV kernel (ptxas on sm_90); one stage spills at head dim 256. The
        rest are conservative choices that fit the shared memory and registers of their class.
        """
        d = block_d(problem.head_dim)
        if gpu.arch == "interpreter" or problem.dtype == "float32":
            return BackwardVariant(32, 32, 32, 32, num_warps=4, num_stages=1)
        if gpu.arch in ("hopper", "blackwell"):
            if d <= 64:
                return BackwardVariant(32, 128, 128, 32, num_warps=4, num_stages=5)
            if d <= 128:
                return BackwardVariant(32, 128, 128, 32, num_warps=8, num_stages=3)
            return BackwardVariant(32, 64, 64, 32, num_warps=8, num_stages=2)
        if d <= 128:
            return BackwardVariant(32, 64, 64, 32, num_warps=4, num_stages=2)
        return BackwardVariant(32, 64, 64, 32, num_warps=8, num_stages=2)

    def measure(self, problem: Problem) -> tuple[str, float]:
        """FLOPs as FlashAttention counts the backward: 2.5 times the forward's."""
        return "TFLOP/s", 2.5 * problem.flops()

    def case(self, problem: Problem, kernel: Any, device: Any, seed: int) -> Any:
        from tunegen.families.backward_case import backward_case

        return backward_case(problem, kernel, device, seed)


FAMILY = BackwardFamily()
