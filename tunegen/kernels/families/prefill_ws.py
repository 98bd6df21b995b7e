"""Where the prefill family's Hopper schedule ("ws", FlashAttention-3's warp-specialized loop in
Gluon) runs: the GPU, the Triton release, the inputs it was written for, the values its knobs
take, and the shared memory and registers a Variant of it needs."""

from __future__ import annotations

from typing import Any

from tunegen.kernels import releases
from tunegen.kernels.families.operands import block_d, ws_block_d
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.variant import Variant

# Multiples of 16 from 64 to 256, in tiles of the next power of two or of 192 (`ws_block_d`) whose
# padding columns TMA fills with zeros.
WS_HEAD_DIMS = tuple(range(64, 257, 16))
# The backward's Hopper schedule holds dK and dV tiles beside its own: sized for these.
WS_BACKWARD_HEAD_DIMS = (64, 128)
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
    "stream_k",
    "o_store",
    "q_regs",
    "pv_pair",
    *PERSISTENT_KNOBS,
)
REGISTER_FILE = 65536  # 32-bit registers per SM on every GPU tunegen targets


def _named(head_dims: tuple[int, ...]) -> str:
    """Head dims as an error names them: a run of multiples of 16 as its ends."""
    if len(head_dims) > 3 and head_dims == tuple(range(head_dims[0], head_dims[-1] + 1, 16)):
        return f"{head_dims[0]} to {head_dims[-1]} in steps of 16"
    return str(head_dims)


def check_ws(
    problem: Problem,
    gpu: Gpu,
    fallback: str = "fa2",
    head_dims: tuple[int, ...] = WS_HEAD_DIMS,
    varlen: bool = True,
) -> None:
    """Where schedule "ws" runs: Hopper's wgmma and TMA (sm_90; not the interpreter, which cannot
    run Gluon), Gluon as of Triton 3.6, 16-bit inputs or FP8 (at the head dims where the release
    compiles it without spilling, `Release.ws_fp8_head_dims`) whose rows TMA can address, head dims
    its register budget was sized for (`head_dims`, in tiles of `ws_block_d`), dense
    batches and, where the family's kernel packs them (`varlen`), packed ones (with current models'
    features too, as `check_ws_variant` says; FP8 renders none of them:
    `Family.fp8_model_features`). The errors name the family's other schedule, `fallback`, which
    runs the rest (the backward family's is "loops")."""
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
    if problem.head_dim not in head_dims:
        raise ValueError(
            f"variant.schedule: 'ws' takes head dims {_named(head_dims)}, got {problem.head_dim} "
            f"({fallback!r} runs it)"
        )
    if problem.varlen and not varlen:
        raise ValueError(f"variant.schedule: 'ws' runs dense batches; varlen takes {fallback!r}")
    if not problem.aligned:
        raise ValueError("variant.schedule: 'ws' loads by TMA, which needs 16-byte aligned bases and strides")


# How a consumer's output leaves: by TMA from its own slot or its query slot, or from registers.
O_STORES = ("slot", "q_slot", "registers")


