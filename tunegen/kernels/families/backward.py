"""The backward family: gradients of prefill attention (dQ, dK, dV), in two schedules:
FlashAttention-2's loops in Triton (every GPU and the interpreter) and FlashAttention-3's
warp-specialized Hopper schedule in Gluon (sm_90)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunegen.kernels.families.backward_ws import (
    WS_KNOBS,
    check_ws_backward,
    consumer_registers,
    runs_ws_backward,
    ws_constraint,
    ws_default,
)
from tunegen.kernels.families.operands import (
    approx_tanh,
    block_d,
    check_descriptors,
    dot_precision,
    load_paths,
)
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import MODEL_FEATURES, Problem
from tunegen.kernels.variant import Variant

DQ_MODES = ("separate", "concurrent", "atomic", "partial")
LOADS = ("ptr", "desc")
ORDERS = ("natural", "heaviest_first")
SCHEDULES = ("loops", "ws")
LOOP_KNOBS = (
    "dq_block_m",
    "dq_block_n",
    "dq_mode",
    "dq_num_warps",
    "dq_num_stages",
    "fuse_delta",
    "load",
    "persistent",
)
TILES = (16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8, 16)
# Float32 accumulator and score values per thread past which a pass spills registers.
MAX_REGISTERS_PER_THREAD = 192
# The float32 slices of dQ that dq_mode "partial" keeps (one per tile of keys) may take this much.
PARTIAL_BYTES_MAX = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class BackwardVariant(Variant):
    """Knobs of templates/attention_bwd.py.j2 (its sections' glossaries say what each does).

    dkdv_block_m, dkdv_block_n, num_warps, num_stages: the dK/dV pass (the query tile walked, the
    key tile kept resident, Triton's launch knobs). dq_block_m, dq_block_n, dq_num_warps,
    dq_num_stages: the dQ pass (the query tile kept, the key tile walked, its launch knobs).
    dq_mode: "separate" (a dQ launch of its own), "concurrent" (dQ tiles in the dK/dV launch, with
    its warps and stages), "atomic" (the dK/dV programs add dQ into float32) or "partial" (each
    tile of keys stores its share of dQ, summed after). fuse_delta: the separate dQ pass computes
    delta (rowsum dO·O) itself and runs first, in place of the preprocess launch. load: "ptr" or
    "desc" (tensor descriptors: TMA on Hopper). order: "heaviest_first" runs the tiles with the
    most work under a causal mask first. persistent: one program per resident slot, looping.

    schedule: "loops" (the knobs above) or "ws", FlashAttention-3's warp-specialized Hopper
    schedule, which keeps a tile of dkdv_block_n keys per program and walks query tiles of
    dkdv_block_m rows (64 or 128 each) with num_warps / 4 consumer warpgroups (4 or 8 warps) and a
    ring of num_stages (2 to 4) Q and dO slots, in `order`; its own knobs: dq_write, "tma" (dQ
    added into float32 by a writer warp's TMA reduce-add from shared memory) or "atomic" (16-byte
    atomic reductions from the consumers' registers, into an accumulator laid out in their order);
    deterministic, the adds into each query tile take turns in key-tile order, so the same inputs
    give the same bits; producer_regs, the registers per thread of the
    TMA producer warp and of the dQ writer (the consumers share the rest); kv_regs, K and V held
    in registers as the left operands of Sᵀ and dPᵀ rather than read from shared memory every step
    (the walk is bound by shared-memory bandwidth; head dim 64 has the registers); split_tail,
    without a causal mask, the key tiles past the last whole wave of resident programs shared out
    stream-K style as equal runs of their steps over a wave of programs, whose partial dK and dV
    the program starting each tile sums (no SM idles while the last tiles finish);
    split_warpgroups, two consumer warpgroups as two partitions of their own that meet once a
    step over dSᵀ, rather than one partition of 8 warps whose barriers hold both; paired_walk
    (one partition), query tiles walked in pairs over two dSᵀ allocations and ring slots released
    by every consumer thread, so that one CTA barrier is left in a step. Knobs that do
    not apply to a schedule keep their defaults, so that two different Variants are always two
    different kernels.
    """

    family: ClassVar[str] = "backward"

    dkdv_block_m: int = 32
    dkdv_block_n: int = 64
    dq_block_m: int = 64
    dq_block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    dq_mode: str = "separate"
    dq_num_warps: int = 4
    dq_num_stages: int = 2
    fuse_delta: bool = False
    load: str = "ptr"
    order: str = "natural"
    persistent: bool = False
    schedule: str = "loops"
    dq_write: str = "tma"
    deterministic: bool = False
    producer_regs: int = 24
    kv_regs: bool = False
    split_tail: bool = False
    split_warpgroups: bool = False
    paired_walk: bool = False

    @property
    def consumer_regs(self) -> int:
        """Registers per thread of each consumer warpgroup with schedule "ws"
        (`backward_ws.consumer_registers`)."""
        return consumer_registers(self)

    def __post_init__(self) -> None:
        for name in ("dkdv_block_m", "dkdv_block_n", "dq_block_m", "dq_block_n"):
            if getattr(self, name) not in TILES:
                raise ValueError(f"{name}: expected a power of two from 16 to 256, got {getattr(self, name)}")
        for name in ("num_warps", "dq_num_warps"):
            if getattr(self, name) not in WARPS:
                raise ValueError(f"{name}: expected 1, 2, 4, 8 or 16, got {getattr(self, name)}")
        for name in ("num_stages", "dq_num_stages"):
            if not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"{name}: expected 1 to 8, got {getattr(self, name)}")
        for name, allowed in (
            ("dq_mode", DQ_MODES),
            ("load", LOADS),
            ("order", ORDERS),
            ("schedule", SCHEDULES),
            ("dq_write", ("tma", "atomic")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.fuse_delta and self.dq_mode != "separate":
            raise ValueError(
                f"fuse_delta: the dQ pass computes delta only in its own launch before the dK/dV "
                f"pass (dq_mode 'separate'), not with dq_mode {self.dq_mode!r}"
            )
        fields = BackwardVariant.__dataclass_fields__
        kept, schedule = (LOOP_KNOBS, "loops") if self.schedule == "ws" else (WS_KNOBS, "ws")
        for name in kept:
            if getattr(self, name) != fields[name].default:
                raise ValueError(
                    f"{name}: a knob of schedule {schedule!r}; schedule {self.schedule!r} keeps its default"
                )
        if self.schedule == "ws":
            self._check_ws()

    def _check_ws(self) -> None:
        if self.dkdv_block_m not in (64, 128) or self.dkdv_block_n not in (64, 128):
            raise ValueError(
                f"dkdv_block_m, dkdv_block_n: schedule 'ws' takes 64 or 128 of each, "
                f"got {self.dkdv_block_m} x {self.dkdv_block_n}"
            )
        if self.num_warps not in (4, 8):
            raise ValueError(
                f"num_warps: schedule 'ws' takes 4 or 8 (one or two warpgroups), got {self.num_warps}"
            )
        if self.dkdv_block_n < 16 * self.num_warps:
            raise ValueError(
                f"dkdv_block_n: each of {self.num_warps // 4} warpgroups takes 64 keys at least, "
                f"got {self.dkdv_block_n}"
            )
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"num_stages: schedule 'ws' takes a ring of 2 to 4 slots, got {self.num_stages}")
        if self.producer_regs not in (24, 32, 40):
            raise ValueError(f"producer_regs: expected 24, 32 or 40, got {self.producer_regs}")
        if self.split_warpgroups and self.num_warps != 8:
            raise ValueError(
                f"split_warpgroups: splits two consumer warpgroups (num_warps 8), "
                f"got num_warps {self.num_warps}"
            )
        if self.paired_walk and self.split_warpgroups:
            raise ValueError(
                "paired_walk: pairs the steps of one consumer partition, whose barriers split_warpgroups "
                "already splits; choose one"
            )
        if self.split_tail and self.deterministic:
            raise ValueError(
                "split_tail: deterministic adds take turns in key-tile order, which a split tail's "
                "programs do not walk in; choose one"
            )


def loops_default(problem: Problem, gpu: Gpu) -> BackwardVariant:
    """FlashAttention-2's loops, hand-picked per GPU class and head dim: the default wherever the
    Hopper schedule does not run.

    Hopper, from benchmarks/backward_defaults.py on an H100 (bf16, N = 1k, 4k and 16k; see
    benchmarks/results/backward_h100.md): FlexAttention's tiles (64 x 128 for dK/dV, 128 x 64
    for dQ, 8 warps, 3 stages, pointer loads) at head dim 128 and for causal head dim 64;
    64 x 64 tiles with 4 warps through tensor descriptors for non-causal head dim 64; at head
    dim 256, 64 x 64 and 128 x 32 with 8 warps and 2 stages through descriptors (the first
    spills a little, and still ran 1.4x the spill-free 32 x 64). The rest are conservative
    choices that fit the shared memory and registers of their class.
    """
    d = block_d(problem.head_dim)
    if gpu.arch == "interpreter" or problem.dtype == "float32":
        return BackwardVariant(32, 32, 32, 32, num_warps=4, num_stages=1, dq_num_warps=4, dq_num_stages=1)
    if gpu.arch in ("hopper", "blackwell"):
        load = "desc" if problem.aligned else "ptr"
        if d <= 64 and not problem.causal:
            return BackwardVariant(64, 64, 64, 64, 4, 3, dq_num_warps=4, dq_num_stages=3, load=load)
        if d <= 128:
            return BackwardVariant(64, 128, 128, 64, 8, 3, dq_num_warps=8, dq_num_stages=3)
        return BackwardVariant(64, 64, 128, 32, 8, 2, dq_num_warps=8, dq_num_stages=2, load=load)
    warps = 4 if d <= 128 else 8
    return BackwardVariant(32, 64, 64, 32, warps, 2, dq_num_warps=warps, dq_num_stages=2)


class BackwardFamily:
    name = "backward"
    # Both schedules render all of them.
    model_features: ClassVar[frozenset[str]] = frozenset(MODEL_FEATURES)
    fp8_model_features: ClassVar[frozenset[str]] = frozenset()  # no FP8 backward
    template = "attention_bwd.py.j2"
    variant_type = BackwardVariant
    conditions: ClassVar[dict[str, tuple[str, tuple]]] = {
        **{k: ("schedule", ("loops",)) for k in ("dq_mode", "load", "persistent")},
        **{k: ("schedule", ("ws",)) for k in WS_KNOBS},
        "dq_block_m": ("dq_mode", ("separate", "concurrent")),
        "dq_block_n": ("dq_mode", ("separate", "concurrent")),
        "dq_num_warps": ("dq_mode", ("separate",)),
        "dq_num_stages": ("dq_mode", ("separate",)),
        "fuse_delta": ("dq_mode", ("separate",)),
    }

    def features(self, problem: Problem, gpu: Gpu) -> dict[str, Any]:
        """The template's features; those of current models (`MODEL_FEATURES`) only where the
        Problem has some, so that a plain Problem renders as it did before they existed."""
        features = {
            "head_dim": problem.head_dim,
            "block_d": block_d(problem.head_dim),
            "causal": problem.causal,
            "varlen": problem.varlen,
            "group": problem.group,
            "precision": dot_precision(problem),
            "upcast": gpu.backend == "interpreter" and problem.dtype == "bfloat16",
        }
        if problem.model_features:
            features.update({name: getattr(problem, name) for name in MODEL_FEATURES})
            features["approx_tanh"] = approx_tanh(problem, gpu)
        return features

    def check_variant(self, variant: Variant, problem: Problem, gpu: Gpu) -> None:
        if not isinstance(variant, BackwardVariant):
            raise ValueError(f"variant: expected a BackwardVariant, got {type(variant).__name__}")
        if variant.schedule == "ws":
            check_ws_backward(problem, gpu)
        if variant.load == "desc":
            check_descriptors(problem, gpu)

    def search_space(self, problem: Problem, gpu: Gpu) -> dict[str, list]:
        """The knobs the tuner searches, the schedule first, then dq_mode (the dQ pass's knobs apply
        only where it has one; each schedule's own knobs only to it: see `conditions`). The Hopper
        schedule joins where it runs; deterministic adds are a user's choice, never searched. Each
        loop pass keeps one tile resident and walks the other: the dK/dV pass a tall key tile over
        short query tiles, the dQ pass the reverse (as in
        FlashAttention-2), so resident and walked sizes are two lists. Knobs that cannot matter
        are pinned: the program order for non-causal Problems, descriptors where the inputs or the
        GPU do not allow them."""
        if gpu.arch == "interpreter":
            resident, walked, warps, stages = [16, 32], [16, 32], [4], [1]
        elif problem.dtype == "float32":
            resident, walked, warps, stages = [32, 64], [16, 32], [4, 8], [1, 2, 3]
        else:
            resident, walked, warps, stages = [64, 128], [32, 64], [4, 8], [1, 2, 3, 4]
        loads = load_paths(problem, gpu)
        schedules = ["loops", "ws"] if runs_ws_backward(problem, gpu) else ["loops"]
        space: dict[str, list] = {
            "schedule": schedules,
            "dq_mode": list(DQ_MODES),
            "dkdv_block_m": walked if schedules == ["loops"] else sorted({*walked, 64, 128}),
            "dkdv_block_n": resident,
            "num_warps": warps,
            "num_stages": stages,
            "dq_block_m": resident,
            "dq_block_n": walked,
            "dq_num_warps": warps,
            "dq_num_stages": stages,
            "fuse_delta": [False, True],
            "load": loads,
            "order": list(ORDERS) if problem.causal else ["natural"],
            "persistent": [False, True],
        }
        if "ws" in schedules:
            space.update(
                dq_write=["tma", "atomic"],
                deterministic=[False],
                producer_regs=[24, 40],
                kv_regs=[False, True],
                split_tail=[False] if problem.causal or problem.local else [False, True],
                split_warpgroups=[False, True],
                paired_walk=[False, True],
            )
        return space

    def constraint(self, variant: BackwardVariant, problem: Problem, gpu: Gpu) -> str | None:
        """Why `variant` should not be compiled for `problem` on `gpu`; None if it may.

        Shared memory, per pass: the resident tiles plus `num_stages` buffers of the two walked
        tiles (and, with dQ in the dK/dV pass, the transposed dS and the float32 dQ tile).
        Registers, per pass: the float32 accumulators (dK and dV, or dQ) and two score tiles (three
        with softcap, whose tanh dS needs) spread over the threads; past 192 per thread ptxas
        spills (calibrated on sm_90 compiles: 320 spilled 3.3 KB, 160 to 192 spilled at most 60
        bytes). A concurrent launch runs both passes with the dK/dV pass's warps and stages.
        "partial" keeps a float32 dQ per tile of keys: at most PARTIAL_BYTES_MAX of them.
        """
        try:
            self.check_variant(variant, problem, gpu)
        except ValueError as exc:
            return str(exc)
        if variant.schedule == "ws":
            return ws_constraint(variant, problem, gpu)
        if variant.dq_mode == "partial":
            slices = -(-problem.seqlen_k // variant.dkdv_block_n)
            size = slices * problem.batch * problem.num_heads_q * problem.seqlen_q * problem.head_dim * 4
            if size > PARTIAL_BYTES_MAX:
                return f"dq_mode: 'partial' would keep {size / 2**30:.1f} GiB of float32 dQ slices"
        if gpu.arch == "interpreter":
            return None
        d = block_d(problem.head_dim)
        size = 4 if problem.dtype == "float32" else 2
        in_dkdv = variant.dq_mode in ("atomic", "partial")
        dkdv = ("dK/dV", variant.dkdv_block_n, variant.dkdv_block_m, 2, variant.num_warps, variant.num_stages)
        passes = [dkdv]
        if variant.dq_mode in ("separate", "concurrent"):
            own = variant.dq_mode == "separate"
            warps = variant.dq_num_warps if own else variant.num_warps
            stages = variant.dq_num_stages if own else variant.num_stages
            passes.append(("dQ", variant.dq_block_m, variant.dq_block_n, 1, warps, stages))
        for name, resident, walked, accumulators, warps, stages in passes:
            smem = (2 * resident + stages * 2 * walked) * d * size
            if in_dkdv:
                smem += walked * resident * size + walked * d * 4
            if smem > gpu.smem_per_block:
                return (
                    f"shared memory: the {name} pass needs about {smem} bytes, "
                    f"{gpu.name} has {gpu.smem_per_block} per block"
                )
            scores = 3 if problem.softcap else 2
            registers = (accumulators * resident * d + scores * resident * walked) // (warps * 32)
            if registers > MAX_REGISTERS_PER_THREAD:
                return f"registers: the {name} pass holds about {registers} float32 values per thread"
        return None

    def default_variant(self, problem: Problem, gpu: Gpu) -> BackwardVariant:
        """Until tuned Winners exist: the Hopper schedule wherever it runs (`ws_default`), else
        FlashAttention-2's loops (`loops_default`)."""
        if runs_ws_backward(problem, gpu):
            return ws_default(problem, BackwardVariant, gpu)
        return loops_default(problem, gpu)

    def deterministic(self, variant: BackwardVariant, problem: Problem, gpu: Gpu) -> BackwardVariant:
        """dQ added in a fixed order: the Hopper schedule's adds take turns in key-tile order (over
        whole tiles: no split tail), by the writer warp's TMA reduce-add (1.3-1.6x the consumers'
        own reductions, which wait for their turns where the writer warp waits for them:
        benchmarks/results/issue30_h100.md) unless its shared-memory tile would not fit, the
        loops' atomic dQ becomes a pass of its own
        (the other dQ modes own their tiles of dQ), or where that pass's tiles would not fit, the
        loops' default."""
        if variant.schedule == "ws":
            writer = variant.replace(deterministic=True, dq_write="tma", split_tail=False)
            fits = self.constraint(writer, problem, gpu) is None
            return writer if fits else variant.replace(deterministic=True, split_tail=False)
        if variant.dq_mode != "atomic":
            return variant
        separate = variant.replace(dq_mode="separate")
        return separate if self.constraint(separate, problem, gpu) is None else loops_default(problem, gpu)

    def measure(self, problem: Problem) -> tuple[str, float]:
        """FLOPs as FlashAttention counts the backward: 2.5 times the forward's."""
        return "TFLOP/s", 2.5 * problem.flops()

    def case(self, problem: Problem, kernel: Any, device: Any, seed: int) -> Any:
        from tunegen.kernels.families.backward_case import backward_case

        return backward_case(problem, kernel, device, seed)


FAMILY = BackwardFamily()
