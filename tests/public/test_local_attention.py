"""`tunegen.attention` and `attention_varlen` with the attention of current models (window_size,
attention_chunk, softcap, sinks): against float64 through the public calls, the Problem key they
dispatch under, the checks that name a bad argument, what this release refuses (FP8), the fast
path that must not serve them, and torch.compile (their gradients: test_local_gradients.py)."""

from __future__ import annotations

import os

import pytest
import torch

import tunegen
from helpers import REL_TOL, assert_lse, randn, rel_err
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

CALLS = {
    "gpt-oss": {"causal": True, "window_size": (9, -1), "sinks": True},
    "gemma2": {"causal": True, "window_size": (9, -1), "softcap": 4.0},
    "llama4": {"causal": True, "attention_chunk": 16},
    "every feature": {"window_size": (6, 4), "attention_chunk": 16, "softcap": 4.0, "sinks": True},
}


def _inputs(device, nq, nk, seed):
    gen = torch.Generator().manual_seed(seed)
    q = randn(2, 4, nq, 32, dtype=torch.float16, device=device, gen=gen)
    k, v = (randn(2, 2, nk, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    return q, k, v, randn(4, dtype=torch.float32, device=device, gen=gen)


def _split(kwargs, sinks):
    """The call's keyword arguments with the sinks as a tensor, and the reference's."""
    call = {**kwargs, "sinks": sinks if kwargs.get("sinks") else None}
    ref = {
        k: call[k] for k in ("window_size", "attention_chunk", "softcap", "sinks") if call.get(k) is not None
    }
    return call, ref


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize(("nq", "nk"), [(45, 45), (30, 70)], ids=str)
def test_attention_against_float64(device, name, nq, nk):
    q, k, v, sinks = _inputs(device, nq, nk, seed=nq + nk)
    call, ref_args = _split(CALLS[name], sinks)
    out, lse = tunegen.attention(q, k, v, scale=0.3, return_lse=True, strict=True, **call)
    ref, ref_lse = attention_reference(q, k, v, causal=call.get("causal", False), scale=0.3, **ref_args)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)


@pytest.mark.parametrize("name", ["gpt-oss", "every feature"])
def test_attention_varlen_against_float64(device, name):
    gen = torch.Generator().manual_seed(5)
    cu_q = torch.tensor([0, 1, 40, 70], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 59, 90], dtype=torch.int32, device=device)
    q = randn(70, 4, 32, dtype=torch.float16, device=device, gen=gen)
    k, v = (randn(90, 2, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    call, ref_args = _split(CALLS[name], randn(4, dtype=torch.float32, device=device, gen=gen))
    out, lse = tunegen.attention_varlen(q, k, v, cu_q, cu_k, 39, 39, return_lse=True, strict=True, **call)
    causal = call.get("causal", False)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=32**-0.5, **ref_args)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)


def test_the_fast_path_of_a_plain_call_never_serves_them(device):
    """A plain call first (which keeps a fast path under its launch key), then the same tensors with
    a window: the windowed call is its own, and right."""
    q, k, v, _ = _inputs(device, 45, 45, seed=3)
    plain = tunegen.attention(q, k, v, causal=True)
    assert torch.equal(plain, tunegen.attention(q, k, v, causal=True))  # the fast path, warm
    out = tunegen.attention(q, k, v, causal=True, window_size=(4, -1))
    ref, _ = attention_reference(q, k, v, causal=True, scale=32**-0.5, window_size=(4, -1))
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert rel_err(plain, ref) > 0.1