def check_ws_knobs(variant: Variant) -> None:
    """The knobs of a schedule "ws" Variant, each within what the template renders (a ValueError
    naming the knob), and with the knobs it needs."""
    if variant.block_m not in (64, 128):
        raise ValueError(f"block_m: schedule 'ws' takes 64 or 128 rows per consumer, got {variant.block_m}")
    if variant.block_n < 32:
        raise ValueError(f"block_n: schedule 'ws' takes key blocks of 32 to 256 rows, got {variant.block_n}")
    if variant.num_warps != 4:
        raise ValueError(f"num_warps: schedule 'ws' takes 4 (a warpgroup), got {variant.num_warps}")
    if not 2 <= variant.num_stages <= 4:
        raise ValueError(f"num_stages: schedule 'ws' takes a ring of 2 to 4 slots, got {variant.num_stages}")
    if variant.consumers not in (1, 2, 3):
        raise ValueError(f"consumers: expected 1, 2 or 3 warpgroups, got {variant.consumers}")
    if variant.pingpong and variant.consumers == 1:
        raise ValueError("pingpong: consumers take turns, so it needs at least 2")
    if variant.producer_regs not in (24, 32, 40, 56):
        raise ValueError(f"producer_regs: expected 24, 32, 40 or 56, got {variant.producer_regs}")
    if variant.ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm: expected 1 or 2, got {variant.ctas_per_sm}")
    if variant.ctas_per_sm == 2 and variant.consumers != 1:
        raise ValueError("ctas_per_sm: two programs per SM leave registers for one consumer each")
    if variant.dynamic and not variant.persistent:
        raise ValueError("dynamic: a scheduler of persistent programs, so it needs persistent=True")
    if variant.stream_k and not variant.dynamic:
        raise ValueError(
            "stream_k: ranges of the tail handed out by the dynamic scheduler, so it needs dynamic=True"
        )
    if variant.o_store not in O_STORES:
        raise ValueError(f"o_store: expected one of {O_STORES}, got {variant.o_store!r}")
    if variant.q_stages not in (1, 2):
        raise ValueError(f"q_stages: expected 1 or 2 query slots per consumer, got {variant.q_stages}")
    if variant.q_stages == 2 and not variant.persistent:
        raise ValueError(
            "q_stages: a second query slot serves a program's next tile, so it needs persistent=True"
        )


def check_ws_variant(variant: Variant, problem: Problem) -> None:
    """What a Problem asks of a Variant of schedule "ws": with features of current models, no
    stream-K tail (its merge knows neither the window's ranges nor the sinks), nor at a head dim
    whose tile runs in parts (its merge holds one output tile), where alone `pv_pair` applies;
    packed batches take their tiles from a table in order "m_inner" or "head_inner"
    (`_attention_varlen.j2`), which have no L2 groups of heads, and no stream-K tail (whose ranges
    are cut from a count of tiles the host knows)."""
    if variant.stream_k and problem.model_features:
        raise ValueError(f"variant.stream_k: the tail's merge renders no {sorted(problem.model_features)}")
    if variant.stream_k and ws_in_parts(problem):
        raise ValueError(
            f"variant.stream_k: the tail's merge holds one output tile; head dim {problem.head_dim} "
            "runs in parts"
        )
    if variant.pv_pair and not ws_in_parts(problem):
        raise ValueError(
            f"variant.pv_pair: pairs the parts of a head-dim tile; head dim {problem.head_dim} runs in one"
        )
    if problem.varlen and (variant.order == "grouped" or variant.stream_k):
        raise ValueError(
            "variant.order, variant.stream_k: schedule 'ws' takes packed batches in order 'm_inner' "
            "or 'head_inner', without a stream-K tail"
        )


def ws_in_parts(problem: Problem) -> bool:
    """Whether the Hopper schedule's head-dim tile for `problem` runs in parts (`ws_block_d`)."""
    d, part = ws_block_d(problem.head_dim, problem.fp8)
    return part < d


def runs_ws(problem: Problem, gpu: Gpu) -> bool:
    """Whether schedule "ws" runs `problem` on `gpu` (`check_ws` raises nothing)."""
    try:
        check_ws(problem, gpu)
    except ValueError:
        return False
    return True


def ws_tile_registers(variant: Variant, head_dim: int) -> int:
    """Registers per consumer thread of schedule "ws" that its tiles hold: the float32 output and
    score tiles, the 16-bit P tile of one warpgroup (two with overlap) and with `q_regs` its
    16-bit query rows. An e4m3 P tile is counted as a 16-bit one though its words take half that:
    the bound keeps the margin it was calibrated with (three FP8 consumers of 64 x 128, which it
    refuses, spill 96 bytes; offline sm_90 compile, Triton 3.6)."""
    p_tiles = 2 if variant.overlap else 1
    q_tile = variant.block_m * head_dim // 2 if variant.q_regs else 0
    return (
        variant.block_m * head_dim + variant.block_m * variant.block_n * (2 + p_tiles) // 2 + q_tile
    ) // 128


