"""The backward family's Hopper schedule ("ws"): its knobs, space and defaults (CPU; where it runs
and its constraint are tested with the prefill schedule's in test_prefill_ws.py); on an sm_90 GPU
every knob against float64 gradients at ragged sizes with GQA, both causal alignments and a
log-sum-exp gradient, into poisoned gradients, and deterministic runs giving the same bits.

Gluon kernels do not run under Triton's interpreter, so the CPU checks stop at the Variant, the
family's rules and the offline sm_90 compile (test_compile.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from helpers import H100, HOPPER, assert_grads, qkv_dout, reference_grads, run_backward_variant, ws_shapes
from tunegen.kernels.families import backward, base
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference

Variant = backward.BackwardVariant
WS = Variant(64, 128, num_warps=8, num_stages=2, schedule="ws")
INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
PROBLEM = Problem("backward", "bfloat16", 128, True, 16, 4, 2, 4096, 4096)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dkdv_block_m": 32}, "schedule 'ws' takes 64 or 128 of each"),
        ({"num_warps": 2}, "num_warps: schedule 'ws' takes 4 or 8"),
        ({"dkdv_block_n": 64}, "each of 2 warpgroups takes 64 keys at least"),
        ({"num_stages": 1}, "num_stages: schedule 'ws' takes a ring of 2 to 4"),
        ({"producer_regs": 48}, "producer_regs: expected 24, 32 or 40"),
        ({"dq_mode": "atomic"}, "dq_mode: a knob of schedule 'loops'"),
        ({"load": "desc"}, "load: a knob of schedule 'loops'"),
        ({"schedule": "fa3"}, "schedule: expected one of"),
        ({"dq_write": "store"}, "dq_write: expected one of"),
        ({"split_tail": True, "deterministic": True}, "split_tail: deterministic adds take turns"),
        ({"split_warpgroups": True, "num_warps": 4, "dkdv_block_n": 64}, "split_warpgroups: splits two"),
        ({"paired_walk": True, "split_warpgroups": True}, "paired_walk: pairs the steps of one"),
    ],
)
def test_ws_variant_rejects_knobs_that_do_not_apply(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(WS, **changes)


def test_loop_variants_keep_the_ws_knobs_at_their_defaults():
    with pytest.raises(ValueError, match="dq_write: a knob of schedule 'ws'"):
        Variant(dq_write="atomic")
    with pytest.raises(ValueError, match="deterministic: a knob of schedule 'ws'"):
        Variant(deterministic=True)
    assert Variant().schedule == "loops" and backward.FAMILY.constraint(WS, PROBLEM, H100) is None


def test_ws_space_on_hopper_only_and_searched_apart_from_the_loops():
    space = backward.FAMILY.search_space(PROBLEM, H100)
    assert space["schedule"] == ["loops", "ws"] and space["deterministic"] == [False]
    assert space["split_warpgroups"] == [False, True] and space["paired_walk"] == [False, True]
    assert backward.FAMILY.search_space(PROBLEM, interpreter_gpu())["schedule"] == ["loops"]
    ws = base.choose(backward.FAMILY, space, lambda name, values: values[-1])
    assert ws["schedule"] == "ws" and "dq_mode" not in ws and "dq_block_m" not in ws and "load" not in ws
    loops = base.choose(backward.FAMILY, space, lambda name, values: values[0])
    assert "dq_write" not in loops and loops["dq_block_m"] == space["dq_block_m"][0]


def test_split_tail_only_without_a_causal_mask_and_never_in_fixed_order():
    """A causal walk gives key tiles different lengths, which equal runs of steps cannot share;
    the fixed-order form takes whole tiles in key-tile order."""
    split = WS.replace(split_tail=True)
    assert "split_tail: under a causal mask" in backward.FAMILY.constraint(split, PROBLEM, H100)
    full = dataclasses.replace(PROBLEM, causal=False)
    assert backward.FAMILY.constraint(split, full, H100) is None
    assert backward.FAMILY.search_space(full, H100)["split_tail"] == [False, True]
    assert backward.FAMILY.search_space(PROBLEM, H100)["split_tail"] == [False]
    fixed = backward.FAMILY.deterministic(split, full, H100)
    assert fixed.deterministic and not fixed.split_tail


def test_ws_is_the_hopper_default_where_it_runs():
    assert backward.FAMILY.default_variant(PROBLEM, H100).schedule == "ws"
    d96 = dataclasses.replace(PROBLEM, head_dim=96)
    assert backward.FAMILY.default_variant(d96, H100).schedule == "loops"
    # Head dim 256 runs the forward's Hopper schedule, not the backward's.
    d256 = dataclasses.replace(PROBLEM, head_dim=256)
    assert backward.FAMILY.default_variant(d256, H100).schedule == "loops"
    assert "ws" not in backward.FAMILY.search_space(d256, H100)["schedule"]
    for d in (64, 128):
        problem = dataclasses.replace(PROBLEM, head_dim=d)
        assert (
            backward.FAMILY.constraint(backward.FAMILY.default_variant(problem, H100), problem, H100) is None
        )


def test_ws_default_adds_dq_from_registers_and_deterministic_takes_the_writer_warp():
    """The default adds dQ by the consumers' vector reductions; the fixed-order form moves the adds
    to the writer warp, which waits for the turns in their place (measured faster)."""
    for d in (64, 128):
        problem = dataclasses.replace(PROBLEM, head_dim=d)
        default = backward.FAMILY.default_variant(problem, H100)
        assert default.dq_write == "atomic" and not default.deterministic
        fixed = backward.FAMILY.deterministic(default, problem, H100)
        assert (fixed.dq_write, fixed.deterministic) == ("tma", True)
        assert fixed.replace(dq_write="atomic", deterministic=False) == default
    # A ring of four slots leaves no room for the writer's float32 tile: the reductions take turns.
    deep = default.replace(num_stages=4)
    assert backward.FAMILY.constraint(deep, PROBLEM, H100) is None
    assert backward.FAMILY.constraint(deep.replace(dq_write="tma"), PROBLEM, H100) is not None
    assert backward.FAMILY.deterministic(deep, PROBLEM, H100) == deep.replace(deterministic=True)


def test_ws_default_follows_the_release_it_was_measured_on():
    """From Triton 3.7 on, a table of its own (a third slot without a causal mask, the writer warp
    under one at head dim 128), and from 3.9 each consumer warpgroup a partition of its own; 3.6
    keeps its own; before 3.9 head dim 64 walks in pairs; every default and its fixed-order form
    fit."""
    later = {(64, False): ("atomic", 3), (64, True): ("atomic", 2), (128, False): ("atomic", 3)}
    later[128, True] = ("tma", 2)
    tables = {"3.6.0": dict.fromkeys(later, ("atomic", 2)), "3.7.1": later, "3.9.0": later}
    for version, expected in tables.items():
        gpu = dataclasses.replace(H100, triton_version=version)
        for (d, causal), (dq_write, stages) in expected.items():
            problem = dataclasses.replace(PROBLEM, head_dim=d, causal=causal)
            default = backward.FAMILY.default_variant(problem, gpu)
            assert (default.dq_write, default.num_stages, default.kv_regs) == (dq_write, stages, d == 64)
            assert default.split_warpgroups == (version == "3.9.0")
            assert default.paired_walk == (version != "3.9.0" and d == 64)
            fixed = backward.FAMILY.deterministic(default, problem, gpu)
            assert fixed.dq_write == "tma" and fixed.deterministic
            assert fixed.split_warpgroups == default.split_warpgroups
            for variant in (default, fixed):
                assert backward.FAMILY.constraint(variant, problem, gpu) is None


# --- on the GPU -----------------------------------------------------------------------------

KNOBS = [
    WS.replace(**knobs)
    for knobs in (
        {},
        {"num_stages": 3},
        {"dq_write": "atomic"},
        {"deterministic": True},
        {"dq_write": "atomic", "deterministic": True},
        {"order": "heaviest_first", "producer_regs": 40},
        {"num_warps": 4, "dkdv_block_n": 64},
        {"dkdv_block_m": 128, "num_warps": 4, "dkdv_block_n": 64},
        {"num_warps": 4, "dkdv_block_n": 64, "dq_write": "atomic"},
        {"kv_regs": True, "dq_write": "atomic"},
        {"kv_regs": True},
        {"split_tail": True},
        {"split_tail": True, "dq_write": "atomic", "num_stages": 3},
        {"split_tail": True, "dq_write": "atomic", "kv_regs": True},
        {"split_warpgroups": True},
        {"split_warpgroups": True, "dq_write": "atomic", "kv_regs": True},
        {"split_warpgroups": True, "deterministic": True, "order": "heaviest_first"},
        {"split_warpgroups": True, "dq_write": "atomic", "deterministic": True},
        {"split_warpgroups": True, "split_tail": True, "dq_write": "atomic", "num_stages": 3},
        {"paired_walk": True},
        {"paired_walk": True, "dq_write": "atomic", "kv_regs": True},
        {"paired_walk": True, "deterministic": True, "order": "heaviest_first", "num_stages": 3},
        {"paired_walk": True, "dq_write": "atomic", "deterministic": True},
        {"paired_walk": True, "num_warps": 4, "dkdv_block_n": 64, "dq_write": "atomic"},
        {"paired_walk": True, "split_tail": True, "dq_write": "atomic", "kv_regs": True},
    )
]


@pytest.mark.parametrize("variant", KNOBS, ids=lambda v: v.to_json())
@ws_shapes
def test_every_ws_knob_against_float64(variant, causal, nq, nk, d):
    """Ragged lengths (no multiple of any tile), GQA, batch 2, both causal alignments (with nq >
    nk, queries that see no key), a gradient of the log-sum-exp too."""
    problem = dataclasses.replace(PROBLEM, head_dim=d, causal=causal)
    if backward.FAMILY.constraint(variant, problem, INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    q, k, v, dout = qkv_dout(2, 4, 2, nq, nk, d, torch.bfloat16, "cuda", seed=nq + nk + d)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(nq)).cuda()
    grads = run_backward_variant(variant, q, k, v, dout, causal=causal, scale=0.3, dlse=dlse)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=0.3)
    assert_grads(grads, reference_grads(forward, (q, k, v), dout, dlse), torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "nq", "nk", "dtype"),
    [
        (3, 8, 8, 1000, 1000, torch.float16),  # MHA, fp16
        (1, 6, 1, 2049, 2049, torch.bfloat16),  # MQA, longer than a few tiles
        (4, 4, 2, 17, 17, torch.bfloat16),  # shorter than any tile
    ],
)
def test_ws_shapes_against_float64(batch, hq, hkv, nq, nk, dtype):
    for causal in (False, True):
        q, k, v, dout = qkv_dout(batch, hq, hkv, nq, nk, 128, dtype, "cuda", seed=batch + nq)
        grads = run_backward_variant(WS, q, k, v, dout, causal=causal, scale=128**-0.5)
        forward = lambda q, k, v, causal=causal: attention_reference(q, k, v, causal=causal, scale=128**-0.5)
        assert_grads(grads, reference_grads(forward, (q, k, v), dout), dtype)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "n"),
    [
        (4, 8, 4, 2100),  # more tiles than an H100's 132 programs; each tail tile shared by two runs
        (2, 4, 2, 4500),  # 53 runs over 12 tiles, crossing from one tile into the next
        (1, 4, 1, 1500),  # fewer tiles than programs, each shared by three runs across query heads
    ],
)
def test_split_tail_against_float64_twice_on_one_stream(batch, hq, hkv, n, d):
    """The split tail's tiles against float64 for each dQ path and warpgroup count (in one partition
    or two), in two launches
    on one stream: the second finds the tiles' counters zero again (the first reset each it
    counted on) and its scratch reused."""
    q, k, v, dout = qkv_dout(batch, hq, hkv, n, n, d, torch.bfloat16, "cuda", seed=n + d)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=False, scale=d**-0.5)
    expected = reference_grads(forward, (q, k, v), dout)
    for knobs in (
        {"dq_write": "atomic", "kv_regs": d == 64},
        {"dq_write": "tma", "num_stages": 3},
        {"num_warps": 4, "dkdv_block_n": 64, "producer_regs": 40},
        {"split_warpgroups": True, "dq_write": "atomic", "kv_regs": d == 64},
        {"split_warpgroups": True, "dq_write": "tma"},
        {"paired_walk": True, "dq_write": "atomic", "kv_regs": d == 64},
    ):
        variant = WS.replace(split_tail=True, **knobs)
        for _ in range(2):
            grads = run_backward_variant(variant, q, k, v, dout, causal=False, scale=d**-0.5)
            assert_grads(grads, expected, torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("walk", [{}, {"split_warpgroups": True}, {"paired_walk": True}], ids=str)
@pytest.mark.parametrize("dq_write", ["tma", "atomic"])
def test_deterministic_gradients_are_the_same_bits_every_run(dq_write, walk):
    """Many key tiles adding into each query tile, causal and not; ten runs, one result."""
    deterministic = WS.replace(dq_write=dq_write, deterministic=True, **walk)
    q, k, v, dout = qkv_dout(2, 4, 2, 1500, 1500, 128, torch.bfloat16, "cuda", seed=5)
    for causal in (False, True):
        first = run_backward_variant(deterministic, q, k, v, dout, causal=causal, scale=0.1)
        for _ in range(9):
            again = run_backward_variant(deterministic, q, k, v, dout, causal=causal, scale=0.1)
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
