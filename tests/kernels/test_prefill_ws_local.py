"""The Hopper schedule ("ws") with the attention of current models: where it takes them (CPU), and
on an sm_90 GPU windows, chunks, the cap and sinks, alone and as models combine them, against
float64 over every kind of Variant the schedule has, at ragged lengths (queries shorter and longer
than the keys), GQA, batch 2, into poisoned outputs; key blocks outside every row's window are
never read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from helpers import H100, HOPPER, REL_TOL, assert_lse, randn, rel_err, run_variant
from tunegen.calls.local import Local
from tunegen.kernels.families import prefill
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference

WS = prefill.PrefillVariant(
    schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True, mask_branch=True
)
PAIR = dataclasses.replace(WS, consumers=1, block_n=64, ctas_per_sm=2)
DYNAMIC = {"persistent": True, "dynamic": True, "q_stages": 2}
VARIANTS = [
    WS,
    dataclasses.replace(WS, overlap=False, pingpong=True, **DYNAMIC, order="grouped", reverse_m=True),
    dataclasses.replace(WS, consumers=3, overlap=False, pingpong=True, block_n=64, **DYNAMIC),
    dataclasses.replace(PAIR, block_m=128, num_stages=3, **DYNAMIC, order="grouped", reverse_m=True),
    dataclasses.replace(WS, consumers=1, persistent=True, order="head_inner"),
    # The masked blocks at both ends in copies of the loop rather than its branch.
    dataclasses.replace(WS, mask_branch=False, **DYNAMIC, order="grouped", reverse_m=True),
    dataclasses.replace(PAIR, mask_branch=False, overlap=False, **DYNAMIC, order="grouped"),
    # Head dim 256's forms (the output through the query slot or from registers).
    dataclasses.replace(WS, block_n=64, o_store="q_slot"),
    dataclasses.replace(WS, block_n=64, o_store="registers", overlap=False, order="grouped", reverse_m=True),
    # Head dim 192's (the query rows in registers, P·V's first two parts paired; other head dims
    # refuse the pairing).
    dataclasses.replace(WS, block_n=64, o_store="q_slot", q_regs=True, pv_pair=True),
    dataclasses.replace(WS, block_n=64, o_store="registers", q_regs=True, pv_pair=True, order="grouped"),
]
INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
# (causal, window_size, attention_chunk, softcap, sinks): windows and chunks several key blocks wide
# and narrower than one, so that tiles take masked steps at both ends and unmasked ones between.
FEATURES = {
    "window causal (Mistral)": (True, (300, -1), 0, 0.0, False),
    "narrow window": (True, (1, -1), 0, 0.0, False),
    "window both sides": (False, (150, 200), 0, 0.0, False),
    "chunk causal (Llama 4)": (True, (-1, -1), 192, 0.0, False),
    "chunk": (False, (-1, -1), 200, 0.0, False),
    "window in chunks": (True, (100, -1), 256, 0.0, False),
    "softcap causal": (True, (-1, -1), 0, 3.0, False),
    "softcap": (False, (-1, -1), 0, 3.0, False),
    "sinks": (False, (-1, -1), 0, 0.0, True),
    "window and sinks (gpt-oss)": (True, (127, -1), 0, 0.0, True),
    "window and softcap (Gemma 2)": (True, (300, -1), 0, 3.0, False),
    "every feature": (False, (130, 90), 256, 3.0, True),
}
PLAIN = Problem("prefill", "bfloat16", 128, True, 32, 8, 1, 16384, 16384, return_lse=True)


@pytest.mark.parametrize(
    "features",
    [{"window_left": 4095}, {"attention_chunk": 8192}, {"softcap": True}, {"sinks": True}],
    ids=str,
)
def test_the_defaults_take_the_hopper_schedule_with_the_features(features):
    problem = dataclasses.replace(PLAIN, **features)
    variant = prefill.FAMILY.default_variant(problem, H100)
    assert variant.schedule == "ws"
    prefill.FAMILY.check_variant(variant, problem, H100)
    space = prefill.FAMILY.search_space(problem, H100)
    assert "ws" in space["schedule"] and space["stream_k"] == [False]
    assert space["mask_branch"] == [False, True]


def test_the_tail_takes_no_feature():
    plain = dataclasses.replace(PLAIN, causal=False, sinks=True)
    tail = WS.replace(**DYNAMIC, stream_k=True)
    with pytest.raises(ValueError, match=r"variant.stream_k: the tail's merge renders no \['sinks'\]"):
        prefill.FAMILY.check_variant(tail, plain, H100)


def _run(variant, q, k, v, causal, window, chunk, softcap, sinks):
    local = Local(window[0], window[1], chunk, softcap, sinks)
    return run_variant(variant, q, k, v, causal=causal, scale=0.3, local=local)


def _reference(q, k, v, causal, **local):
    """float64 one sequence at a time (a batch's whole score matrix is large beside other workers)."""
    parts = [
        attention_reference(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal=causal, scale=0.3, **local)
        for b in range(len(q))
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("name", list(FEATURES))
def test_features_against_float64(name, d):
    """Every Variant kind at lengths that are no multiple of any tile, both ways (rows at negative
    positions see nothing, and come out as zeros with a log-sum-exp of -inf without sinks)."""
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    for nq, nk in [(333, 333), (200, 517), (517, 190)]:
        gen = torch.Generator().manual_seed(nq * 31 + nk + d + len(name))
        q = randn(2, 4, nq, d, dtype=torch.bfloat16, device="cuda", gen=gen)
        k, v = (randn(2, 2, nk, d, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
        sinks = randn(4, dtype=torch.float32, device="cuda", gen=gen) if with_sinks else None
        local = {"window_size": window, "attention_chunk": chunk, "softcap": softcap, "sinks": sinks}
        ref, ref_lse = _reference(q, k, v, causal, **local)
        problem = dataclasses.replace(
            PLAIN,
            head_dim=d,
            causal=causal,
            window_left=window[0],
            window_right=window[1],
            attention_chunk=chunk,
            softcap=softcap > 0,
            sinks=with_sinks,
        )
        for variant in VARIANTS:
            if prefill.FAMILY.constraint(variant, problem, INSTALLED):
                continue
            out, lse = _run(variant, q, k, v, causal, window, chunk, softcap, sinks)
            assert rel_err(out, ref) < REL_TOL[torch.bfloat16], (nq, nk, variant)
            assert_lse(lse, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("causal", "window", "chunk", "unseen"),
    [(True, (100, -1), 0, 512), (False, (100, 100), 0, 512), (True, (-1, -1), 640, 640)],
    ids=["window causal", "window both sides", "chunk"],
)
def test_blocks_no_row_sees_are_not_read(causal, window, chunk, unseen):
    """256 queries at the end of 1280 keys: the first `unseen` keys (whole key blocks of every
    Variant) lie outside every row's window or chunk and hold NaN; the output matches float64."""
    gen = torch.Generator().manual_seed(unseen + chunk)
    q = randn(1, 2, 256, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
    k, v = (randn(1, 1, 1280, 128, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
    local = {"window_size": window, "attention_chunk": chunk}
    ref, _ = attention_reference(q, k, v, causal=causal, scale=0.3, **local)
    k[:, :, :unseen], v[:, :, :unseen] = float("nan"), float("nan")
    for variant in VARIANTS:
        if prefill.FAMILY.constraint(variant, dataclasses.replace(PLAIN, causal=causal), INSTALLED):
            continue
        out, _ = _run(variant, q, k, v, causal, window, chunk, 0.0, None)
        assert rel_err(out, ref) < REL_TOL[torch.bfloat16], variant
