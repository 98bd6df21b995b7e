"""The Hopper schedule ("ws") of the prefill family: where it runs and where it refuses (CPU), and
on an sm_90 GPU every knob and feature against float64 at ragged sizes, into poisoned outputs.

Gluon kernels do not run under Triton's interpreter, so the CPU checks stop at the Variant, the
family's rules and the offline sm_90 compile (tests/test_compile.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

import tunegen
from helpers import H100, HOPPER, REL_TOL, assert_lse, randn, rel_err, run_variant, ws_shapes
from tunegen.kernels.families import backward, base, prefill
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference

WS = prefill.PrefillVariant(
    schedule="ws", block_m=64, block_n=128, num_stages=2, consumers=2, pingpong=True, overlap=True
)
# The GPU tests run what the installed release admits (tunegen.kernels.releases).
INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
PROBLEM = Problem("prefill", "bfloat16", 128, True, 16, 4, 2, 4096, 4096)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_m": 32}, "block_m: schedule 'ws' takes 64 or 128"),
        ({"num_warps": 8}, "num_warps: schedule 'ws' takes 4"),
        ({"num_stages": 1}, "num_stages: schedule 'ws' takes a ring of 2 to 4"),
        ({"consumers": 4}, "consumers: expected 1, 2 or 3"),
        ({"consumers": 1}, "pingpong: consumers take turns"),
        ({"producer_regs": 48}, "producer_regs: expected 24, 32, 40 or 56"),
        ({"load": "desc"}, "load: a knob of schedule 'fa2'"),
        ({"schedule": "fa3"}, "schedule: expected one of"),
        ({"ctas_per_sm": 2}, "ctas_per_sm: two programs per SM leave registers for one consumer"),
        ({"dynamic": True}, "dynamic: a scheduler of persistent programs"),
        ({"q_stages": 2}, "q_stages: a second query slot serves a program's next tile"),
        ({"persistent": True, "q_stages": 3}, "q_stages: expected 1 or 2"),
        ({"o_store": "smem"}, "o_store: expected one of"),
    ],
)
def test_ws_variant_rejects_knobs_that_do_not_apply(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(WS, **changes)


def test_fp8_keeps_the_output_out_of_its_query_slots():
    problem = dataclasses.replace(PROBLEM, fp8=True)
    with pytest.raises(ValueError, match="o_store: fp8's query slots hold e4m3 rows"):
        prefill.FAMILY.check_variant(dataclasses.replace(WS, o_store="q_slot"), problem, H100)
    assert prefill.FAMILY.search_space(problem, H100)["o_store"] == ["slot", "registers"]
    assert prefill.FAMILY.search_space(PROBLEM, H100)["o_store"] == ["slot", "registers", "q_slot"]


def test_fa2_variants_keep_the_ws_knobs_at_their_defaults():
    with pytest.raises(ValueError, match="consumers: a knob of schedule 'ws'"):
        prefill.PrefillVariant(consumers=2)
    assert WS.consumer_regs == 240 and dataclasses.replace(WS, producer_regs=40).consumer_regs == 232
    assert prefill.PrefillVariant().overlap is False, "ws knobs default off, as fa2 Variants keep them"
    assert dataclasses.replace(WS, consumers=1, pingpong=False).consumer_regs == 256
    assert dataclasses.replace(WS, consumers=3).consumer_regs == 160
    two = dataclasses.replace(WS, consumers=1, pingpong=False, ctas_per_sm=2)
    assert (two.consumer_regs, two.maxnreg, WS.maxnreg) == (232, 128, None)


# Both families' Hopper schedules run where `check_ws` says, and name their other schedule.
WS_FAMILIES = {
    "prefill": (prefill.FAMILY, WS, "fa2"),
    "backward": (backward.FAMILY, backward.BackwardVariant(64, 128, num_warps=8, schedule="ws"), "loops"),
}


@pytest.mark.parametrize("family_name", list(WS_FAMILIES))
@pytest.mark.parametrize(
    ("problem", "gpu", "message"),
    [
        (PROBLEM, interpreter_gpu(), "needs a Hopper GPU \\(sm_90\\), not Triton's interpreter"),
        (PROBLEM, dataclasses.replace(H100, name="A100", capability=(8, 0)), "not A100 \\(8, 0\\)"),
        (PROBLEM, dataclasses.replace(H100, capability=(10, 0)), "needs a Hopper GPU"),
        (PROBLEM, dataclasses.replace(H100, triton_version="3.5.1"), "Triton >= 3.6, not 3.5"),
        (dataclasses.replace(PROBLEM, dtype="float32"), H100, "takes float16 or bfloat16"),
        (
            dataclasses.replace(PROBLEM, head_dim=72),
            H100,
            "head dims {dims}, got 72 \\('{other}' runs",
        ),
        (dataclasses.replace(PROBLEM, aligned=False), H100, "16-byte aligned"),
    ],
)
def test_ws_refuses_what_it_cannot_run_by_name(family_name, problem, gpu, message):
    family, variant, other = WS_FAMILIES[family_name]
    problem = dataclasses.replace(problem, family=family_name)
    dims = "64 to 256 in steps of 16" if family_name == "prefill" else "\\(64, 128\\)"
    with pytest.raises(
        ValueError, match=r"variant\.schedule: 'ws' " + ".*" + message.format(other=other, dims=dims)
    ):
        family.check_variant(variant, problem, gpu)


def test_ws_space_on_hopper_only_and_searched_apart_from_fa2():
    space = prefill.FAMILY.search_space(PROBLEM, H100)
    assert space["schedule"] == ["fa2", "ws"] and space["consumers"] == [1, 2, 3]
    assert prefill.FAMILY.search_space(PROBLEM, interpreter_gpu())["schedule"] == ["fa2"]
    assert "consumers" not in prefill.FAMILY.search_space(dataclasses.replace(PROBLEM, head_dim=72), H100)
    assert "consumers" in prefill.FAMILY.search_space(dataclasses.replace(PROBLEM, head_dim=96), H100)
    picked = base.choose(prefill.FAMILY, space, lambda name, values: values[-1])
    assert picked["schedule"] == "ws" and "num_warps" not in picked and "load" not in picked
    fa2 = base.choose(prefill.FAMILY, space, lambda name, values: values[0])
    assert "consumers" not in fa2 and "pingpong" not in fa2 and fa2["num_warps"] == 4
    variants = list(base.grid(prefill.FAMILY, space))
    assert len(variants) == len(set(variants)), "the grid holds each Variant once"
    assert {v.schedule for v in variants} == {"fa2", "ws"}
    assert all(v.num_warps == 4 for v in variants if v.schedule == "ws")
    # two programs per SM only with one consumer each: the tuner never asks for what the
    # Variant itself refuses (each such ask was a wasted trial)
    for consumers in space["consumers"]:
        knobs = {"schedule": "ws", "consumers": consumers}
        picked = base.choose(
            prefill.FAMILY, space, lambda name, values, knobs=knobs: knobs.get(name, values[-1])
        )
        assert ("ctas_per_sm" in picked) == (consumers == 1)
        prefill.PrefillVariant(**picked)  # accepted


@pytest.mark.parametrize(
    ("family_name", "d", "changes", "reason"),
    [
        ("prefill", 128, {}, None),
        ("prefill", 64, {"consumers": 3, "overlap": False}, None),
        ("prefill", 64, {"consumers": 3}, "registers"),  # a second P tile does not fit in 160
        ("prefill", 64, {"consumers": 3, "block_n": 64}, None),
        ("prefill", 64, {"block_m": 128, "block_n": 64}, None),
        ("prefill", 128, {"consumers": 3}, "registers"),
        ("prefill", 64, {"block_m": 128}, "registers"),
        ("prefill", 128, {"block_m": 128, "consumers": 1, "pingpong": False}, "registers"),
        ("prefill", 128, {"num_stages": 3}, "shared memory"),
        ("prefill", 128, {"consumers": 1, "pingpong": False, "ctas_per_sm": 2}, "shared memory"),
        ("prefill", 128, {"consumers": 1, "pingpong": False, "ctas_per_sm": 2, "block_n": 64}, None),
        # Head dim 256: a ring of two 64-key blocks fits beside two consumers' query rows only
        # without the output's slot; 32-key blocks keep it.
        ("prefill", 256, {"block_n": 64, "o_store": "registers"}, None),
        ("prefill", 256, {"block_n": 64, "o_store": "registers", "pingpong": False, "overlap": False}, None),
        ("prefill", 256, {"block_n": 64}, "shared memory"),
        ("prefill", 256, {"block_n": 64, "o_store": "q_slot"}, None),
        ("prefill", 256, {"block_n": 64, "o_store": "registers", "num_stages": 3}, "shared memory"),
        ("prefill", 256, {"block_n": 32, "num_stages": 3}, None),
        ("prefill", 256, {"block_n": 128, "o_store": "registers", "overlap": False}, "shared memory"),
        ("prefill", 256, {"block_n": 64, "o_store": "registers", "consumers": 3}, "registers"),
        (
            "prefill",
            256,
            {"consumers": 1, "pingpong": False, "block_n": 64, "num_stages": 3, "o_store": "registers"},
            None,
        ),
        ("backward", 128, {}, None),
        ("backward", 128, {"num_stages": 3}, None),
        ("backward", 128, {"num_stages": 4}, "shared memory"),
        ("backward", 64, {"dkdv_block_m": 128}, "registers"),
        ("backward", 128, {"num_warps": 4, "dkdv_block_n": 64}, None),
        ("backward", 128, {"num_warps": 4}, "registers"),
        ("backward", 64, {"kv_regs": True}, None),
        ("backward", 128, {"kv_regs": True}, "registers"),
    ],
)
def test_ws_constraint_matches_what_sm90_compiles_without_spilling(family_name, d, changes, reason):
    """Calibrated on sm_90 compiles (tests/test_compile.py checks the accepted side)."""
    family, variant, _ = WS_FAMILIES[family_name]
    problem = dataclasses.replace(PROBLEM, family=family_name, head_dim=d)
    found = family.constraint(dataclasses.replace(variant, **changes), problem, H100)
    assert (found is None) if reason is None else (reason in found), found


# --- on the GPU -----------------------------------------------------------------------------

PAIR = dataclasses.replace(WS, consumers=1, pingpong=False, block_n=64, ctas_per_sm=2)

KNOBS = [
    WS,
    dataclasses.replace(WS, pingpong=False),
    dataclasses.replace(WS, overlap=False),
    dataclasses.replace(WS, consumers=1, pingpong=False),
    dataclasses.replace(WS, block_n=64, num_stages=3),
    dataclasses.replace(WS, persistent=True, order="grouped", reverse_m=True),
    dataclasses.replace(WS, persistent=True, order="head_inner"),
    dataclasses.replace(WS, consumers=3, block_n=64, producer_regs=40),
    dataclasses.replace(WS, consumers=3, overlap=False, order="grouped"),
    dataclasses.replace(WS, consumers=1, pingpong=False, block_n=64, ctas_per_sm=2, persistent=True),
    dataclasses.replace(WS, persistent=True, dynamic=True, order="head_inner", reverse_m=True),
    dataclasses.replace(WS, persistent=True, q_stages=2),
    dataclasses.replace(PAIR, persistent=True, dynamic=True),
    dataclasses.replace(PAIR, persistent=True, dynamic=True, q_stages=2, order="grouped", reverse_m=True),
    dataclasses.replace(WS, mask_branch=True),
    dataclasses.replace(WS, mask_branch=True, overlap=False, pingpong=False),
    dataclasses.replace(
        WS, mask_branch=True, consumers=3, block_n=64, persistent=True, dynamic=True, q_stages=2
    ),
    dataclasses.replace(PAIR, mask_branch=True, block_m=128, persistent=True, dynamic=True, q_stages=2),
    dataclasses.replace(WS, o_store="registers"),
    dataclasses.replace(WS, o_store="registers", persistent=True, dynamic=True, q_stages=2, order="grouped"),
    dataclasses.replace(WS, o_store="q_slot"),
    dataclasses.replace(WS, o_store="q_slot", persistent=True, dynamic=True, q_stages=2, order="grouped"),
    # The query rows from registers: the slot freed once read, or kept for the output.
    dataclasses.replace(WS, block_n=64, pingpong=False, overlap=False, q_regs=True),
    dataclasses.replace(
        WS, block_n=64, q_regs=True, o_store="q_slot", persistent=True, dynamic=True, order="grouped"
    ),
    dataclasses.replace(PAIR, q_regs=True, persistent=True, dynamic=True, q_stages=2, order="grouped"),
]


def _inputs(batch, hq, hkv, nq, nk, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (
        randn(batch, hq, nq, d, dtype=dtype, device="cuda", gen=gen),
        randn(batch, hkv, nk, d, dtype=dtype, device="cuda", gen=gen),
        randn(batch, hkv, nk, d, dtype=dtype, device="cuda", gen=gen),
    )


def _reference(q, k, v, causal, scale):
    """The float64 reference one sequence at a time: a batch's whole score matrix (8 GiB at 16 x 16
    heads x 2048) ran the GPU tests' workers out of memory beside each other."""
    parts = [
        attention_reference(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal=causal, scale=scale)
        for b in range(len(q))
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _check(variant, q, k, v, causal, scale=0.3, return_lse=True):
    out, lse = run_variant(variant, q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    ref, ref_lse = _reference(q, k, v, causal, scale)
    assert rel_err(out, ref) < REL_TOL[q.dtype]
    if return_lse:
        assert_lse(lse, ref_lse, q.dtype)
    return out


@pytest.mark.parametrize("variant", KNOBS, ids=lambda v: v.to_json())
@ws_shapes
def test_every_ws_knob_against_float64(variant, causal, nq, nk, d):
    """Ragged lengths (no multiple of any tile), GQA, batch 2, both causal alignments; queries
    that see no key (causal, nq > nk) must come out as zeros with a log-sum-exp of -inf."""
    if prefill.FAMILY.constraint(variant, dataclasses.replace(PROBLEM, head_dim=d), INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    q, k, v = _inputs(2, 4, 2, nq, nk, d, torch.bfloat16, seed=nq * 7 + nk + d)
    out = _check(variant, q, k, v, causal)
    if causal and nq > nk:
        assert torch.all(out[:, :, : nq - nk] == 0)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "nq", "nk", "dtype", "lse"),
    [
        (3, 8, 8, 1000, 1000, torch.float16, True),  # MHA, fp16
        (1, 6, 1, 4099, 4099, torch.bfloat16, False),  # MQA, no log-sum-exp, longer than a few tiles
        (4, 4, 2, 17, 17, torch.bfloat16, True),  # shorter than any tile
        (1, 2, 1, 64, 300, torch.float16, True),  # exactly one query tile, more keys
    ],
)
def test_ws_features_against_float64(batch, hq, hkv, nq, nk, dtype, lse):
    for causal in (False, True):
        q, k, v = _inputs(batch, hq, hkv, nq, nk, 128, dtype, seed=batch + nq)
        _check(WS, q, k, v, causal, return_lse=lse)


@pytest.mark.gpu
@HOPPER
def test_ws_strided_views_and_persistent_waves():
    """(B, N, H, D) storage seen as (B, H, N, D), K and V interleaved in one tensor, output in q's
    layout; a persistent grid with several tiles per SM, walked in a fixed stride or taken from
    the dynamic scheduler's counter, with one query slot per consumer or two."""
    gen = torch.Generator().manual_seed(11)
    q = randn(2, 777, 8, 128, dtype=torch.bfloat16, device="cuda", gen=gen).transpose(1, 2)
    kv = randn(2, 777, 2, 2, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    for variant in (WS, dataclasses.replace(WS, persistent=True)):
        out = _check(variant, q, k, v, causal=True)
        assert out.stride() == q.stride()
    q, k, v = _inputs(16, 16, 16, 2048, 2048, 64, torch.bfloat16, seed=12)  # 512 tiles on 132 SMs
    _check(dataclasses.replace(WS, persistent=True, consumers=3, block_n=64), q, k, v, causal=True)
    grouped = dataclasses.replace(WS, persistent=True, order="grouped", reverse_m=True)
    _check(grouped, q, k, v, causal=True)  # groups of 96 heads (50 MB L2) over 256: a partial last group
    three = dataclasses.replace(WS, persistent=True, consumers=3, block_n=64, order="head_inner", q_stages=2)
    for dynamic in (grouped, three):
        dynamic = dataclasses.replace(dynamic, dynamic=True)
        for _ in range(3):  # each launch takes its tiles from a counter of its own
            _check(dynamic, q, k, v, causal=True)


# Persistent programs, each walking several tiles: a fixed stride or the dynamic scheduler's
# counter, one query slot or two, with the other knobs their barriers meet.
SHORT = {"persistent": True, "dynamic": True, "q_stages": 2, "order": "grouped", "l2_share": 8}
PERSISTENT = [
    dataclasses.replace(WS, persistent=True),
    dataclasses.replace(WS, persistent=True, q_stages=2, overlap=False),
    dataclasses.replace(WS, persistent=True, dynamic=True, order="grouped", reverse_m=True),
    dataclasses.replace(WS, persistent=True, dynamic=True, q_stages=2, pingpong=False, num_stages=3),
    dataclasses.replace(WS, consumers=3, block_n=64, persistent=True, dynamic=True, q_stages=2, num_stages=4),
    dataclasses.replace(PAIR, persistent=True, q_stages=2, order="head_inner", reverse_m=True),
    dataclasses.replace(PAIR, persistent=True, dynamic=True, q_stages=2, order="grouped", reverse_m=True),
    dataclasses.replace(
        WS, persistent=True, dynamic=True, q_stages=2, order="grouped", reverse_m=True, mask_branch=True
    ),
    dataclasses.replace(
        WS, persistent=True, dynamic=True, q_stages=2, order="grouped", overlap=False, mask_branch=True
    ),
    dataclasses.replace(
        PAIR, block_m=128, num_stages=3, persistent=True, dynamic=True, q_stages=2, order="grouped"
    ),
    # The causal defaults' forms: turns, the 128-row consumer, two consumers apart (with overlap
    # past 2048 tokens at head dim 128).
    dataclasses.replace(WS, overlap=False, mask_branch=True, **SHORT),
    dataclasses.replace(
        WS, pingpong=False, persistent=True, dynamic=True, q_stages=2, order="grouped", reverse_m=True
    ),
    dataclasses.replace(PAIR, block_m=128, num_stages=3, **SHORT),
    dataclasses.replace(WS, pingpong=False, overlap=False, mask_branch=True, **SHORT),
    # The query rows in registers: their slot freed once read (one and two slots, the dynamic
    # scheduler's tile slot refilled behind it) or kept for the output; head dim 192's defaults.
    dataclasses.replace(
        WS, block_n=64, pingpong=False, overlap=False, q_regs=True, **{**SHORT, "q_stages": 1}
    ),
    dataclasses.replace(WS, block_n=64, pingpong=False, overlap=False, q_regs=True, **SHORT),
    dataclasses.replace(WS, block_n=64, pingpong=False, q_regs=True, o_store="registers", persistent=True),
    dataclasses.replace(WS, block_n=64, pingpong=False, q_regs=True, o_store="q_slot", **SHORT),
    dataclasses.replace(WS, block_n=64, pingpong=False, q_regs=True, pv_pair=True, o_store="q_slot", **SHORT),
    pytest.param(
        dataclasses.replace(PAIR, block_m=128, num_stages=3, persistent=True, dynamic=True, q_stages=2),
        marks=pytest.mark.xfail(
            reason="issue 31: with two programs per SM and order m_inner, causal queries past the keys "
            "(tiles that see no key) leave whole tiles unwritten now and then (H100, Triton 3.6); the "
            "family's constraint refuses the form under a causal mask",
            strict=False,
        ),
    ),
]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", PERSISTENT, ids=lambda v: v.to_json())
@pytest.mark.parametrize(("nq", "nk"), [(1100, 300), (1031, 1031)], ids=str)
@pytest.mark.parametrize("d", [64, 128, 192])
def test_persistent_programs_walk_many_tiles(variant, nq, nk, d):
    """8 sequences x 16 query heads (4 KV heads) of up to 18 tiles each: every program walks
    several, so the query slots, the barriers' phases and the slots freed across a tile boundary
    all turn over; causal with more queries than keys, the first tiles see no key at all."""
    if prefill.FAMILY.constraint(variant, dataclasses.replace(PROBLEM, head_dim=d), INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    q, k, v = _inputs(8, 16, 4, nq, nk, d, torch.bfloat16, seed=nq + nk + d)
    for causal in (False, True):
        out = _check(variant, q, k, v, causal)
        if causal and nq > nk:
            assert torch.all(out[:, :, : nq - nk] == 0)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("d", "dtype"),
    [
        (128, torch.bfloat16),
        (256, torch.bfloat16),
        (256, torch.float16),
        (96, torch.bfloat16),
        (192, torch.float16),
    ],
)
def test_public_call_serves_the_hopper_default(d, dtype):
    """tunegen.attention on an sm_90 GPU: whatever the defaults pick, the answer is right."""
    q, k, v = _inputs(2, 16, 4, 1500, 1500, d, dtype, seed=13 + d)
    for causal in (False, True):
        out, lse = tunegen.attention(q, k, v, causal=causal, return_lse=True, strict=True)
        ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=d**-0.5)
        assert rel_err(out, ref) < REL_TOL[q.dtype]
        assert_lse(lse, ref_lse, q.dtype)
