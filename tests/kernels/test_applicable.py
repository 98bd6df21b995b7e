"""Listings show the knobs that apply: `base.applicable` keeps a Variant's knobs that the tuner
chooses for the Problem on the Gpu, and those off their defaults, so that the shown knobs always
rebuild the same Variant; a stored Winner this release cannot rebuild shows all its knobs."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
import triton

from tunegen.kernels.database import applicable_knobs, gpu_record
from tunegen.kernels.families import FAMILIES, backward, decode, prefill
from tunegen.kernels.families.base import applicable, choose
from tunegen.kernels.gpu import Gpu, interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import WinnerRecord

HOPPER = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, triton.__version__, torch.__version__, "cuda")
GPUS = [interpreter_gpu(), HOPPER]
BF16 = Problem("prefill", "bfloat16", 128, False, 32, 8, 4, 4096, 4096)
FP8 = dataclasses.replace(BF16, fp8=True)
DECODE = Problem("decode", "float16", 128, False, 32, 8, 16, 1, 8192)
GRADS = Problem("backward", "bfloat16", 128, True, 32, 8, 4, 2048, 2048)
PROBLEMS = [
    BF16,
    dataclasses.replace(BF16, causal=True),
    dataclasses.replace(BF16, head_dim=64, causal=True, seqlen_q=1024, seqlen_k=1024),
    dataclasses.replace(BF16, dtype="float32", varlen=True),
    FP8,
    dataclasses.replace(FP8, causal=True, aligned=False),
    DECODE,
    Problem("decode", "bfloat16", 64, False, 8, 8, 1, 1, 4096, paged=True, page_size=16, fp8=True),
    GRADS,
    Problem("backward", "float32", 64, False, 4, 4, 2, 512, 512),
]
WS_KNOBS = set(prefill.WS_KNOBS)


def variants(problem: Problem, gpu: Gpu, count: int = 60) -> list:
    """The family's default and random points of its search space for `problem` on `gpu` that its
    Variant type accepts."""
    family = FAMILIES[problem.family]
    space = family.search_space(problem, gpu)
    rng = random.Random(f"{problem}{gpu}")
    found = [family.default_variant(problem, gpu)]
    while len(found) < count:
        try:
            found.append(family.variant_type(**choose(family, space, lambda _, values: rng.choice(values))))
        except ValueError:
            continue
    return found


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.family}-{p.dtype}-fp8{p.fp8}")
def test_the_shown_knobs_rebuild_the_same_variant(problem, gpu):
    family = FAMILIES[problem.family]
    for variant in variants(problem, gpu):
        shown = applicable(family, variant, problem, gpu)
        assert family.variant_type.from_json(json.dumps(shown)) == variant, shown
        assert list(shown) == [k for k in variant.as_dict() if k in shown], "the Variant's order"


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
def test_fp8_knobs_show_on_fp8_problems_only(gpu):
    bf16 = prefill.fa2_default(BF16, gpu)
    assert not {"p_fp8", "v_trans"} & set(applicable(prefill.FAMILY, bf16, BF16, gpu))
    fp8 = prefill.fa2_default(FP8, gpu)
    shown = applicable(prefill.FAMILY, fp8, FP8, gpu)
    assert (shown["p_fp8"], shown["v_trans"]) == (fp8.p_fp8, fp8.v_trans)


def test_hopper_schedule_knobs_show_on_its_variants_only():
    fa2 = prefill.PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=3)
    shown = applicable(prefill.FAMILY, fa2, BF16, HOPPER)
    assert shown["schedule"] == "fa2" and not WS_KNOBS & set(shown)
    assert {"num_warps", "load"} <= set(shown)
    ws = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True)
    shown = applicable(prefill.FAMILY, ws, BF16, HOPPER)
    persistent_only = set(prefill.PERSISTENT_KNOBS)
    assert set(shown) >= WS_KNOBS - {"ctas_per_sm", "stream_k", "pv_pair", *persistent_only}
    parts = dataclasses.replace(BF16, head_dim=192)
    assert "pv_pair" not in shown, "a head-dim tile in parts only"
    assert "pv_pair" in applicable(prefill.FAMILY, ws.replace(block_n=64), parts, HOPPER)
    assert not set(prefill.FA2_KNOBS) & set(shown)
    assert "ctas_per_sm" not in shown, "two programs per SM only with one consumer each"
    assert not persistent_only & set(shown), "the dynamic scheduler and query slots serve persistent programs"
    assert persistent_only <= set(applicable(prefill.FAMILY, ws.replace(persistent=True), BF16, HOPPER))
    assert "stream_k" not in applicable(prefill.FAMILY, ws.replace(persistent=True), BF16, HOPPER)
    dynamic = ws.replace(persistent=True, dynamic=True)
    assert "stream_k" in applicable(prefill.FAMILY, dynamic, BF16, HOPPER), "the dynamic scheduler's tail"
    one = applicable(prefill.FAMILY, ws.replace(consumers=1), BF16, HOPPER)
    assert "pingpong" not in one and "ctas_per_sm" in one, "pingpong needs 2 consumers"
    assert "schedule" not in applicable(prefill.FAMILY, fa2, BF16, interpreter_gpu()), "no 'ws' there"


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.arch)
def test_causal_knobs_show_on_causal_problems_only(gpu):
    causal = dataclasses.replace(BF16, causal=True)
    variant = prefill.fa2_default(BF16, gpu)
    assert not {"order", "reverse_m"} & set(applicable(prefill.FAMILY, variant, BF16, gpu))
    assert {"order", "reverse_m"} <= set(applicable(prefill.FAMILY, variant, causal, gpu))
    variant = backward.FAMILY.default_variant(GRADS, gpu)
    assert "order" in applicable(backward.FAMILY, variant, GRADS, gpu)
    plain = dataclasses.replace(GRADS, causal=False)
    assert "order" not in applicable(backward.FAMILY, variant, plain, gpu)


def test_knobs_of_a_pass_that_does_not_run_are_hidden():
    atomic = backward.BackwardVariant(dq_mode="atomic")
    shown = applicable(backward.FAMILY, atomic, GRADS, HOPPER)
    assert shown["dq_mode"] == "atomic" and not {k for k in shown if k.startswith(("dq_b", "dq_n"))}
    assert "fuse_delta" not in shown


def test_knobs_off_their_defaults_always_show():
    mha = dataclasses.replace(DECODE, num_heads_kv=DECODE.num_heads_q)
    unpacked = decode.DecodeVariant(pack_gqa=False)  # one candidate without GQA, yet off its default
    assert applicable(decode.FAMILY, unpacked, mha, HOPPER)["pack_gqa"] is False
    fa2 = prefill.PrefillVariant(causal_split=False)  # never searched
    assert applicable(prefill.FAMILY, fa2, BF16, HOPPER)["causal_split"] is False


def stored(problem: dict, variant: dict, family: str = "prefill") -> WinnerRecord:
    return WinnerRecord(gpu_record(HOPPER), family, problem, variant, 1.0, 1e-3, "3.6.0", "2.9", "h")


def test_a_stored_winner_shows_its_applicable_knobs_or_all_of_them():
    full = prefill.fa2_default(BF16, HOPPER).as_dict()
    assert applicable_knobs(stored(BF16.as_dict(), full)) == applicable(
        prefill.FAMILY, prefill.PrefillVariant(**full), BF16, HOPPER
    )
    old_problem = {**BF16.as_dict(), "window": 128}
    old_variant = {**full, "warp_specialize": True}
    for w in (
        stored(old_problem, full),
        stored(BF16.as_dict(), old_variant),
        stored(BF16.as_dict(), full, family="sparse"),
        dataclasses.replace(
            stored(BF16.as_dict(), full), gpu=dataclasses.replace(gpu_record(HOPPER), capability="x")
        ),
    ):
        assert applicable_knobs(w) == w.variant
