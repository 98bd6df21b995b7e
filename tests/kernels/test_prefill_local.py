"""FlashAttention-2's prefill loop with the attention of current models: sliding windows, chunked
local attention, logit softcapping and attention sinks, alone and as the models combine them,
against float64 at ragged lengths (the queries shorter and longer than the keys, where rows at
negative positions see nothing), GQA, batch 2, packed batches, into poisoned outputs; and key
blocks that no row of a tile sees are never read (NaN keys there leave the output finite)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import H100, REL_TOL, assert_lse, randn, rel_err, run_variant
from tunegen.calls.local import Local
from tunegen.calls.prefill import PrefillCall, Varlen
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

# (causal, window_size, attention_chunk, softcap, sinks)
FEATURES = {
    "window causal (Mistral)": (True, (9, -1), 0, 0.0, False),
    "window both sides": (False, (5, 7), 0, 0.0, False),
    "window right only": (False, (-1, 6), 0, 0.0, False),
    "chunk causal (Llama 4)": (True, (-1, -1), 16, 0.0, False),
    "chunk": (False, (-1, -1), 16, 0.0, False),
    "window in chunks": (True, (20, -1), 16, 0.0, False),
    "softcap causal": (True, (-1, -1), 0, 3.0, False),
    "softcap": (False, (-1, -1), 0, 3.0, False),
    "sinks": (False, (-1, -1), 0, 0.0, True),
    "window and sinks (gpt-oss)": (True, (9, -1), 0, 0.0, True),
    "window and softcap (Gemma 2)": (True, (9, -1), 0, 3.0, False),
    "every feature": (False, (6, 4), 16, 3.0, True),
}


def _run(variant, call: PrefillCall, window, chunk, softcap, sinks):
    """One Variant's launch for `call` with the features, into outputs poisoned with NaN."""
    local = Local(window[0], window[1], chunk, softcap, sinks)
    return run_variant(
        variant, call.q, call.k, call.v, causal=call.causal, scale=call.scale, varlen=call.varlen, local=local
    )


def _variants(device):
    """The default FA2 Variant on this device, and one masking every block, in other tiles."""
    problem = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64)
    default = prefill.fa2_default(problem, gpu_of(torch.device(device)))
    return [default, default.replace(causal_split=False, block_m=16, block_n=16)]


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize(("nq", "nk"), [(37, 37), (29, 77), (77, 29)], ids=str)
def test_features_against_float64(device, name, nq, nk):
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    dtype = torch.float16
    gen = torch.Generator().manual_seed(nq * 31 + nk + len(name))
    q = randn(2, 4, nq, 24, dtype=dtype, device=device, gen=gen)
    k, v = (randn(2, 2, nk, 24, dtype=dtype, device=device, gen=gen) for _ in range(2))
    sinks = randn(4, dtype=torch.float32, device=device, gen=gen) if with_sinks else None
    local = {"window_size": window, "attention_chunk": chunk, "softcap": softcap, "sinks": sinks}
    ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.4, **local)
    call = PrefillCall(q, k, v, causal, 0.4, True)
    for variant in _variants(device):
        out, lse = _run(variant, call, window, chunk, softcap, sinks)
        assert rel_err(out, ref) < REL_TOL[dtype], variant
        assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("name", ["window causal (Mistral)", "chunk", "every feature"])
