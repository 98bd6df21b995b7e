"""The Hopper forward's stream-K tail (`stream_k`): where it applies (CPU), and on an sm_90 GPU
against float64 where the tail's ranges cut tiles into segments, end inside a masked key block,
cover every tile of a short launch, or leave the waves whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from helpers import H100, HOPPER, REL_TOL, assert_lse, randn, rel_err, run_variant
from tunegen.kernels import releases
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference
from tunegen.kernels.render import load

WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True)
DYNAMIC = {"persistent": True, "dynamic": True, "stream_k": True}
PROBLEM = Problem("prefill", "bfloat16", 128, False, 16, 4, 2, 4096, 4096)


def test_stream_k_is_a_knob_of_the_dynamic_scheduler():
    with pytest.raises(ValueError, match="stream_k: ranges of the tail handed out by the dynamic scheduler"):
        dataclasses.replace(WS, persistent=True, stream_k=True)
    assert dataclasses.replace(WS, **DYNAMIC).stream_k
    with pytest.raises(ValueError, match="stream_k: a knob of schedule 'ws'"):
        prefill.PrefillVariant(stream_k=True)


@pytest.mark.parametrize("changes", [{"causal": True}, {"fp8": True}], ids=["causal", "fp8"])
def test_stream_k_refuses_causal_and_fp8_problems_by_name(changes):
    problem = dataclasses.replace(PROBLEM, **changes)
    with pytest.raises(ValueError, match=r"variant\.stream_k: cuts the last wave of 16-bit tiles"):
        prefill.FAMILY.check_variant(dataclasses.replace(WS, **DYNAMIC), problem, H100)
    assert prefill.FAMILY.search_space(problem, H100)["stream_k"] == [False]


def test_the_tuner_asks_for_stream_k_only_on_the_dynamic_scheduler():
    space = prefill.FAMILY.search_space(PROBLEM, H100)
    assert space["stream_k"] == [False, True]
    for dynamic in (False, True):
        knobs = {"schedule": "ws", "consumers": 2, "persistent": True, "dynamic": dynamic}
        picked = base.choose(
            prefill.FAMILY, space, lambda name, values, knobs=knobs: knobs.get(name, values[-1])
        )
        assert ("stream_k" in picked) == dynamic
        prefill.PrefillVariant(**picked)  # accepted


def test_the_merge_costs_a_second_output_tile_where_the_release_spills_it():
    """Triton 3.9 spills 184 bytes at head dim 128 with the merge beside the loop's tiles (3.6
    and 3.7: 8 to 40), so its constraint counts the merge's output tile there."""
    variant = dataclasses.replace(WS, q_stages=2, **DYNAMIC)
    for version, admitted in (("3.6.0", True), ("3.7.1", True), ("3.9.0", False)):
        gpu = dataclasses.replace(H100, triton_version=version)
        found = prefill.FAMILY.constraint(variant, PROBLEM, gpu)
        assert (found is None) == admitted, (version, found)
        assert prefill.FAMILY.constraint(dataclasses.replace(variant, stream_k=False), PROBLEM, gpu) is None
    assert releases.of("3.9.0").ws_merge_tile and not releases.of("3.6.0").ws_merge_tile


# --- on the GPU -----------------------------------------------------------------------------

# The non-causal defaults' forms with the tail cut: two consumers in turns or apart (with
# overlap or without), and three consumers over 64-key blocks.
FORMS = [
    dataclasses.replace(WS, pingpong=True, overlap=False, q_stages=2, **DYNAMIC),
    dataclasses.replace(WS, overlap=False, mask_branch=True, q_stages=2, **DYNAMIC),
    dataclasses.replace(WS, q_stages=2, **DYNAMIC),
    dataclasses.replace(WS, consumers=3, block_n=64, pingpong=True, overlap=False, q_stages=2, **DYNAMIC),
    dataclasses.replace(WS, **DYNAMIC),
]

# (batch, query heads, KV heads, nq, nk): tails cut inside tiles with ragged keys (the last key
# block masked inside a segment), a launch of fewer tiles than SMs (every tile cut), keys in one
# block (nothing to cut), and MQA; and one tile per SM (the test adds it: nothing left over).
SHAPES = [
    (3, 8, 2, 1000, 1000),
    (3, 8, 2, 1000, 300),
    (1, 16, 4, 1000, 4099),
    (2, 8, 8, 700, 100),
    (1, 6, 1, 333, 2500),
]


def _tail_of(kernel, q, k):
    """The launch's (tiles, tail tiles, ranges), from the rendered module's own rule."""
    module = load(kernel.rendered, interpret=False)
    tile_m = kernel.variant.consumers * kernel.variant.block_m
    tiles = q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], tile_m)
    programs = torch.cuda.get_device_properties(q.device).multi_processor_count
    n_whole, n_ranges = module._tail(tiles, programs, triton.cdiv(k.shape[2], kernel.variant.block_n))
    return tiles, tiles - n_whole, n_ranges


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", FORMS, ids=lambda v: v.to_json())
@pytest.mark.parametrize("d", [64, 128])
def test_stream_k_tail_against_float64(variant, d):
    """Every shape, output and log-sum-exp against float64 into poisoned outputs, three launches
    each (each launch's counts and slots its own), the same bits each time; the shapes between
    them cut tiles into segments and leave some launch without a tail."""
    problem = dataclasses.replace(PROBLEM, head_dim=d)
    gpu = gpu_of(torch.device("cuda"))
    if prefill.FAMILY.constraint(variant, problem, gpu):
        pytest.skip("outside the constraint at this head dim on this Triton")
    cut = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, hq, hkv, nq, nk in [*SHAPES, (1, sms, 1, 100, 700)]:  # the last: one whole wave
        gen = torch.Generator().manual_seed(batch * nq + nk + d)
        q = randn(batch, hq, nq, d, dtype=torch.bfloat16, device="cuda", gen=gen)
        k, v = (randn(batch, hkv, nk, d, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
        ref, ref_lse = attention_reference(q, k, v, causal=False, scale=0.3)
        first = None
        for _ in range(3):
            out, lse = run_variant(variant, q, k, v, causal=False, scale=0.3)
            assert rel_err(out, ref) < REL_TOL[q.dtype], (batch, hq, nq, nk)
            assert_lse(lse, ref_lse, q.dtype)
            assert first is None or torch.equal(out, first), "the same bits every launch"
            first = out
        kernel = base.build(
            prefill.FAMILY, variant, dataclasses.replace(problem, seqlen_q=nq, seqlen_k=nk), gpu
        )
        cut.append(_tail_of(kernel, q, k))
    assert any(ranges > tail for _, tail, ranges in cut), f"some tile cut into segments: {cut}"
    assert any(ranges == 0 for _, _, ranges in cut), f"some launch without a tail: {cut}"