def ws_constraint(variant: Variant, problem: Problem, gpu: Gpu) -> str | None:
    """Schedule "ws" within the GPU's shared memory (every consumer's `q_stages` query tiles and,
    with `o_store` "slot", output tile, and the K/V ring) and each consumer's registers: its tiles
    (`ws_tile_registers`) plus the spare registers the release needs for the rest
    (`Release.ws_spare_registers`, calibrated on sm_90 compiles of each checked release by
    benchmarks/ws_registers.py: within the bound, ptxas spills at most 48 bytes per thread), and
    where the release needs it a second output tile for the stream-K merge
    (`Release.ws_merge_tile`); query rows in registers only where the release keeps them there
    (`Release.ws_query_registers`). Under a causal mask (or a window
    or chunk, whose tiles may see no key too), two programs per SM on the dynamic scheduler take
    order "grouped": with "m_inner" they left whole tiles unwritten now and then, where tiles that
    see no key mixed with the others (H100, Triton 3.6; issue31_h100.md, fifth session), and no
    other order but "grouped" has been run enough to trust."""
    masked = problem.causal or problem.local
    if masked and variant.ctas_per_sm == 2 and variant.dynamic and variant.order != "grouped":
        return "order: two programs per SM on the dynamic scheduler take 'grouped' under a mask"
    d = ws_block_d(problem.head_dim, problem.fp8)[0]
    size = 1 if problem.fp8 else 2  # bytes per element of Q, K and V; the output is 16-bit
    tiles = (
        variant.consumers
        * variant.block_m
        * (variant.q_stages * size + (2 if variant.o_store == "slot" else 0))
    )
    tiles += 2 * variant.num_stages * variant.block_n * size
    smem = tiles * d + 1024
    # An SM holds one block's maximum plus 1 KB that each resident block reserves.
    limit = (gpu.smem_per_block + 1024) // variant.ctas_per_sm - 1024
    if smem > limit:
        return (
            f"shared memory: needs about {smem} bytes, {gpu.name} has {limit} per block "
            f"for {variant.ctas_per_sm} per SM"
        )
    release = releases.of(gpu.triton_version)
    if variant.q_regs and not release.ws_query_registers:
        return f"q_regs: Triton {release.name} spills the query rows it keeps in registers"
    registers = ws_tile_registers(variant, d) + release.ws_spare_registers
    if variant.stream_k and release.ws_merge_tile:
        registers += variant.block_m * d // 128
    if registers > variant.consumer_regs:
        return (
            f"registers: about {registers} per consumer thread, {variant.consumer_regs} left by "
            f"{variant.consumers} consumers and a producer of {variant.producer_regs}"
        )
    return None


def ws_default(problem: Problem, variant_type: Any, gpu: Gpu) -> Any:
    """The Hopper schedule's measured best (`_ws_measured`) where the running release's register
    budget admits it; where that release needs more registers than Triton 3.6, on which it was
    measured, two overlapped consumers taking turns instead (the measured best elsewhere), or
    where those do not fit either (head dims past 128), the best with its query rows in shared
    memory, or without overlap; else None (FlashAttention-2's loop)."""
    # Two overlapped consumers of 64 rows: part of most measured bests, and within every checked
    # release's register budget at head dims 64 and 128.
    two = variant_type(schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True)
    best = _ws_measured(problem, two, gpu)
    page = problem.page_size
    if best is not None and problem.paged and block_d(problem.head_dim) == 128:
        # A chunk's tiles see the whole cache: two overlapped consumers on the dynamic scheduler, as
        # long prompts run (1.01x and 1.02x the contiguous call's default at 1 and 4 sequences of a
        # 2048-token chunk over 16k keys, pages of 64; 0.98x in pages of 16; issue33_chunked_h200.md).
        best = two.replace(persistent=True, dynamic=True, q_stages=2, reverse_m=problem.causal)
    if best is not None and problem.paged and page % best.block_n and best.block_n % page:
        # Key blocks that lie in one page or hold whole pages: the widest (32 keys at least).
        fits = [n for n in (128, 64, 32) if n < best.block_n and (page % n == 0 or n % page == 0)]
        if not fits:
            return None  # FA2's loop gathers any page's rows
        best = best.replace(block_n=fits[0])
    if best is not None and problem.varlen:
        # Packed batches: each sequence's tiles together, longest sequences first (`check_ws_variant`).
        best = best.replace(order="m_inner", l2_share=2)
    if best is not None and problem.local:
        # A window's or chunk's masked blocks in the loop's branch: 1.5-6% faster than in copies
        # of the loop (H100, benchmarks/results/issue32_h100.md, session 22).
        best = best.replace(mask_branch=True)
    if best is None or ws_constraint(best, problem, gpu) is None:
        return best
    turns = two.replace(pingpong=True, persistent=best.persistent, mask_branch=problem.local)
    for fallback in (turns, best.replace(q_regs=False), best.replace(q_regs=False, overlap=False)):
        if ws_constraint(fallback, problem, gpu) is None:
            return fallback
    return None