def test_packed_batches_against_float64(device, name):
    """Sequences of 0, 1, 45 and 70 queries over 23, 1, 60 and 70 keys in one packed batch."""
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    dtype = torch.float16
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [0, 1, 45, 70], [23, 1, 60, 70]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = randn(sum(lens_q), 4, 24, dtype=dtype, device=device, gen=gen)
    k, v = (randn(sum(lens_k), 2, 24, dtype=dtype, device=device, gen=gen) for _ in range(2))
    sinks = randn(4, dtype=torch.float32, device=device, gen=gen) if with_sinks else None
    local = {"window_size": window, "attention_chunk": chunk, "softcap": softcap, "sinks": sinks}
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=0.4, **local)
    call = PrefillCall(q, k, v, causal, 0.4, True, varlen=Varlen(cu_q, cu_k, max(lens_q), max(lens_k)))
    for variant in _variants(device):
        out, lse = _run(variant, call, window, chunk, softcap, sinks)
        assert rel_err(out, ref) < REL_TOL[dtype], variant
        assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize(
    ("causal", "window", "chunk", "unseen"),
    [(True, (8, -1), 0, 64), (False, (4, 4), 0, 64), (True, (-1, -1), 32, 96)],
    ids=["window causal", "window both sides", "chunk"],
)
def test_blocks_no_row_sees_are_not_read(device, causal, window, chunk, unseen):
    """32 queries at the end of 128 keys: the first `unseen` keys (whole 32-key blocks) lie outside
    every row's window or chunk, and hold NaN; the output matches float64 on the clean keys."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(unseen)
    q = randn(1, 2, 32, 24, dtype=dtype, device=device, gen=gen)
    k, v = (randn(1, 2, 128, 24, dtype=dtype, device=device, gen=gen) for _ in range(2))
    ref, _ = attention_reference(q, k, v, causal=causal, scale=0.4, window_size=window, attention_chunk=chunk)
    k[:, :, :unseen], v[:, :, :unseen] = float("nan"), float("nan")
    call = PrefillCall(q, k, v, causal, 0.4, True)
    variant = _variants(device)[0].replace(block_m=32, block_n=32)
    out, _ = _run(variant, call, window, chunk, 0.0, None)
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("causal", [False, True])
def test_float32_keeps_float32_accuracy_under_the_cap(device, causal):
    """The cap takes the GPU's tanh.approx only for 16-bit inputs: its 2^-11 would cost float32
    twenty times its own error (scores scaled up so that the cap bends them)."""
    gen = torch.Generator().manual_seed(11)
    q = randn(2, 4, 77, 24, dtype=torch.float32, device=device, gen=gen) * 4
    k, v = (randn(2, 2, 90, 24, dtype=torch.float32, device=device, gen=gen) for _ in range(2))
    ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.4, softcap=10.0)
    call = PrefillCall(q, k, v, causal, 0.4, True)
    problem = Problem("prefill", "float32", 24, causal, 4, 2, 2, 77, 90, softcap=True)
    variant = prefill.FAMILY.default_variant(problem, gpu_of(q.device))
    out, lse = _run(variant, call, (-1, -1), 0, 10.0, None)
    assert rel_err(out, ref) < REL_TOL[torch.float32]
    assert_lse(lse, ref_lse, torch.float32)


def test_fp8_refuses_the_features_by_name():
    """The Hopper schedule renders them too (test_prefill_ws_local.py); FP8 prefill does not."""
    problem = Problem("prefill", "bfloat16", 128, True, 16, 4, 2, 4096, 4096, window_left=4095, fp8=True)
    with pytest.raises(ValueError, match=r"fp8 prefill renders no \['window_left'\]"):
        prefill.FAMILY.check_variant(prefill.fa2_default(problem, H100), problem, H100)


def test_the_tuning_case_runs_and_checks_them(device):
    """The tuner's case for a Problem with every feature: its check is against float64 with the same
    window, chunk, cap and sinks (a kernel built without them fails it), and SDPA times nothing."""
    features = {"window_left": 9, "attention_chunk": 16, "softcap": True, "sinks": True}
    problem = Problem("prefill", "float16", 24, True, 4, 2, 2, 48, 48, return_lse=True, **features)
    gpu = gpu_of(torch.device(device))
    kernel = base.build(prefill.FAMILY, prefill.FAMILY.default_variant(problem, gpu), problem, gpu)
    case = prefill.FAMILY.case(problem, kernel, torch.device(device), seed=3)
    case.launch()
    assert case.error() < REL_TOL[torch.float16]
    assert case.peers == {}
    plain = dataclasses.replace(problem, window_left=-1, attention_chunk=0, softcap=False, sinks=False)
    blind = base.build(prefill.FAMILY, prefill.FAMILY.default_variant(plain, gpu), plain, gpu)
    case = prefill.FAMILY.case(problem, blind, torch.device(device), seed=3)
    case.launch()
    assert case.error() > 0.1


@pytest.mark.parametrize(
    ("causal", "window", "chunk", "nq", "nk"),
    [
        (True, (100, -1), 0, 256, 256),
        (False, (-1, -1), 128, 256, 256),
        (True, (-1, -1), 64, 200, 256),
        (False, (70, 50), 0, 256, 200),
        (False, (1, -1), 0, 163, 38),
    ],
    ids=["wide window", "wide chunk", "chunk, fewer queries", "window both sides", "narrow, more queries"],
)
def test_blocks_every_row_sees_whole_skip_the_mask_and_only_those(device, causal, window, chunk, nq, nk):
    """Windows and chunks several blocks wide, so that tiles take unmasked steps between masked ones
    (a wrong bound of that region lets some row see keys it must not)."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(nq + nk + chunk)
    q = randn(1, 2, nq, 24, dtype=dtype, device=device, gen=gen)
    k, v = (randn(1, 1, nk, 24, dtype=dtype, device=device, gen=gen) for _ in range(2))
    ref, ref_lse = attention_reference(
        q, k, v, causal=causal, scale=0.4, window_size=window, attention_chunk=chunk
    )
    call = PrefillCall(q, k, v, causal, 0.4, True)
    for block in (16, 32):
        variant = _variants(device)[0].replace(block_m=block, block_n=block, causal_split=True)
        out, lse = _run(variant, call, window, chunk, 0.0, None)
        assert rel_err(out, ref) < REL_TOL[dtype], block
        assert_lse(lse, ref_lse, dtype)
