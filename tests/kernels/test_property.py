"""A property test: on any shape hypothesis draws, the kernel equals float64 attention."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tunegen
from helpers import REL_TOL, assert_lse, rel_err
from tunegen.kernels.reference import attention_reference


@st.composite
def shapes(draw):
    hkv = draw(st.integers(1, 3))
    return {
        "batch": draw(st.integers(1, 3)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 4])),
        "nq": draw(st.integers(1, 90)),
        "nk": draw(st.integers(1, 90)),
        "d": draw(st.sampled_from([16, 24, 32, 40, 64, 72, 80, 96, 112, 128])),
        "causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "dtype": draw(st.sampled_from([torch.float16, torch.float32])),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes())
def test_any_shape_matches_float64(s):
    gen = torch.Generator().manual_seed(s["seed"])
    q = torch.randn(s["batch"], s["hq"], s["nq"], s["d"], generator=gen).to(s["dtype"])
    k = torch.randn(s["batch"], s["hkv"], s["nk"], s["d"], generator=gen).to(s["dtype"])
    v = torch.randn(s["batch"], s["hkv"], s["nk"], s["d"], generator=gen).to(s["dtype"])
    out, lse = tunegen.attention(q, k, v, causal=s["causal"], return_lse=True, strict=True)
    ref, ref_lse = attention_reference(q, k, v, causal=s["causal"], scale=s["d"] ** -0.5)
    if ref.abs().sum() > 0:
        assert rel_err(out, ref) < REL_TOL[s["dtype"]] * 2
    else:
        assert torch.all(out == 0)
    assert_lse(lse, ref_lse, s["dtype"])
