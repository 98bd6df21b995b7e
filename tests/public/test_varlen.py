"""attention_varlen against float64, sequence by sequence, on packed ragged batches."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import DTYPES, REL_TOL, assert_lse, packed, randn, rel_err, run_variant
from tunegen.calls.prefill import Varlen
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.reference import attention_varlen_reference

CASES = [
    ([37, 5, 64, 1], [37, 5, 64, 1], 4, 4, 64),  # self-attention, ragged, a length-1 sequence
    ([20, 0, 33], [50, 9, 33], 8, 2, 80),  # an empty query sequence, GQA, more keys than queries
    ([40, 17], [12, 0], 3, 1, 96),  # an empty key sequence: zeros and -inf
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("lq", "lk", "hq", "hkv", "d"), CASES)
def test_varlen_matches_float64(device, dtype, causal, lq, lk, hq, hkv, d):
    q, k, v, cu_q, cu_k = packed(lq, lk, hq, hkv, d, dtype, device, seed=sum(lq) + d)
    out, lse = tunegen.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=d**-0.5)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize(
    "variant",
    [
        PrefillVariant(block_m=16, block_n=16, load="desc", order="head_inner", reverse_m=True),
        PrefillVariant(block_m=32, block_n=16, causal_split=False),
    ],
    ids=lambda v: v.to_json(),
)
def test_varlen_knobs(device, variant):
    q, k, v, cu_q, cu_k = packed([29, 50, 3], [29, 61, 8], 4, 2, 64, torch.float16, device, seed=11)
    out, lse = run_variant(variant, q, k, v, causal=True, scale=0.125, varlen=Varlen(cu_q, cu_k, 50, 61))
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, scale=0.125)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)


def test_varlen_equals_padded_batch(device):
    """Equal-length packed sequences give what the (B, H, N, D) entry point gives."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (randn(3, 41, 4, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(3))
    cu = torch.arange(0, 4 * 41, 41, dtype=torch.int32, device=device)
    packed_out = tunegen.attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 41, 41, causal=True
    )
    padded = tunegen.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    torch.testing.assert_close(packed_out.view(3, 41, 4, 32), padded.transpose(1, 2), rtol=0, atol=2e-3)