def test_the_problem_key_holds_the_canonical_mask():
    q, k, v, sinks = _inputs("cpu", 100, 100, seed=4)
    problem = lambda **kw: PrefillCall.dense(q, k, v, **kw).problem(q)
    assert problem(causal=True, window_size=(5000, -1)) == problem(causal=True)  # wider than the keys
    assert problem(window_size=(-1, 0)).causal  # a right side of 0 is the causal mask
    windowed = problem(causal=True, window_size=(8, -1), softcap=2.0, sinks=sinks)
    assert (windowed.window_left, windowed.softcap, windowed.sinks) == (8, True, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window_size": (1, 2, 3)}, "window_size: expected a pair of ints"),
        ({"window_size": (1.5, -1)}, "window_size: expected a pair of ints"),
        ({"window_size": (-2, -1)}, "window_size: expected two ints of at least -1"),
        ({"attention_chunk": -4}, "attention_chunk: expected an int >= 0"),
        ({"attention_chunk": 2.0}, "attention_chunk: expected an int >= 0"),
        ({"softcap": -1.0}, "softcap: expected a finite float >= 0"),
        ({"softcap": float("inf")}, "softcap: expected a finite float >= 0"),
        ({"sinks": torch.zeros(3)}, r"sinks: expected shape \(4,\), one logit per query head"),
        ({"sinks": torch.zeros(4, dtype=torch.int32)}, "sinks: expected a floating-point tensor"),
        ({"window_size": (4, -1), "precision": "fp8"}, "window_size: FP8 attention takes none of"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    q, k, v, _ = _inputs("cpu", 20, 20, seed=6)
    with pytest.raises(ValueError, match=message):
        tunegen.attention(q, k, v, **kwargs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need the interpreter")
def test_fullgraph_compile_passes_them_through_the_custom_op():
    """A second call with another cap recompiles with the cap a traced float, which the checks
    take too."""
    q, k, v, sinks = _inputs("cpu", 37, 37, seed=8)

    def block(q, k, v, sinks, softcap):
        return tunegen.attention(q, k, v, causal=True, window_size=(6, -1), softcap=softcap, sinks=sinks) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    for softcap in (4.0, 5.0):
        out = compiled(q, k, v, sinks, softcap)
        ref, _ = attention_reference(
            q, k, v, causal=True, scale=32**-0.5, window_size=(6, -1), softcap=softcap, sinks=sinks
        )
        assert rel_err(out / 2, ref) < REL_TOL[torch.float16]


def test_a_packed_batch_keeps_a_chunk_wider_than_its_keys(device):
    """Not causal, a chunk of 64 over sequences of at most 30 keys: a dense call would drop it, but
    the packed batch holds a sequence with more queries than keys, whose rows at negative positions
    the chunk blinds."""
    gen = torch.Generator().manual_seed(10)
    cu_q = torch.tensor([0, 30, 40], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10, 40], dtype=torch.int32, device=device)
    q = randn(40, 4, 32, dtype=torch.float16, device=device, gen=gen)
    k, v = (randn(40, 2, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    out, lse = tunegen.attention_varlen(q, k, v, cu_q, cu_k, 30, 30, attention_chunk=64, return_lse=True)
    ref, ref_lse = attention_varlen_reference(
        q, k, v, cu_q, cu_k, causal=False, scale=32**-0.5, attention_chunk=64
    )
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
    assert torch.all(out[:20] == 0), "the first sequence's first 20 rows sit at negative positions"


def test_explain_names_the_problem_they_dispatch_under():
    q, k, v, sinks = _inputs("cpu", 64, 64, seed=12)
    told = tunegen.explain(q, k, v, causal=True, window_size=(8, -1), sinks=sinks)
    assert (told["problem"]["window_left"], told["problem"]["sinks"]) == (8, True)
    with pytest.raises(ValueError, match="window_size: FP8 attention takes none of"):
        tunegen.explain(q, k, v, window_size=(8, -1), precision="fp8")


def test_a_sink_of_minus_infinity_is_no_sink(device):
    """-inf joins no softmax: rows that see no key give zeros and -inf, the others their plain
    softmax (a sink's exp(-inf) is 0)."""
    q, k, v, sinks = _inputs(device, 30, 20, seed=13)
    sinks[1] = float("-inf")
    out, lse = tunegen.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True, scale=32**-0.5, sinks=sinks)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
