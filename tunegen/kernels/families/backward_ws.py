"""The backward family's Hopper schedule ("ws", FlashAttention-3's warp-specialized backward in
Gluon): where it runs, the shared memory and registers a Variant of it needs, and its measured
defaults. Where it runs is the prefill schedule's rule (`prefill_ws.check_ws`: the same GPU,
releases and inputs), with every feature of current models."""

from __future__ import annotations

from typing import Any

from tunegen.kernels import releases
from tunegen.kernels.families.prefill_ws import REGISTER_FILE, WS_BACKWARD_HEAD_DIMS, check_ws
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem

WS_KNOBS = (
    "dq_write",
    "deterministic",
    "producer_regs",
    "kv_regs",
    "split_tail",
    "split_warpgroups",
    "paired_walk",
)
# Registers per consumer thread beyond the tiles `ws_tile_registers` counts (indices, row
# statistics, barrier phases): calibrated on sm_90 compiles with Triton 3.6, 3.7.1 and 3.9, where
# within the bound ptxas spills at most 80 bytes per thread (3.9: 240 at head dim 128, causal),
# and past it (head dim 64 with 128 query rows) 416 and more.
SPARE_REGISTERS = 16


def check_ws_backward(problem: Problem, gpu: Gpu) -> None:
    """Where the backward's schedule "ws" runs (a ValueError saying why not): the prefill schedule's
    GPU, releases and inputs (`check_ws`) at head dims 64 and 128, windows, chunks, the cap and
    sinks included."""
    check_ws(problem, gpu, fallback="loops", head_dims=WS_BACKWARD_HEAD_DIMS, varlen=False)


def runs_ws_backward(problem: Problem, gpu: Gpu) -> bool:
    """Whether the backward's schedule "ws" runs `problem` on `gpu` (`check_ws_backward`)."""
    try:
        check_ws_backward(problem, gpu)
    except ValueError:
        return False
    return True


def consumer_registers(variant: Any) -> int:
    """Registers per thread of the consumer warpgroups: the register file less the warpgroup of
    the producer warp and the backward's dQ writer (padded to four warps, at `producer_regs`), in
    multiples of 8, at most 256."""
    threads = variant.num_warps * 32
    return min(256, (REGISTER_FILE - 128 * variant.producer_regs) // threads // 8 * 8)


def ws_tile_registers(variant: Any, head_dim: int) -> int:
    """Registers per consumer thread that the tiles hold at their peak: the float32 dK and dV, Sᵀ
    and dPᵀ while both products are in flight, the 16-bit Pᵀ and dSᵀ operands, and with kv_regs
    the 16-bit K and V."""
    n, m = variant.dkdv_block_n, variant.dkdv_block_m
    kv = n * head_dim if variant.kv_regs else 0
    return (2 * n * head_dim + 2 * n * m + n * m + kv) // (variant.num_warps * 32)


def ws_smem(variant: Any, head_dim: int) -> int:
    """Shared memory bytes: K and V, the ring of Q, dO and row-statistics slots, two dSᵀ buffers,
    the float32 dQ tile that TMA reduce-adds from (dq_write "tma"), and 1 KB of barriers."""
    n, m = variant.dkdv_block_n, variant.dkdv_block_m
    tiles = 2 * n * head_dim + 2 * variant.num_stages * m * head_dim + 2 * n * m
    dq = m * head_dim * 4 if variant.dq_write == "tma" else 0
    return tiles * 2 + dq + variant.num_stages * 2 * m * 4 + 1024


def ws_constraint(variant: Any, problem: Problem, gpu: Gpu) -> str | None:
    """Schedule "ws" within the GPU's shared memory per block and the consumers' registers; a split
    tail only where every key tile walks as many steps (no causal mask, window or chunk)."""
    if variant.split_tail and (problem.causal or problem.local):
        return (
            "split_tail: under a causal mask, window or chunk key tiles walk different lengths; "
            "only Problems without them"
        )
    smem = ws_smem(variant, problem.head_dim)
    if smem > gpu.smem_per_block:
        return f"shared memory: needs about {smem} bytes, {gpu.name} has {gpu.smem_per_block} per block"
    registers = ws_tile_registers(variant, problem.head_dim) + SPARE_REGISTERS
    budget = consumer_registers(variant)
    if registers > budget:
        return (
            f"registers: about {registers} per consumer thread, {budget} left by a producer of "
            f"{variant.producer_regs}"
        )
    return None


def ws_default(problem: Problem, variant_type: Any, gpu: Gpu) -> Any:
    """The Hopper schedule's measured best on an H100 with Triton 3.6
    (benchmarks/results/issue30_h100.md): FlashAttention-3's head dim 128 tiles (two consumer
    warpgroups over 128 keys, query tiles of 64 rows) everywhere; at head dim 64 with K and V in
    registers (+5-15%); dQ added from registers by vector reductions (+2-10% over the writer
    warp's TMA reduce-add, which then no longer gains from a third ring slot: 2 slots
    everywhere, 0-10% faster than 3 with the reductions). The table of 3.7 and later
    (`Release.ws_backward_table`) takes a third slot without a causal mask (3.7: +1-8%; 3.9:
    +1-4% at head dim 128, within 1% at 64) and at head dim 128 under one the writer warp's TMA
    reduce-add (3.7: +1-7%; 3.9: +1-3%); 3.9's runs each consumer warpgroup as a partition of its
    own (`split_warpgroups`: +1-11% there on an H100 and an H200, 1-18% slower on 3.6). Before
    3.9, head dim 64 walks its query tiles in pairs (`paired_walk`, one barrier a step: on an
    H100 +2-3% sustained on 3.6, 0-4% in rotated rounds, and +2-8% on 3.7.1; 3.9's partitions
    run 2-5% faster than its pairs; at head dim 128 the pairs spill and run 8-13% slower)."""
    default = variant_type(
        64,
        128,
        num_warps=8,
        num_stages=2,
        schedule="ws",
        dq_write="atomic",
        kv_regs=problem.head_dim <= 64,
        split_tail=not (problem.causal or problem.local),
    )
    table = releases.of(gpu.triton_version).ws_backward_table
    default = default.replace(
        split_warpgroups=table >= (3, 9), paired_walk=table < (3, 9) and problem.head_dim <= 64
    )
    if table < (3, 7):
        return default
    if problem.causal:
        return default.replace(dq_write="tma") if problem.head_dim > 64 else default
    return default.replace(num_stages=3)
