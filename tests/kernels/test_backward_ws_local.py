"""The backward's Hopper schedule ("ws") with the attention of current models: where it takes them
(CPU; the sm_90 compile is in test_compile_backward.py), and on an sm_90 GPU windows, chunks, the cap and
sinks (their gradient too), alone and as models combine them, against float64 autograd over every
kind of Variant the schedule has, at ragged lengths (queries shorter and longer than the keys),
GQA, batch 2, into poisoned gradients; fixed-order dQ gives the same bits on every run; key tiles
outside every row's window are never read, and neither are queries no key tile's rows see."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from helpers import H100, HOPPER, assert_grads, local_reference_grads, randn, run_backward_variant
from tunegen.calls.local import Local
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.families import backward
from tunegen.kernels.problem import Problem

Variant = backward.BackwardVariant
INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
PLAIN = Problem("backward", "bfloat16", 128, True, 32, 8, 1, 16384, 16384)
# (causal, Local's fields but the sinks, sinks): windows and chunks several query and key tiles
# wide and narrower than one, so that key tiles walk masked steps at both ends and unmasked ones
# between.
FEATURES = {
    "window causal (Mistral)": (True, {"window_left": 300}, False),
    "narrow window": (True, {"window_left": 1}, False),
    "window both sides": (False, {"window_left": 150, "window_right": 200}, False),
    "chunk causal (Llama 4)": (True, {"attention_chunk": 192}, False),
    "chunk": (False, {"attention_chunk": 200}, False),
    "window in chunks": (True, {"window_left": 100, "attention_chunk": 256}, False),
    "softcap causal": (True, {"softcap": 3.0}, False),
    "softcap": (False, {"softcap": 3.0}, False),
    "sinks": (False, {}, True),
    "window and sinks (gpt-oss)": (True, {"window_left": 127}, True),
    "window and softcap (Gemma 2)": (True, {"window_left": 300, "softcap": 3.0}, False),
    "every feature": (
        False,
        {"window_left": 130, "window_right": 90, "attention_chunk": 256, "softcap": 3.0},
        True,
    ),
}
WS = Variant(64, 128, num_warps=8, num_stages=2, schedule="ws")
# Every kind of walk and dQ path the schedule has (each where it fits the installed release).
KINDS = [
    WS,
    WS.replace(dq_write="atomic", kv_regs=True),
    WS.replace(split_warpgroups=True, dq_write="atomic", num_stages=3),
    WS.replace(paired_walk=True, dq_write="atomic", kv_regs=True),
    WS.replace(dkdv_block_m=128, order="heaviest_first", producer_regs=40),
    WS.replace(num_warps=4, dkdv_block_n=64, dq_write="atomic"),
]


def _problem(causal: bool, fields: dict, sinks: bool, d: int = 128) -> Problem:
    softcap = bool(fields.get("softcap"))
    return dataclasses.replace(
        PLAIN, head_dim=d, causal=causal, **{**fields, "softcap": softcap}, sinks=sinks
    )


def _inputs(nq, nk, d, seed, dtype=torch.bfloat16, batch=2):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (randn(batch, 4, nq, d, dtype=dtype, device="cuda", gen=gen) for _ in range(2))
    k, v = (randn(batch, 2, nk, d, dtype=dtype, device="cuda", gen=gen) for _ in range(2))
    return q, k, v, dout, randn(4, dtype=torch.float32, device="cuda", gen=gen)


def _check(variant, name, nq, nk, d, dtype=torch.bfloat16, dlse=False):
    causal, fields, with_sinks = FEATURES[name]
    q, k, v, dout, sinks = _inputs(nq, nk, d, seed=nq * 31 + nk + d + len(name), dtype=dtype)
    local = Local(**fields, sinks=sinks if with_sinks else None)
    lse_grad = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(nq)).cuda() if dlse else None
    ref = local_reference_grads(q, k, v, dout, causal=causal, scale=0.3, local=local, dlse=lse_grad)
    got = run_backward_variant(variant, q, k, v, dout, causal=causal, scale=0.3, local=local, dlse=lse_grad)
    assert_grads(got, ref, dtype)


@pytest.mark.parametrize(
    "features",
    [{"window_left": 4095}, {"attention_chunk": 8192}, {"softcap": True}, {"sinks": True}],
    ids=str,
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_defaults_and_the_search_take_the_hopper_schedule(features, causal):
    problem = dataclasses.replace(PLAIN, causal=causal, **features)
    family = backward.FAMILY
    variant = family.default_variant(problem, H100)
    assert variant.schedule == "ws" and family.constraint(variant, problem, H100) is None
    family.check_variant(variant, problem, H100)
    space = family.search_space(problem, H100)
    assert "ws" in space["schedule"]
    assert space["split_tail"] == ([False] if causal or problem.local else [False, True])
    assert family.deterministic(variant, problem, H100).schedule == "ws"


def test_a_split_tail_takes_no_window_or_chunk():
    """A split tail shares out key tiles that walk as many steps; a window's or chunk's do not."""
    family = backward.FAMILY
    full = dataclasses.replace(PLAIN, causal=False)
    tail = WS.replace(split_tail=True, dq_write="atomic")
    assert family.constraint(tail, dataclasses.replace(full, softcap=True, sinks=True), H100) is None
    for local in ({"window_left": 200, "window_right": 200}, {"attention_chunk": 1024}):
        reason = family.constraint(tail, dataclasses.replace(full, **local), H100)
        assert reason.startswith("split_tail: under a causal mask, window or chunk key tiles walk")
        assert not family.default_variant(dataclasses.replace(full, **local), H100).split_tail


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", list(FEATURES))
def test_features_against_float64(name, d):
    """The default Variant at lengths that are no multiple of any tile, both ways (rows at negative
    positions see nothing under a chunk)."""
    causal, fields, with_sinks = FEATURES[name]
    variant = backward.FAMILY.default_variant(_problem(causal, fields, with_sinks, d), INSTALLED)
    assert variant.schedule == "ws"
    for nq, nk in [(333, 333), (200, 517), (517, 190)]:
        _check(variant, name, nq, nk, d)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", range(len(KINDS)))
@pytest.mark.parametrize(
    "name",
    ["window and sinks (gpt-oss)", "window and softcap (Gemma 2)", "every feature", "chunk causal (Llama 4)"],
)
def test_every_kind_of_variant(name, kind, d):
    """Every walk and dQ path, with a gradient of the log-sum-exp too (which reaches the sinks)."""
    causal, fields, with_sinks = FEATURES[name]
    variant = KINDS[kind]
    if backward.FAMILY.constraint(variant, _problem(causal, fields, with_sinks, d), INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    for nq, nk in [(200, 517), (517, 190)]:
        _check(variant, name, nq, nk, d, dlse=True)


@pytest.mark.gpu
@HOPPER
def test_float16_with_every_feature():
    _check(WS.replace(dq_write="atomic"), "every feature", 333, 400, 128, dtype=torch.float16)
    _check(WS, "window and softcap (Gemma 2)", 400, 333, 64, dtype=torch.float16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("dq_write", ["tma", "atomic"])
@pytest.mark.parametrize(
    "name", ["window and softcap (Gemma 2)", "window both sides", "chunk", "window in chunks"]
)
def test_fixed_order_dq_is_the_same_bits_every_run(name, dq_write):
    """Under a window or chunk the key tiles that add into a query tile start past the first: each
    takes its turn counted from the first that sees the tile (a wrong count waits forever or adds
    out of order). Five runs, one result, and it is right."""
    causal, fields, with_sinks = FEATURES[name]
    variant = WS.replace(deterministic=True, dq_write=dq_write)
    q, k, v, dout, sinks = _inputs(1500, 1400, 128, seed=len(name))
    local = Local(**fields, sinks=sinks if with_sinks else None)
    first = run_backward_variant(variant, q, k, v, dout, causal=causal, scale=0.1, local=local)
    ref = local_reference_grads(q, k, v, dout, causal=causal, scale=0.1, local=local)
    assert_grads(first, ref, torch.bfloat16)
    for _ in range(4):
        again = run_backward_variant(variant, q, k, v, dout, causal=causal, scale=0.1, local=local)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("causal", "fields", "nq", "unseen"),
    [
        (True, {"window_left": 100}, 256, 512),
        (False, {"window_left": 100, "window_right": 100}, 256, 512),
        (True, {"attention_chunk": 640}, 256, 640),
        (False, {"attention_chunk": 640}, 1408, 0),
    ],
    ids=["window causal", "window both sides", "chunk", "chunk, more queries"],
)
def test_tiles_no_row_sees_are_not_read(causal, fields, nq, unseen):
    """`nq` queries at the end of 1280 keys. The first `unseen` keys (whole key tiles) lie outside
    every row's window or chunk and hold NaN: no step reads them, and their gradients are zeros.
    With more queries than keys, the first 128 rows sit at negative positions, where a chunk sees
    nothing: their queries hold NaN, no key tile walks them, and their dQ is zeros."""
    gen = torch.Generator().manual_seed(nq + unseen)
    q, dout = (randn(1, 2, nq, 128, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
    k, v = (randn(1, 1, 1280, 128, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
    local = Local(**fields, sinks=randn(2, dtype=torch.float32, device="cuda", gen=gen))
    ref = local_reference_grads(q, k, v, dout, causal=causal, scale=0.3, local=local)
    outputs = PrefillCall(q, k, v, causal, 0.3, True, local=local).reference()
    blind = slice(0, max(nq - 1280, 0))
    k[:, :, :unseen], v[:, :, :unseen], q[:, :, blind] = float("nan"), float("nan"), float("nan")
    for variant in (WS, WS.replace(dq_write="atomic", split_warpgroups=True)):
        grads = run_backward_variant(
            variant, q, k, v, dout, causal=causal, scale=0.3, local=local, forward_outputs=outputs
        )
        assert_grads(grads, ref, torch.bfloat16)
        assert torch.all(grads[1][:, :, :unseen] == 0) and torch.all(grads[2][:, :, :unseen] == 0)
        assert torch.all(grads[0][:, :, blind] == 0)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("causal", "fields"),
    [
        (True, {"window_left": 70}),
        (False, {"window_left": 50, "window_right": 90}),
        (True, {"attention_chunk": 96}),
        (False, {"window_right": 20, "attention_chunk": 160}),
    ],
    ids=["window causal", "window both sides", "chunk causal", "right side in chunks"],
)
def test_bounds_at_every_alignment(causal, fields):
    """The edges of windows and chunks fall on every fourth row of the 64-row query tiles and the
    128-key tiles (seqlen_k - seqlen_q from -64 to 60), so that a bound off by a tile fails."""
    local = Local(**fields)
    for diag in range(-64, 64, 4):
        gen = torch.Generator().manual_seed(diag + 64)
        q, dout = (
            randn(1, 2, 400 - diag, 64, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2)
        )
        k, v = (randn(1, 1, 400, 64, dtype=torch.bfloat16, device="cuda", gen=gen) for _ in range(2))
        ref = local_reference_grads(q, k, v, dout, causal=causal, scale=0.3, local=local)
        assert_grads(
            run_backward_variant(WS, q, k, v, dout, causal=causal, scale=0.3, local=local),
            ref,
            torch.bfloat16,
        )
