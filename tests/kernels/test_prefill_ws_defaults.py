"""The Hopper schedule's defaults (families/prefill_ws.py `ws_default`): which forms each suite row
takes on the H100 and the H200, as issue31_h100.md and issue31_h200.md measured them."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import H100
from tunegen.kernels.families import prefill
from tunegen.kernels.problem import Problem
from tunegen.measure.suites import prefill_suite

TURNS = (2, True, False)  # consumers, pingpong, overlap: two consumers taking turns
APART = (2, False, False)  # two consumers, neither turns nor overlap


def _form(variant):
    return variant.consumers, variant.pingpong, variant.overlap


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kv_heads", [None, 4], ids=["mha", "gqa"])
def test_every_suite_default_is_a_variant_the_schedule_takes(fp8, kv_heads):
    """The H100 defaults of every suite row (both masks, N = 512 to 32k, head dims 64 to 256, 96 and
    192 padded) build as Variants that the family checks and constrains, so that no public call
    meets a default it refuses."""
    for shape in prefill_suite(
        (512, 1024, 2048, 4096, 8192, 16384, 32768), (64, 96, 128, 192, 256), kv_heads=kv_heads
    ):
        problem = dataclasses.replace(shape.problem("bfloat16"), fp8=fp8)
        variant = prefill.FAMILY.default_variant(problem, H100)
        prefill.FAMILY.check_variant(variant, problem, H100)
        assert prefill.FAMILY.constraint(variant, problem, H100) is None, (shape, variant)


def test_the_defaults_mask_in_a_branch_where_it_measured_faster():
    """`mask_branch` in the H100 defaults exactly where it measured faster (issue31_h100.md):
    causal head dim 128 up to 2048 tokens, causal head dim 64 past 512, and the two consumers
    apart at head dim 64 without a mask up to 1024 tokens; never for FP8."""
    for shape in prefill_suite((512, 1024, 2048, 4096, 8192, 16384), (64, 128)):
        problem = shape.problem("bfloat16")
        n, d = shape.seqlen, shape.head_dim
        causal_branch = n <= 2048 if d == 128 else n > 512
        wanted = causal_branch if shape.causal else d == 64 and n <= 1024
        assert prefill.FAMILY.default_variant(problem, H100).mask_branch == wanted, shape
        fp8 = dataclasses.replace(problem, fp8=True)
        assert not prefill.FAMILY.default_variant(fp8, H100).mask_branch, shape


def test_causal_defaults_take_the_heaviest_tiles_first():
    """Causal tiles go heaviest first on the dynamic scheduler, over groups of heads whose K and V
    fill an eighth of the L2 at prompts up to 2048 tokens at head dim 128 and 4096 at 64, half
    past that (issue31_h100.md, sixth session: with even groups, heaviest first passed lightest
    first at every length). Short prompts run two consumers apart without overlap, but one
    128-row consumer at head dim 64 and 512 tokens (third and fifth sessions); at head dim 128
    the two consumers never take turns (seventh session: apart measured +0.5% to +2.7%)."""
    for shape in prefill_suite((512, 1024, 2048, 4096, 8192, 16384), (64, 128), (True,)):
        variant = prefill.FAMILY.default_variant(shape.problem("bfloat16"), H100)
        n, d = shape.seqlen, shape.head_dim
        short = n <= (2048 if d == 128 else 4096)
        assert variant.dynamic, shape
        order = (variant.order, variant.reverse_m, variant.l2_share)
        assert order == ("grouped", True, 8 if short else 2), shape
        if short and (d == 128 or n > 512):
            assert _form(variant) == APART, shape
        else:
            assert _form(variant) not in (TURNS, APART), shape
        assert not (d == 128 and variant.pingpong), shape


def test_the_h200_groups_short_causal_tiles_over_an_eighth_at_fewer_lengths():
    """The H200's own sweep: groups over an eighth of the L2 up to 1024 tokens at head dim 128
    and 512 at 64, over half past that, in the H100's forms but for its consumers taking turns at
    head dim 128 past 4096 tokens, where apart measured no faster there (issue31_h200.md)."""
    h200 = dataclasses.replace(H100, name="NVIDIA H200")
    assert (h200.model, H100.model) == ("h200", "h100")
    for shape in prefill_suite((512, 1024, 2048, 4096, 8192, 16384), (64, 128), (True,)):
        problem = shape.problem("bfloat16")
        on_h100 = prefill.FAMILY.default_variant(problem, H100)
        on_h200 = prefill.FAMILY.default_variant(problem, h200)
        small = shape.seqlen <= (1024 if shape.head_dim == 128 else 512)
        turns = (shape.head_dim == 128 and shape.seqlen > 4096) or on_h100.pingpong
        assert on_h200 == on_h100.replace(l2_share=8 if small else 2, pingpong=turns), shape


def test_short_prompts_without_a_mask_take_two_consumers_without_overlap():
    """Non-causal prompts up to 1024 tokens run two consumers without overlap on the dynamic
    scheduler: taking turns at head dim 128 (no `mask_branch`, no mask to branch on), apart at 64
    (issue31_h100.md, fourth and fifth sessions); longer ones keep their forms."""
    for shape in prefill_suite((512, 768, 1024, 2048, 4096, 16384), (64, 128), (False,)):
        variant = prefill.FAMILY.default_variant(shape.problem("bfloat16"), H100)
        n, d = shape.seqlen, shape.head_dim
        assert variant.dynamic, shape
        assert (_form(variant) == TURNS) == (n <= 1024 and d == 128), shape
        assert (_form(variant) == APART) == (n <= 1024 and d == 64), shape


def test_no_default_cuts_the_tail():
    """`stream_k` is the tuner's to pick: as a default it measured no better than the spread between
    runs at head dim 64 and slower at 128 (issue31_h100.md and issue31_h200.md, eighth session)."""
    h200 = dataclasses.replace(H100, name="NVIDIA H200")
    for shape in prefill_suite((512, 1024, 2048, 4096, 16384), (64, 128), (False, True), kv_heads=8):
        for gpu in (H100, h200):
            assert not prefill.FAMILY.default_variant(shape.problem("bfloat16"), gpu).stream_k, shape


def test_below_one_wave_of_tiles_the_default_is_fa2():
    """The Hopper schedule where a Problem fills the GPU with 128-row tiles; FA2's loop, whose
    launch costs half as much, below that."""
    suite = Problem("prefill", "bfloat16", 128, False, 16, 16, 32, 512, 512)  # 32*16*4 tiles
    assert prefill.FAMILY.default_variant(suite, H100).schedule == "ws"
    tiny = dataclasses.replace(suite, batch=1, num_heads_q=2, num_heads_kv=2, seqlen_q=16, seqlen_k=16)
    assert prefill.FAMILY.default_variant(tiny, H100).schedule == "fa2"
    short = dataclasses.replace(suite, batch=1, num_heads_q=32, num_heads_kv=32)
    assert prefill.FAMILY.default_variant(short, H100).schedule == "fa2"  # 128 tiles, 132 SMs
    wave = dataclasses.replace(short, batch=2)
    assert prefill.FAMILY.default_variant(wave, H100).schedule == "ws"


def test_two_programs_per_sm_on_the_dynamic_scheduler_keep_to_the_grouped_order_when_causal():
    """The form that lost whole tiles now and then under a causal mask with order "m_inner"
    (issue31_h100.md, fifth session) is refused there, in every order but "grouped"; its
    non-causal and grouped uses, and one program per SM, stay admitted."""
    pair = prefill.PrefillVariant(
        schedule="ws",
        block_m=128,
        block_n=64,
        num_stages=3,
        consumers=1,
        ctas_per_sm=2,
        overlap=True,
        persistent=True,
        dynamic=True,
        q_stages=2,
    )
    causal = Problem("prefill", "bfloat16", 64, True, 32, 32, 32, 512, 512)
    for order in ("m_inner", "head_inner"):
        assert "grouped" in prefill.FAMILY.constraint(pair.replace(order=order), causal, H100)
    assert prefill.FAMILY.constraint(pair.replace(order="grouped"), causal, H100) is None
    assert prefill.FAMILY.constraint(pair, dataclasses.replace(causal, causal=False), H100) is None
    one = pair.replace(block_m=64, ctas_per_sm=1)
    assert prefill.FAMILY.constraint(one, causal, H100) is None


def test_head_dim_256_takes_two_consumers_through_the_query_slot():
    """Head dim 256 (issue33_h100.md): two consumers of 64 rows over 64-key blocks, the output
    leaving through the query slot (no room for one of its own), one tile a program; causal tiles
    heaviest first, with overlap past 2048 tokens, and always without a mask."""
    for shape in prefill_suite((512, 1024, 2048, 4096, 8192, 16384), (256,)):
        variant = prefill.FAMILY.default_variant(shape.problem("bfloat16"), H100)
        assert variant.schedule == "ws" and (variant.consumers, variant.block_m, variant.block_n) == (
            2,
            64,
            64,
        )
        assert variant.o_store == "q_slot" and not variant.persistent, shape
        assert variant.overlap == (not shape.causal or shape.seqlen > 2048), shape
        assert (variant.order == "grouped" and variant.reverse_m) == shape.causal, shape


def test_head_dim_192_runs_in_parts_with_its_query_rows_in_registers():
    """Head dims 144 to 192 (issue33_h200_d192.md): three 64-column parts over 64-key blocks, the
    query rows in registers; without overlap on the dynamic scheduler up to 1024 tokens (causal
    2048; turns without a mask), then with overlap through the query slot, over a ring of three up
    to 4096; P·V's first two parts paired but for causal prompts past 4096 tokens."""
    for shape in prefill_suite((1024, 2048, 4096, 16384), (192,)):
        problem = shape.problem("bfloat16")
        for p in (problem, dataclasses.replace(problem, head_dim=160)):
            variant = prefill.FAMILY.default_variant(p, H100)
            assert prefill.FAMILY.features(p, H100)["ws_block_d"] == (192, 64)
            assert (
                variant.schedule == "ws"
                and variant.q_regs
                and (variant.consumers, variant.block_n) == (2, 64)
            )
            assert prefill.FAMILY.constraint(variant, p, H100) is None, shape
            short = shape.seqlen <= (2048 if shape.causal else 1024)
            assert variant.overlap == (not short) and variant.dynamic == (
                short or (not shape.causal and shape.seqlen > 4096)
            )
            assert variant.o_store == ("slot" if short else "q_slot"), shape
            assert variant.num_stages == (2 if short or shape.seqlen > 4096 else 3), shape
            assert variant.q_stages == 1 and (variant.order == "grouped") == shape.causal, shape
            assert variant.pv_pair == (not shape.causal or shape.seqlen <= 4096), shape
            assert variant.l2_share == 2, "groups of heads as the sweep measured them"
