"""Where the prefill family's Hopper schedule ("ws", FlashAttention-3's warp-specialized loop in
Gluon) runs: the GPU, the Triton release, the inputs it was written for, and the shared memory
and registers a Variant of it needs."""

from __future__ import annotations

from tunegen.kernels import releases
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.variant import Variant

WS_HEAD_DIMS = (64, 128)
# Knobs of persistent programs: how they take tiles, and query slots for the next tile.
PERSISTENT_KNOBS = ("dynamic", "q_stages")
WS_KNOBS = (
    "consumers",
    "pingpong",
    "overlap",
    "persistent",
    "producer_regs",
    "ctas_per_sm",
    "mask_branch",
    *PERSISTENT_KNOBS,
)
REGISTER_FILE = 65536  # 32-bit registers per SM on every GPU tunegen targets


def check_ws(problem: Problem, gpu: Gpu, fallback: str = "fa2") -> None:
    """Where schedule "ws" runs: Hopper's wgmma and TMA (sm_90; not the interpreter, which cannot
    run Gluon), Gluon as of Triton 3.6, 16-bit inputs or FP8 (at the head dims where the release
    compiles it without spilling, `Release.ws_fp8_head_dims`) whose rows TMA can address, head dims
    its register budget was sized for, and dense batches. The errors name the family's other
    schedule, `fallback`, which runs the rest (the backward family's is "loops")."""
    if gpu.backend != "cuda" or gpu.capability != (9, 0):
        where = "Triton's interpreter" if gpu.backend == "interpreter" else f"{gpu.name} {gpu.capability}"
        raise ValueError(f"variant.schedule: 'ws' needs a Hopper GPU (sm_90), not {where}")
    release = releases.of(gpu.triton_version)
    release.require("ws")
    if problem.fp8 and problem.head_dim not in release.ws_fp8_head_dims:
        raise ValueError(
            f"variant.schedule: 'ws' takes no FP8 at head dim {problem.head_dim} on Triton {release.name}, "
            f"which spills its e4m3 tiles there ({fallback!r} runs it)"
        )
    if problem.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"variant.schedule: 'ws' takes float16 or bfloat16 inputs, got {problem.dtype}")
    if problem.head_dim not in WS_HEAD_DIMS:
        raise ValueError(
            f"variant.schedule: 'ws' takes head dims {WS_HEAD_DIMS}, got {problem.head_dim} "
            f"({fallback!r} runs it)"
        )
    if problem.varlen:
        raise ValueError(f"variant.schedule: 'ws' runs dense batches; varlen takes {fallback!r}")
    if not problem.aligned:
        raise ValueError("variant.schedule: 'ws' loads by TMA, which needs 16-byte aligned bases and strides")


def runs_ws(problem: Problem, gpu: Gpu) -> bool:
    """Whether schedule "ws" runs `problem` on `gpu` (`check_ws` raises nothing)."""
    try:
        check_ws(problem, gpu)
    except ValueError:
        return False
    return True


def ws_tile_registers(variant: Variant, head_dim: int) -> int:
    """Registers per consumer thread of schedule "ws" that its tiles hold: the float32 output and
    score tiles and the 16-bit P tile of one warpgroup (two with overlap); an e4m3 P tile costs as
    much (the conversion to the operand's layout holds it as 16-bit pairs)."""
    p_tiles = 2 if variant.overlap else 1
    return (variant.block_m * head_dim + variant.block_m * variant.block_n * (2 + p_tiles) // 2) // 128


def ws_constraint(variant: Variant, problem: Problem, gpu: Gpu) -> str | None:
    """Schedule "ws" within the GPU's shared memory (every consumer's `q_stages` query tiles and
    output tile, and the K/V ring) and each consumer's registers: its tiles (`ws_tile_registers`)
    plus the spare registers the release needs for the rest (`Release.ws_spare_registers`,
    calibrated on sm_90 compiles of each checked release by benchmarks/ws_registers.py: within the
    bound, ptxas spills at most 48 bytes per thread)."""
    d = problem.head_dim
    size = 1 if problem.fp8 else 2  # bytes per element of Q, K and V; the output is 16-bit
    tiles = variant.consumers * variant.block_m * (variant.q_stages * size + 2)
    tiles += 2 * variant.num_stages * variant.block_n * size
    smem = tiles * d + 1024
    # An SM holds one block's maximum plus 1 KB that each resident block reserves.
    limit = (gpu.smem_per_block + 1024) // variant.ctas_per_sm - 1024
    if smem > limit:
        return (
            f"shared memory: needs about {smem} bytes, {gpu.name} has {limit} per block "
            f"for {variant.ctas_per_sm} per SM"
        )
    registers = ws_tile_registers(variant, d) + releases.of(gpu.triton_version).ws_spare_registers
    if registers > variant.consumer_regs:
        return (
            f"registers: about {registers} per consumer thread, {variant.consumer_regs} left by "
            f"{variant.consumers} consumers and a producer of {variant.producer_regs}"
        )
    return None
