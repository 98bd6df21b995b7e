"""The prefill family: the forward over whole query sequences, in two schedules: FlashAttention-2's
loop in Triton (every GPU and the interpreter) and FlashAttention-3's warp-specialized Hopper
schedule in Gluon (sm_90)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunegen.kernels.families.operands import (
    approx_tanh,
    block_d,
    check_descriptors,
    dot_precision,
    load_paths,
    ws_block_d,
)
from tunegen.kernels.families.prefill_paged import check_paged
from tunegen.kernels.families.prefill_ws import (
    PERSISTENT_KNOBS,
    REGISTER_FILE,
    WS_KNOBS,
    check_ws,
    check_ws_knobs,
    check_ws_variant,
    runs_ws,
    ws_constraint,
    ws_default,
    ws_in_parts,
)
from tunegen.kernels.fp8 import SCALE_BLOCK
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import MODEL_FEATURES, Problem
from tunegen.kernels.variant import Variant

LOADS = ("ptr", "desc")
ORDERS = ("m_inner", "head_inner", "grouped")
L2_SHARES = (2, 4, 8, 16)
SCHEDULES = ("fa2", "ws")
FA2_KNOBS = ("num_warps", "causal_split", "load", "p_fp8", "v_trans")


@dataclasses.dataclass(frozen=True)
class PrefillVariant(Variant):
    """Knobs of templates/attention_fwd.py.j2.

    block_m, block_n: query and key tile sizes; num_warps, num_stages: Triton's launch knobs;
    causal_split: run the key blocks every row sees without masks, apart from the masked ones;
    load: "ptr" (pointer arithmetic) or "desc" (device-side tensor descriptors, TMA on Hopper);
    order: which index varies fastest over the 1-D grid, query blocks ("m_inner"), (batch, head)
    pairs ("head_inner"), or heads within groups whose K and V fit in a share of the L2
    ("grouped"); l2_share: with "grouped", that share is 1/l2_share (2, 4, 8 or 16); reverse_m:
    visit the last query blocks first (with "grouped", heaviest first per group).
    FP8 Problems only: p_fp8: P enters the second product as e4m3 (scaled by 256, both products
    in FP8) rather than bf16 with V widened (one rounding fewer, half-rate second product);
    v_trans: the launcher writes V as (head_dim, seqlen), the K-major layout Hopper's FP8
    tensor cores take for the second product's right operand, instead of transposing on chip.

    schedule: "fa2" (the knobs above) or "ws", FlashAttention-3's warp-specialized Hopper
    schedule, whose knobs are: block_m, the query rows of each consumer warpgroup (64 or 128);
    block_n; num_stages, the depth of the K/V ring; consumers, warpgroups per program (1 to 3,
    each its own block_m rows); pingpong, consumers take turns issuing their products; overlap,
    each consumer's softmax runs while its previous product finishes (a second P tile of
    registers); persistent, one program per SM walking the tiles; dynamic, persistent programs take
    each next tile from a counter in global memory (in the program order, so that with a causal
    mask and reverse_m the longest tiles go first and the short ones fill in), not every
    num_programs-th; stream_k, on the dynamic scheduler without a causal mask, the tiles past the
    last whole wave cut by key blocks into one even range per program, each tile's partial
    results merged by whichever of its ranges finishes last; q_stages, query slots per consumer
    of a persistent program (2: the next tile's query rows load while this tile's products run);
    producer_regs, the TMA producer's registers per thread (the consumers share the rest);
    ctas_per_sm, programs sharing an SM (2: one consumer each, registers capped at launch);
    mask_branch, one key-block loop masking in a branch, not a second, masked copy (the kernel a
    fifth shorter); o_store, how each consumer's output leaves: by TMA from a slot of shared memory
    of its own ("slot"), by TMA through its query slot, whose next rows then wait for the store
    ("q_slot", 16-bit inputs), or from registers ("registers"), the last two leaving head dim 256
    room for its K/V ring; q_regs, each consumer reads its query rows into registers once a tile
    and its scores' products take them from there (wgmma's left operand from registers), which
    halves the shared memory those products read at 64-key blocks and frees the query slot for
    the next tile's rows once read (but for the output or a stream-K segment; 16-bit inputs);
    pv_pair, at a head dim that runs in three parts of 64 columns (144 to 192), P·V's first two
    parts run as one product of 128 columns (their tiles side by side) and the third alone,
    rather than three of 64; order and reverse_m. num_warps is 4. Knobs that do not apply to a schedule
    keep their defaults, so that two different Variants are always two different kernels.
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
    schedule: str = "fa2"
    consumers: int = 1
    pingpong: bool = False
    overlap: bool = False
    persistent: bool = False
    producer_regs: int = 24
    ctas_per_sm: int = 1
    dynamic: bool = False
    q_stages: int = 1
    mask_branch: bool = False
    l2_share: int = 2
    stream_k: bool = False
    o_store: str = "slot"
    q_regs: bool = False
    pv_pair: bool = False

    @property
    def consumer_regs(self) -> int:
        """Registers per thread of each consumer warpgroup ("ws"): what the producer's warpgroup
        leaves of a program's share of the register file, split evenly, in multiples of 8
        (setmaxnreg's unit), at most 256."""
        per_warpgroup = REGISTER_FILE // self.ctas_per_sm // 128
        return min(256, (per_warpgroup - self.producer_regs) // self.consumers // 8 * 8)

    @property
    def maxnreg(self) -> int | None:
        """The register cap per thread at launch that lets `ctas_per_sm` programs share an SM
        ("ws"); None leaves it to Triton (one program per SM)."""
        if self.ctas_per_sm == 1:
            return None
        return REGISTER_FILE // (self.ctas_per_sm * 128 * (self.consumers + 1)) // 8 * 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value not in (16, 32, 64, 128, 256):
                raise ValueError(f"{name}: expected a power of two from 16 to 256, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1 to 8, got {self.num_stages}")
        if self.load not in LOADS:
            raise ValueError(f"load: expected one of {LOADS}, got {self.load!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {self.order!r}")
        if self.l2_share not in L2_SHARES:
            raise ValueError(f"l2_share: expected one of {L2_SHARES}, got {self.l2_share!r}")
        if self.order != "grouped" and self.l2_share != 2:
            raise ValueError(f"l2_share: a knob of order 'grouped'; order {self.order!r} keeps 2")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "ws":
            self._check_ws()
        else:
            fa2 = PrefillVariant.__dataclass_fields__
            for name in WS_KNOBS:
                if getattr(self, name) != fa2[name].default:
                    raise ValueError(f"{name}: a knob of schedule 'ws'; schedule 'fa2' keeps its default")

    def _check_ws(self) -> None:
        check_ws_knobs(self)
        for name in FA2_KNOBS:
            if getattr(self, name) != PrefillVariant.__dataclass_fields__[name].default:
                raise ValueError(f"{name}: a knob of schedule 'fa2'; schedule 'ws' keeps its default")


def _check_fp8(variant: PrefillVariant, problem: Problem, gpu: Gpu) -> None:
    """What an fp8 Problem adds: padded batches, bf16 output, key tiles of at least 32 (e4m3
    products need K >= 32 on NVIDIA GPUs; checked on every backend so that the interpreter runs
    only what a GPU can), tiles in one scale block, no mask_branch, a GPU with e4m3 tensor cores."""
    if problem.varlen:
        raise ValueError("problem.varlen: fp8 prefill takes (batch, heads, seqlen, head_dim) inputs")
    if problem.model_features:
        raise ValueError(f"problem: fp8 prefill renders no {sorted(problem.model_features)} in this release")
    if problem.dtype != "bfloat16":
        raise ValueError(f"problem.dtype: fp8 prefill writes bfloat16, got {problem.dtype}")
    if variant.block_n < 32:
        raise ValueError(f"variant.block_n: fp8 key tiles need at least 32 rows, got {variant.block_n}")
    if max(variant.block_m, variant.block_n) > SCALE_BLOCK:
        raise ValueError(
            f"variant.block_m, variant.block_n: fp8 tiles must lie in one {SCALE_BLOCK}-row scale block, "
            f"got {variant.block_m} x {variant.block_n}"
        )
    if variant.mask_branch:
        raise ValueError("variant.mask_branch: fp8 masks its scores after scaling them (a descale may be 0)")
    if variant.o_store == "q_slot":
        raise ValueError("variant.o_store: fp8's query slots hold e4m3 rows, too small for the bf16 output")
    if variant.q_regs:
        raise ValueError("variant.q_regs: fp8's scores' products take the query rows from shared memory")
    if gpu.backend == "cuda" and gpu.capability < (8, 9):
        raise ValueError(
            f"problem.fp8: e4m3 tensor-core products need compute capability 8.9 or newer, "
            f"{gpu.name} has {gpu.capability}"
        )


def fa2_default(problem: Problem, gpu: Gpu) -> PrefillVariant:
    """FlashAttention-2's loop as measured or guessed per GPU class and head dim: the default
    wherever schedule "ws" does not run or measured slower."""
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
        load = "desc" if problem.aligned and not problem.paged else "ptr"
        if problem.causal:
            return wide.replace(load=load, order="head_inner", reverse_m=True)
        return wide.replace(load=load)
    if d <= 64:
        # The features' extra loops spill 24-104 bytes a thread with 4 warps (sm_80, Triton 3.9).
        warps = 8 if problem.model_features else 4
        return PrefillVariant(block_m=128, block_n=64, num_warps=warps, num_stages=3)
    if d <= 128:
        return PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return PrefillVariant(block_m=64, block_n=32, num_warps=4, num_stages=2)


class PrefillFamily:
    name = "prefill"
    # Both schedules render all of them for 16-bit inputs (FlashAttention-2's loop for float32
    # too; the Hopper schedule's Variants as `check_ws_variant` says); FP8 refuses them (`_check_fp8`).
    model_features: ClassVar[frozenset[str]] = frozenset(MODEL_FEATURES)
    fp8_model_features: ClassVar[frozenset[str]] = frozenset()
    template = "attention_fwd.py.j2"
    variant_type = PrefillVariant
    conditions: ClassVar[dict[str, tuple[str, tuple]]] = {
        **{k: ("schedule", ("fa2",)) for k in FA2_KNOBS},
        **{k: ("schedule", ("ws",)) for k in WS_KNOBS if k not in ("pingpong", "ctas_per_sm")},
        # consumers is itself a knob of "ws" only; the persistent knobs' condition follows
        "pingpong": ("consumers", (2, 3)),
        "l2_share": ("order", ("grouped",)),
        # two programs per SM leave registers for one consumer each: asked only then (not
        # asked and refused, which cost a sixth of the tuner's asks)
        "ctas_per_sm": ("consumers", (1,)),
        **{k: ("persistent", (True,)) for k in PERSISTENT_KNOBS},
        "stream_k": ("dynamic", (True,)),
    }

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        interpreted = gpu.backend == "interpreter"
        return {
            "head_dim": problem.head_dim,
            "block_d": block_d(problem.head_dim, problem.fp8),
            "ws_block_d": ws_block_d(problem.head_dim, problem.fp8),
            "causal": problem.causal,
            "varlen": problem.varlen,
            "paged": problem.paged,
            "page_size": problem.page_size,
            "return_lse": problem.return_lse,
            "group": problem.group,
            "precision": dot_precision(problem),
            "upcast": interpreted and problem.dtype == "bfloat16",
            "fp8": problem.fp8,
            "emulate_fp8": interpreted and problem.fp8,
            "scale_block": SCALE_BLOCK if problem.fp8 else 0,
            "window_left": problem.window_left,
            "window_right": problem.window_right,
            "attention_chunk": problem.attention_chunk,
            "softcap": problem.softcap,
            "sinks": problem.sinks,
            "approx_tanh": approx_tanh(problem, gpu),
        }

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        if not isinstance(variant, PrefillVariant):
            raise ValueError(f"variant: expected a PrefillVariant, got {type(variant).__name__}")
        if variant.schedule == "ws":
            check_ws(problem, gpu)
            check_ws_variant(variant, problem)
        if variant.stream_k and (problem.causal or problem.fp8):
            raise ValueError(
                "variant.stream_k: cuts the last wave of 16-bit tiles without a causal mask (causal tiles "
                "differ in length, and the dynamic scheduler takes the longest first)"
            )
        if problem.fp8:
            _check_fp8(variant, problem, gpu)
        elif not variant.p_fp8 or variant.v_trans:
            raise ValueError("variant.p_fp8, variant.v_trans: FP8 knobs, for fp8 Problems only")
        if problem.paged:
            check_paged(variant, problem)
        if variant.load == "desc":
            check_descriptors(problem, gpu)

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        """The knobs the tuner searches and their values for this Problem on this Gpu, the
        schedule first (the knobs of one schedule apply only to it: see `conditions`).

        Knobs that cannot matter are pinned: the causal program order only for causal
        Problems, tensor descriptors only where the inputs and the GPU allow them, the Hopper
        schedule only where it runs.
        """
        if gpu.arch == "interpreter":
            tiles, warps, stages = [16, 32], [4], [1]
        else:
            tiles, warps, stages = [32, 64, 128], [4, 8], [2, 3, 4] + ([5] if problem.fp8 else [])
        loads = ["ptr"] if problem.paged else load_paths(problem, gpu)
        schedules = ["fa2", "ws"] if runs_ws(problem, gpu) else ["fa2"]
        space = {
            "schedule": schedules,
            "block_m": [t for t in tiles if t >= 16] if gpu.arch == "interpreter" else [64, 128],
            "block_n": [t for t in tiles if t >= 32] if problem.fp8 else tiles,
            "num_warps": warps,
            "num_stages": stages,
            "causal_split": [True],
            "load": loads,
            "order": list(ORDERS) if problem.causal or problem.local else ["m_inner"],
            "reverse_m": [False, True] if problem.causal else [False],
            "l2_share": [2, 8] if problem.causal else [2],
            "p_fp8": [True, False] if problem.fp8 else [True],
            "v_trans": [False, True] if problem.fp8 else [False],
        }
        if "ws" in schedules:
            # The stream-K tail: dense 16-bit prompts without a mask or features, in one part.
            tail = not (problem.causal or problem.fp8 or problem.model_features or problem.varlen)
            tail = tail and not ws_in_parts(problem)
            space.update(
                consumers=[1, 2, 3],
                pingpong=[False, True],
                overlap=[False, True],
                persistent=[False, True],
                producer_regs=[24, 40],
                ctas_per_sm=[1, 2],
                dynamic=[False, True],
                q_stages=[1, 2],
                mask_branch=[False] if problem.fp8 else [False, True],
                o_store=["slot", "registers"] + ([] if problem.fp8 else ["q_slot"]),
                q_regs=[False] if problem.fp8 else [False, True],
                pv_pair=[False, True] if ws_in_parts(problem) else [False],
                stream_k=[False, True] if tail else [False],
            )
        return space

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
        if variant.schedule == "ws":
            return ws_constraint(variant, problem, gpu)
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

        The Hopper rows come from benchmarks/prefill_defaults.py on an H100 (bf16, the suite's
        N = 512 to 16384; see benchmarks/results/prefill_ws_h100.md and prefill_h100.md): the
        warp-specialized schedule wherever it runs and measured faster, FlashAttention-2's loop
        elsewhere. The other GPU classes' rows are conservative guesses.
        """
        ws = ws_default(problem, PrefillVariant, gpu)
        return ws if ws is not None else fa2_default(problem, gpu)

    def deterministic(self, variant: PrefillVariant, problem: Problem, gpu: Gpu) -> PrefillVariant:
        """Every prefill Variant gives the same bits on every run: no program adds into another's output."""
        return variant

    def measure(self, problem: Problem) -> tuple[str, float]:
        return "TFLOP/s", problem.flops()

    def case(self, problem: Problem, kernel: Any, device: Any, seed: int) -> Any:
        from tunegen.kernels.families.prefill_case import prefill_case

        return prefill_case(problem, kernel, device, seed)


FAMILY = PrefillFamily()
