"""FlexAttention as tunegen's peer for the attention of current models: its mask_mod, score_mod
and sink renormalization give the float64 reference's output on ragged shapes (more queries than
keys, fewer, GQA, blocks of 128 wholly in and out of sight). Run on the CPU by Flex's eager path
(`torch.compile` stood in for: compiling on the CPU takes minutes); the functions are those the
peer compiles on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tunegen.kernels import peers
from tunegen.kernels.masks import local_mask
from tunegen.kernels.reference import attention_reference

# (seqlen_q, seqlen_k, causal, window_size, attention_chunk, softcap, sinks)
CASES = [
    (200, 330, True, (-1, -1), 0, 0.0, False),
    (330, 200, True, (-1, -1), 0, 0.0, False),
    (300, 300, True, (127, 0), 0, 0.0, True),  # gpt-oss's layer: window and sinks
    (157, 290, False, (60, 9), 0, 0.0, False),
    (290, 157, False, (-1, 20), 0, 0.0, True),
    (260, 260, True, (-1, -1), 0, 2.0, False),  # Gemma 2's cap (small, so that it bites)
    (260, 300, True, (100, -1), 0, 2.0, True),
    (300, 261, True, (-1, -1), 128, 0.0, False),  # Llama 4's chunks
    (211, 300, False, (-1, -1), 64, 0.0, True),
    (300, 211, False, (-1, -1), 64, 0.0, False),  # rows at negative positions see nothing
    (200, 200, False, (-1, -1), 0, 0.0, True),
]


@pytest.fixture
def eager(monkeypatch):
    """The peer's functions run by Flex's eager path: `torch.compile` returns them as they are."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flex_with_the_features_is_the_reference(case, eager):
    nq, nk, causal, window, chunk, softcap, with_sinks = case
    gen = torch.Generator().manual_seed(nq * nk)
    q = torch.randn(2, 4, nq, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, nk, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=gen) * 2 if with_sinks else None
    features = {"window_size": window, "attention_chunk": chunk, "softcap": softcap, "sinks": sinks}
    run = peers.flex(causal, tuple(q.shape), q.device, seqlen_k=nk, **features)
    out = run(q, k, v)
    ref, _ = attention_reference(q, k, v, causal=causal, scale=16**-0.5, **features)
    assert out.dtype == q.dtype
    assert torch.allclose(out, ref, atol=1e-10, rtol=1e-9), (out - ref).abs().max()


def test_the_mask_mod_is_flash_attentions_mask():
    """Cell by cell, the mask_mod the block mask is built from against tunegen's masks, on sizes and
    sides that normalization drops (a window wider than the keys) and keeps."""
    for nq, nk in [(7, 7), (5, 23), (23, 5), (19, 70), (70, 19)]:
        for causal, window, chunk in [
            (True, (-1, -1), 0),
            (False, (5, 2), 0),
            (True, (3, -1), 4),
            (False, (-1, -1), 8),
            (False, (-1, 0), 0),
            (True, (100, -1), 0),
        ]:
            mod = peers.flex_mask_mod(causal, nq, nk, window, chunk)
            rows, cols = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
            zero = torch.zeros((), dtype=torch.int64)
            got = mod(zero, zero, rows, cols) if mod is not None else torch.ones(nq, nk, dtype=torch.bool)
            want = local_mask(nq, nk, causal=causal, left=window[0], right=window[1], chunk=chunk)
            assert torch.equal(got.expand(nq, nk), want), (nq, nk, causal, window, chunk)
    assert peers.flex_mask_mod(False, 9, 9, (-1, -1), 0) is None
    assert peers.flex_mask_mod(False, 9, 9, (8, 8), 0) is None, "a window wider than the keys masks nothing"


def test_sinks_take_their_share_of_each_row():
    """sigmoid(lse - sink) is e^lse / (e^lse + e^sink); a row that sees nothing stays zero."""
    out = torch.ones(1, 2, 3, 4, dtype=torch.bfloat16)
    lse = torch.tensor([[[0.0, 2.0, float("-inf")], [1.0, 1.0, 1.0]]])
    sinks = torch.tensor([0.0, float("-inf")])
    got = peers.with_sinks(out, lse, sinks).float()
    share = torch.tensor([0.5, torch.e**2 / (torch.e**2 + 1), 0.0])
    assert torch.allclose(got[0, 0, :, 0], share, atol=4e-3)
    assert torch.equal(got[0, 1], torch.ones(3, 4)), "a -inf sink is no sink"
    assert peers.flex_score_mod(0.0) is None
    capped = peers.flex_score_mod(50.0)(torch.tensor(120.0), *(torch.tensor(0),) * 4)
    assert torch.isclose(capped, 50 * torch.tanh(torch.tensor(120.0 / 50)))
