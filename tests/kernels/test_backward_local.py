"""The backward's loops with the attention of current models: sliding windows, chunked local
attention, logit softcapping and attention sinks (the sinks' gradient too), alone and as the models
combine them, against float64 autograd at ragged lengths (the queries shorter and longer than the
keys, where rows at negative positions see nothing), GQA, batch 2, packed batches, each way of
computing dQ, into poisoned gradients; tiles no row sees are never read, tiles every row sees whole
skip the mask (the Hopper schedule's are in test_backward_ws_local.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_grads, randn
from helpers import local_reference_grads as reference
from helpers import run_backward_variant as run
from tunegen.calls.backward import BackwardCall
from tunegen.calls.local import Local
from tunegen.calls.prefill import PrefillCall, Varlen
from tunegen.kernels.families import backward, base
from tunegen.kernels.families.backward_case import reference_backward
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import TOLERANCE, attention_reference

Variant = backward.BackwardVariant

# (causal, Local's fields but the sinks, sinks)
FEATURES = {
    "window causal (Mistral)": (True, {"window_left": 9}, False),
    "window both sides": (False, {"window_left": 5, "window_right": 7}, False),
    "window right only": (False, {"window_right": 6}, False),
    "chunk causal (Llama 4)": (True, {"attention_chunk": 16}, False),
    "chunk": (False, {"attention_chunk": 16}, False),
    "window in chunks": (True, {"window_left": 20, "attention_chunk": 16}, False),
    "softcap causal": (True, {"softcap": 3.0}, False),
    "softcap": (False, {"softcap": 3.0}, False),
    "sinks": (False, {}, True),
    "window and sinks (gpt-oss)": (True, {"window_left": 9}, True),
    "window and softcap (Gemma 2)": (True, {"window_left": 9, "softcap": 3.0}, False),
    "every feature": (
        False,
        {"window_left": 6, "window_right": 4, "attention_chunk": 16, "softcap": 3.0},
        True,
    ),
}

# Tiles smaller than the windows (so that some are seen whole), every way of computing dQ, delta
# fused into the dQ pass, descriptors, persistent programs, either program order.
KNOBS = [
    Variant(16, 16, 16, 16, num_warps=4, num_stages=1),
    Variant(16, 32, 32, 16, num_warps=4, num_stages=1, fuse_delta=True),
    Variant(16, 32, num_warps=4, num_stages=1, dq_mode="atomic"),
    Variant(32, 16, num_warps=4, num_stages=1, dq_mode="partial", order="heaviest_first"),
    Variant(16, 32, 32, 16, num_warps=4, num_stages=1, dq_mode="concurrent", persistent=True),
    Variant(16, 16, 16, 16, num_warps=4, num_stages=1, load="desc", order="heaviest_first"),
]


def _local(fields: dict, sinks: torch.Tensor | None) -> Local:
    return Local(**fields, sinks=sinks)


def _inputs(device, nq, nk, seed, dtype=torch.float16, batch=2):
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, 4, nq, 24, dtype=dtype, device=device, gen=gen)
    k, v = (randn(batch, 2, nk, 24, dtype=dtype, device=device, gen=gen) for _ in range(2))
    dout = randn(batch, 4, nq, 24, dtype=dtype, device=device, gen=gen)
    return q, k, v, dout, randn(4, dtype=torch.float32, device=device, gen=gen)


def _default(device) -> Variant:
    problem = Problem("backward", "float16", 24, True, 4, 2, 2, 64, 64, window_left=9)
    return backward.FAMILY.default_variant(problem, gpu_of(torch.device(device)))


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize(("nq", "nk"), [(37, 37), (29, 77), (77, 29)], ids=str)
def test_features_against_float64(device, name, nq, nk):
    """The default Variant and one of 16-row tiles (narrower than the windows and chunks)."""
    causal, fields, with_sinks = FEATURES[name]
    q, k, v, dout, sinks = _inputs(device, nq, nk, seed=nq * 31 + nk + len(name))
    local = _local(fields, sinks if with_sinks else None)
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local)
    for variant in (_default(device), KNOBS[0]):
        got = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local)
        assert_grads(got, ref, torch.float16)


@pytest.mark.parametrize("variant", KNOBS[1:], ids=lambda v: v.to_json())
@pytest.mark.parametrize("name", ["window and sinks (gpt-oss)", "every feature", "chunk causal (Llama 4)"])
def test_every_way_of_computing_dq(device, variant, name):
    if variant.load == "desc" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("tensor descriptors need compute capability 9.0")
    causal, fields, with_sinks = FEATURES[name]
    for nq, nk in ((45, 70), (70, 45)):
        q, k, v, dout, sinks = _inputs(device, nq, nk, seed=nq + 7 * nk)
        local = _local(fields, sinks if with_sinks else None)
        got = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local)
        assert_grads(got, reference(q, k, v, dout, causal=causal, scale=0.4, local=local), torch.float16)


def test_float32_keeps_float32_accuracy(device):
    causal, fields, _ = FEATURES["every feature"]
    q, k, v, dout, sinks = _inputs(device, 45, 37, seed=5, dtype=torch.float32)
    local = _local(fields, sinks)
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local)
    assert_grads(
        run(_default(device), q, k, v, dout, causal=causal, scale=0.4, local=local),
        ref,
        torch.float32,
    )


@pytest.mark.parametrize(
    "variant", [KNOBS[0], KNOBS[1], KNOBS[3]], ids=["separate", "fused delta", "partial"]
)
def test_the_log_sum_exp_gradient_reaches_the_sinks(device, variant):
    """With the log-sum-exp's gradient (dlse) as well as the output's: delta shifts by it, and the
    sink's gradient is Σ exp(sink − lse)·(dlse − rowsum(dO·O)) over the head's rows."""
    causal, fields, _ = FEATURES["window and sinks (gpt-oss)"]
    q, k, v, dout, sinks = _inputs(device, 40, 50, seed=11)
    dlse = randn(2, 4, 40, dtype=torch.float32, device=device, gen=torch.Generator().manual_seed(12))
    local = _local(fields, sinks)
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local, dlse=dlse)
    got = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local, dlse=dlse)
    assert_grads(got, ref, torch.float16)


@pytest.mark.parametrize("name", ["window causal (Mistral)", "chunk", "every feature"])
@pytest.mark.parametrize("variant", [None, KNOBS[3], KNOBS[2]], ids=["default", "partial", "atomic"])
def test_packed_batches_against_float64(device, name, variant):
    """Sequences of 0, 1, 45 and 70 queries over 23, 1, 60 and 70 keys in one packed batch (and one
    of 30 queries over no key)."""
    causal, fields, with_sinks = FEATURES[name]
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [0, 1, 45, 70, 30], [23, 1, 60, 70, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, dout = (randn(sum(lens_q), 4, 24, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    k, v = (randn(sum(lens_k), 2, 24, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    local = _local(fields, randn(4, dtype=torch.float32, device=device, gen=gen) if with_sinks else None)
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local, cu=(cu_q, cu_k))
    sizes = Varlen(cu_q, cu_k, max(lens_q), max(lens_k))
    got = run(variant or _default(device), q, k, v, dout, causal=causal, scale=0.4, local=local, varlen=sizes)
    assert_grads(got, ref, torch.float16)
    assert torch.all(got[0][-30:] == 0), "rows over no key have no gradient"


@pytest.mark.parametrize(
    ("causal", "fields", "nq", "unseen"),
    [
        (True, {"window_left": 8}, 32, 64),
        (False, {"window_left": 4, "window_right": 4}, 32, 64),
        (True, {"attention_chunk": 32}, 32, 96),
        (False, {"attention_chunk": 32}, 160, 0),
    ],
    ids=["window causal", "window both sides", "chunk", "chunk, more queries"],
)
def test_tiles_no_row_sees_are_not_read(device, causal, fields, nq, unseen):
    """`nq` queries at the end of 128 keys. The first `unseen` keys (whole tiles) lie outside every
    row's window or chunk and hold NaN: no pass reads them, and their gradients are zeros. With
    more queries than keys, the first 32 rows sit at negative positions, where a chunk sees nothing:
    their queries hold NaN, and no dK/dV step reads them (their dQ is zeros)."""
    gen = torch.Generator().manual_seed(nq + unseen)
    q, dout = (randn(1, 2, nq, 24, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    k, v = (randn(1, 2, 128, 24, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    local = _local(fields, randn(2, dtype=torch.float32, device=device, gen=gen))
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local)
    outputs = PrefillCall(q, k, v, causal, 0.4, True, local=local).reference()
    blind = slice(0, max(nq - 128, 0))
    k[:, :, :unseen], v[:, :, :unseen], q[:, :, blind] = float("nan"), float("nan"), float("nan")
    variant = _default(device).replace(dkdv_block_m=32, dkdv_block_n=32, dq_block_m=32, dq_block_n=32)
    grads = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local, forward_outputs=outputs)
    assert_grads(grads, ref, torch.float16)
    assert torch.all(grads[1][:, :, :unseen] == 0) and torch.all(grads[2][:, :, :unseen] == 0)
    assert torch.all(grads[0][:, :, blind] == 0)


@pytest.mark.parametrize(
    ("causal", "fields", "nq", "nk"),
    [
        (True, {"window_left": 100}, 200, 200),
        (False, {"attention_chunk": 128}, 200, 200),
        (True, {"attention_chunk": 64}, 150, 200),
        (False, {"window_left": 70, "window_right": 50}, 200, 150),
        (False, {"window_left": 1}, 163, 38),
        (False, {"window_right": 60, "attention_chunk": 96}, 170, 200),
    ],
    ids=["wide window", "wide chunk", "chunk, fewer queries", "window both sides", "narrow, more queries",
         "right side in chunks"],
)  # fmt: skip
def test_tiles_every_row_sees_whole_skip_the_mask_and_only_those(device, causal, fields, nq, nk):
    """Windows and chunks several tiles wide, so that each pass takes unmasked steps between masked
    ones (a wrong bound of that region lets some row see keys it must not, or lose some it must)."""
    q, k, v, dout, sinks = _inputs(device, nq, nk, seed=nq + nk, batch=1)
    local = _local(fields, sinks)
    ref = reference(q, k, v, dout, causal=causal, scale=0.4, local=local)
    for tile in (16, 32):
        variant = Variant(tile, 2 * tile, 2 * tile, tile, num_warps=4, num_stages=1)
        got = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local)
        assert_grads(got, ref, torch.float16)
    partial = Variant(16, 32, num_warps=4, num_stages=1, dq_mode="partial")
    assert_grads(
        run(partial, q, k, v, dout, causal=causal, scale=0.4, local=local),
        ref,
        torch.float16,
    )


@pytest.mark.parametrize(
    ("causal", "fields"),
    [
        (True, {"window_left": 5}),
        (False, {"window_left": 3, "window_right": 6}),
        (True, {"attention_chunk": 12}),
        (False, {"attention_chunk": 12}),
        (False, {"window_right": 2, "attention_chunk": 12}),
    ],
    ids=["window causal", "window both sides", "chunk causal", "chunk", "right side in chunks"],
)
def test_bounds_at_every_alignment(device, causal, fields):
    """The windows' and chunks' edges fall on every row of a 16-row tile: 16 consecutive differences
    of the lengths (seqlen_k - seqlen_q from -8 to 7) shift them by one row each, so that a bound off
    by one, which drops or adds a tile only where an edge meets a tile's first or last row, fails."""
    variant = Variant(16, 16, 16, 16, num_warps=4, num_stages=1)
    for diag in range(-8, 8):
        gen = torch.Generator().manual_seed(diag + 8)
        q, dout = (randn(1, 2, 40 - diag, 16, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
        k, v = (randn(1, 1, 40, 16, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
        local = _local(fields, None)
        got = run(variant, q, k, v, dout, causal=causal, scale=0.4, local=local)
        assert_grads(got, reference(q, k, v, dout, causal=causal, scale=0.4, local=local), torch.float16)


def test_a_sink_of_minus_infinity_has_no_gradient(device):
    """-inf joins no softmax: its gradient is 0 (not NaN), even where rows see no key (causal, more
    queries than keys: their log-sum-exp is -inf too); the other heads' sinks are checked against
    the closed-form float64 reference."""
    q, k, v, dout, sinks = _inputs(device, 45, 30, seed=13)
    sinks[1] = float("-inf")
    local = Local(window_left=9, sinks=sinks)
    forward = PrefillCall(q, k, v, True, 0.4, True, local=local)
    out, lse, *ref = reference_backward(
        q, k, v, dout, causal=True, scale=0.4, window_size=(9, -1), sinks=sinks
    )
    assert float(ref[3][1]) == 0.0
    call = BackwardCall(forward, out.to(q.dtype), lse.float(), dout, None)
    kernel = base.build(backward.FAMILY, _default(device), call.problem(), gpu_of(q.device))
    grads = [torch.full_like(t, float("nan")) for t in call.outputs()]
    kernel.launch(call.args(*grads))
    assert_grads(grads, ref, torch.float16)
    assert float(grads[3][1]) == 0.0


@pytest.mark.parametrize("name", list(FEATURES))
def test_the_closed_form_reference_is_float64_autograd(name):
    """The tuning case's float64 reference (a few rows at a time, the tanh and the sink's gradient
    written out) against autograd through `attention_reference`."""
    causal, fields, with_sinks = FEATURES[name]
    q, k, v, dout, sinks = _inputs("cpu", 29, 41, seed=len(name))
    local = _local(fields, sinks if with_sinks else None)
    out, lse, *grads = reference_backward(q, k, v, dout, causal=causal, scale=0.4, **local.reference_args())
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.4, **local.reference_args())
    assert torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse)
    for g, r in zip(grads, reference(q, k, v, dout, causal=causal, scale=0.4, local=local), strict=True):
        assert torch.allclose(g, r, atol=1e-12)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_the_tuning_case_runs_and_checks_them(device, varlen):
    """The tuner's case for a Problem with every feature: checked against float64 with the same
    window, chunk, cap and sinks (the sinks' gradient too; a kernel built without them fails it),
    and no peers."""
    features = {"window_left": 9, "attention_chunk": 16, "softcap": True, "sinks": True}
    problem = Problem("backward", "float16", 24, True, 4, 2, 2, 48, 48, varlen=varlen, **features)
    gpu = gpu_of(torch.device(device))
    family = backward.FAMILY
    kernel = base.build(family, family.default_variant(problem, gpu), problem, gpu)
    case = family.case(problem, kernel, torch.device(device), seed=3)
    assert case.error() != case.error()
    case.launch()
    assert case.error() < TOLERANCE["float16"]
    assert case.peers == {}
    plain = dataclasses.replace(problem, window_left=-1, attention_chunk=0, softcap=False)
    blind = base.build(family, family.default_variant(plain, gpu), plain, gpu)
    case = family.case(plain, blind, torch.device(device), seed=3)
    case.launch()
    assert case.error() < TOLERANCE["float16"]  # sinks alone
    case = family.case(problem, blind, torch.device(device), seed=3)
    case.launch()
    assert case.error() > 0.1