def attended_length(problem: Problem) -> int:
    """The most keys a row of `problem` sees: its length, or a window's or chunk's span, which sets
    how long each tile's key loop runs and so which Variant runs it best (a window of 4096 keys
    over a 16k prompt runs as a 4k prompt does)."""
    n = problem.seqlen_q
    right = 0 if problem.causal else problem.window_right
    if problem.window_left >= 0 and right >= 0:
        n = min(n, problem.window_left + right + 1)
    if problem.attention_chunk > 0:
        n = min(n, problem.attention_chunk)
    return n


def _ws_measured(problem: Problem, two: Any, gpu: Gpu) -> Any:
    """The Hopper schedule's measured best per head dim, mask and length on an H100 with Triton 3.6 (bf16:
    benchmarks/results/issue31_h100.md, over prefill_ws_h100.md; FP8: fp8_h100.md, and without a
    mask issue34_fp8_h200.md, on the H200), or None where it does not run or launches less than one
    wave of 128-row tiles (its launch encodes four TMA descriptors, twice FA2's cost:
    benchmarks/results/launch_h100.md). For 16-bit inputs, persistent programs on the dynamic
    scheduler, two query slots per consumer (one at causal head dim 64 past 4096 tokens). Causal
    tiles heaviest first over even groups of heads whose K and V fill half the L2, an eighth at
    short prompts (head dim 128 up to 2048 tokens, 64 up to 4096; on the H200 up to 1024 and 512:
    its own sweep, issue31_h200.md); there, `mask_branch` and two consumers without overlap, apart,
    as cuDNN's d64 kernel runs them (at head dim 64 and 512 tokens one 128-row consumer over a third
    stage of keys instead); `mask_branch` also at causal head dim 64 past 4096. Longer causal
    prompts at head dim 128 overlap each consumer's softmax with its products, apart, but in turns
    on the H200 past 4096 tokens. Without a mask, prompts up to 1024 tokens take two consumers
    without overlap: turns at head dim 128, apart at 64. Head dim 256 (issue33_h100.md; on the H200
    within 2% of its best, issue33_h200.md) runs one tile per program, its output through the query
    slot. Head dim 192 runs in three 64-column parts with its query rows in registers (its own
    sweep, on the H200 only: issue33_h200_d192.md). A head dim between takes the rules of its tile's
    (`ws_block_d`): 96 measured 1.02x to 1.13x cuDNN by 128's. A window or chunk counts as a prompt
    of its span (`attended_length`). Packed batches take these rules at their longest sequence, each
    sequence's tiles together (order "m_inner", set by `ws_default`): on the H200, 0.94x to 1.02x
    the dense call at equal lengths and 1.3x to 1.5x FA2's loop on mixes of lengths
    (issue33_varlen_h200.md)."""
    if not runs_ws(problem, gpu):
        return None
    if problem.batch * problem.num_heads_q * -(-problem.seqlen_q // 128) < gpu.sm_count:
        return None
    n = attended_length(problem)
    pair = two.replace(block_n=64, consumers=1, ctas_per_sm=2)  # two one-consumer programs per SM
    if problem.fp8:
        # Without overlap: with P packed into words (issue34_fp8_h200.md, over fp8_h100.md) the
        # softmax is short enough that overlapping it with P·V no longer pays (+0.6% to +2.1%
        # without it, on the H200 only). Head dim 128; 64 takes the same, unmeasured.
        if problem.causal:
            return two.replace(overlap=False, order="grouped", reverse_m=True)
        return two.replace(overlap=False, persistent=True)
    dynamic = {"persistent": True, "dynamic": True, "q_stages": 2}
    d = ws_block_d(problem.head_dim)[0]
    short = n <= (2048 if d == 128 else 4096)
    if problem.causal:
        small = short if gpu.model != "h200" else n <= (1024 if d == 128 else 512)
        # The smaller groups: +5% at head dim 128 and 512 tokens (issue31_h100.md, fifth session).
        dynamic.update(order="grouped", reverse_m=True, l2_share=8 if small else 2)
    if d == 192:
        # Three 64-column parts over 64-key blocks, the query rows read into registers once a tile
        # (every best candidate of the H200's sweep: 1.03x to 1.06x the same tiles reading them
        # from shared memory); short prompts (1024 tokens, causal 2048) without overlap on the
        # dynamic scheduler, their slot freed once read (in turns without a mask); longer ones
        # with overlap, the output through the query slot, over a ring of three up to 4096
        # tokens; without a mask past 4096 on the dynamic scheduler. P·V's first two parts as one
        # product but for causal prompts past 4096 tokens (+0.5% to +3.7% without a mask, +0.7% to
        # +2.1% causal up to 4096 but -0.6% once at 4096, -1.4% to -1.9% past it;
        # issue33_h200_d192.md). Causal heads in groups of half the L2, as measured.
        paired = not (problem.causal and n > 4096)
        parts = two.replace(block_n=64, q_regs=True, pv_pair=paired)
        heaviest = {"order": "grouped", "reverse_m": True} if problem.causal else {}
        taken = {**dynamic, "q_stages": 1, "l2_share": 2}
        if n <= (2048 if problem.causal else 1024):
            return parts.replace(overlap=False, pingpong=not problem.causal, **taken)
        if n <= 4096:
            return parts.replace(num_stages=3, o_store="q_slot", **heaviest)
        if problem.causal:
            return parts.replace(o_store="q_slot", **heaviest)
        return parts.replace(o_store="q_slot", **taken)
    if d == 256:
        # What fits beside two consumers' 64 query rows: 64-key blocks in a ring of two, the output
        # through the query slot (up to 1.54x storing it from registers at 1024 tokens, 0.98x to
        # 1.07x at 16k), one tile a program (0.99x to 1.10x the dynamic scheduler), overlap but
        # for causal prompts up to 2048 tokens.
        wide = two.replace(block_n=64, o_store="q_slot")
        if problem.causal:
            # Packed batches: no overlap, whose registers spill beside the masked store of a
            # sequence's last rows (48 bytes a thread on Triton 3.6, 72 on 3.9).
            overlap = n > 2048 and not problem.varlen
            return wide.replace(overlap=overlap, order="grouped", reverse_m=True)
        return wide
    # Two consumers taking turns, without overlap inside each (as cuDNN's kernel runs them).
    turns = two.replace(pingpong=True, overlap=False, **dynamic)
    if d == 128:
        if not problem.causal:
            return turns if n <= 1024 else two.replace(**dynamic)
        # Causal: the two consumers apart, not in turns (+0.0% to +2.7% on the H100 from 1k to 16k,
        # on the H200 up to 4096; past that it keeps turns, -0.9% to +1.9% apart).
        if short:
            return turns.replace(pingpong=False, mask_branch=True)
        return two.replace(pingpong=gpu.model == "h200" and n > 4096, **dynamic)
    three = two.replace(consumers=3, pingpong=True, overlap=False, **dynamic)
    # Two consumers apart, neither turns nor overlap, as cuDNN's d64 kernel runs its warpgroups.
    apart = two.replace(overlap=False, mask_branch=True, **dynamic)
    if not problem.causal:
        # `stream_k` stays off: -2.4% to +3.3% at head dim 64 (no better than the spread between
        # runs), -4% to -13% at 128 (issue31_h100.md and issue31_h200.md, eighth session).
        return apart if n <= 1024 else three
    if n <= 512:
        return pair.replace(block_m=128, num_stages=3, **dynamic)
    return apart if short else three.replace(q_stages=1, mask_branch=True)
