"""Local masks and the float64 reference for sliding windows, chunked local attention, logit softcap
and attention sinks, against FlashAttention's mask definition written out cell by cell, Hugging
Face's mask overlays, gpt-oss's eager sinks and the closed-form sink gradient."""

from __future__ import annotations

import itertools

import pytest
import torch

from tunegen.kernels.masks import attended_pairs, local_mask, normalize_local
from tunegen.kernels.reference import (
    attention_reference,
    attention_varlen_reference,
    causal_mask,
    sampled_error,
)

SIZES = [(1, 1), (1, 9), (9, 1), (7, 7), (5, 23), (23, 5), (19, 70), (70, 19), (37, 37), (0, 5), (5, 0)]
WINDOWS = [(-1, -1), (0, -1), (5, -1), (17, 3), (-1, 9), (3, 0), (-1, 0), (0, 0)]
CHUNKS = [0, 1, 4, 5, 16]
CASES = list(itertools.product(SIZES, WINDOWS, CHUNKS, [False, True]))


def fa_mask(nq: int, nk: int, causal: bool, left: int, right: int, chunk: int) -> torch.Tensor:
    """FlashAttention's definition (hopper/mask.h), one cell at a time: bottom-right aligned,
    causal forces the right side to 0, chunks by floor division."""
    right = 0 if causal else right
    out = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        pos = i + nk - nq
        for j in range(nk):
            ok = (left < 0 or pos - left <= j) and (right < 0 or j <= pos + right)
            if chunk > 0:
                ok = ok and (pos // chunk) * chunk <= j < (pos // chunk) * chunk + chunk
            out[i, j] = ok
    return out


def mask_of(nq: int, nk: int, local: tuple[bool, int, int, int]) -> torch.Tensor:
    causal, left, right, chunk = local
    return local_mask(nq, nk, causal=causal, left=left, right=right, chunk=chunk)


def test_local_mask_is_flash_attentions_definition():
    for (nq, nk), (left, right), chunk, causal in CASES:
        want = fa_mask(nq, nk, causal, left, right, chunk)
        assert torch.equal(mask_of(nq, nk, (causal, left, right, chunk)), want), (nq, nk, left, right, chunk)
    assert torch.equal(causal_mask(70, 19), fa_mask(70, 19, True, -1, -1, 0))


def test_the_mask_of_some_rows_is_those_rows_of_the_whole_mask():
    rows = torch.tensor([69, 0, 51, 50, 3])
    for left, right, chunk, causal in [
        (-1, -1, 0, True),
        (17, 3, 0, False),
        (5, -1, 16, True),
        (-1, 9, 5, False),
    ]:
        full = local_mask(70, 19, causal=causal, left=left, right=right, chunk=chunk)
        got = local_mask(70, 19, causal=causal, left=left, right=right, chunk=chunk, rows=rows)
        assert torch.equal(got, full[rows])


def test_attended_pairs_counts_the_mask():
    for (nq, nk), (left, right), chunk, causal in CASES:
        want = int(mask_of(nq, nk, (causal, left, right, chunk)).sum())
        assert attended_pairs(nq, nk, causal=causal, left=left, right=right, chunk=chunk) == want
    # 128k tokens, causal with a window of 4096 keys (HF's W): every row sees min(p + 1, 4096) keys.
    n, w = 131072, 4096
    assert attended_pairs(n, n, causal=True, left=w - 1) == w * (w + 1) // 2 + (n - w) * w
    assert attended_pairs(n, n, causal=True, chunk=8192) == (n // 8192) * 8192 * 8193 // 2


def test_normalize_local_keeps_the_mask():
    sizes = [*SIZES, (3, 3), (2, 6), (6, 2), (0, 0)]
    for nq, nk in sizes:
        sides = sorted({-1, 0, 1, 2, 4, nq - 2, nq - 1, nq, nk - 2, nk - 1, nk, nk + 3} - {-2, -3})
        for left, right, chunk, causal in itertools.product(
            sides, sides, [0, 1, 3, 4, nk, nk + 1], [False, True]
        ):
            if chunk < 0:
                continue
            raw = (causal, left, right, chunk)
            canon = normalize_local(*raw, nq, nk)
            assert torch.equal(mask_of(nq, nk, canon), mask_of(nq, nk, raw)), (nq, nk, raw, canon)
            assert normalize_local(*canon, nq, nk) == canon
            if canon[0]:
                assert canon[2] == -1
            if nq and nk and canon[3] == 0:  # without a chunk, every bound kept excludes some key
                c, kept_left, kept_right, _ = canon
                if kept_left >= 0:
                    assert not torch.equal(mask_of(nq, nk, (c, -1, kept_right, 0)), mask_of(nq, nk, canon))
                if kept_right >= 0:
                    assert not torch.equal(mask_of(nq, nk, (c, kept_left, -1, 0)), mask_of(nq, nk, canon))
            if nk and canon[3] >= nk:  # a chunk over every key is kept only where it blinds some row
                assert not torch.equal(mask_of(nq, nk, (*canon[:3], 0)), mask_of(nq, nk, canon))


def test_normalize_local_collapses():
    assert normalize_local(True, 4096, -1, 0, 1000, 1000) == (True, -1, -1, 0)
    assert normalize_local(False, 999, 999, 0, 1000, 1000) == (False, -1, -1, 0)
    assert normalize_local(False, 998, 998, 0, 1000, 1000) == (False, 998, 998, 0)
    assert normalize_local(False, 5, 69, 0, 70, 19) == (False, 5, -1, 0)
    assert normalize_local(False, 5, 68, 0, 70, 19) == (False, 5, 68, 0)
    assert normalize_local(True, 5, 0, 0, 100, 100) == (True, 5, -1, 0)
    assert normalize_local(True, 5, 3, 0, 100, 100) == (True, 5, -1, 0)  # FA's override
    assert normalize_local(False, -1, 0, 0, 100, 100) == (True, -1, -1, 0)
    assert normalize_local(False, 5, 0, 0, 100, 100) == (True, 5, -1, 0)  # causal's mask, causal's key
    assert normalize_local(False, -1, 0, 16, 100, 100) == (True, -1, -1, 16)
    assert normalize_local(True, 20, -1, 16, 100, 100) == (True, -1, -1, 16)
    assert normalize_local(False, 15, 15, 16, 100, 100) == (False, -1, -1, 16)
    assert normalize_local(False, 14, 14, 16, 100, 100) == (False, 14, 14, 16)
    assert normalize_local(True, -1, -1, 100, 70, 100) == (True, -1, -1, 0)
    assert normalize_local(False, -1, -1, 100, 100, 100) == (False, -1, -1, 0)
    assert normalize_local(False, -1, -1, 100, 101, 100) == (False, -1, -1, 100)  # row 0 sees nothing
    assert normalize_local(True, -1, -1, 100, 101, 100) == (True, -1, -1, 0)
    for bad in [(False, -2, -1, 0), (False, -1, -2, 0), (False, -1, -1, -1)]:
        with pytest.raises(ValueError):
            normalize_local(*bad, 10, 10)


def test_hugging_face_sliding_window_and_llama4_chunks():
    for (nq, nk), size in itertools.product([(1, 40), (9, 40), (40, 40), (13, 29)], [1, 3, 8, 16, 64]):
        pos = torch.arange(nq)[:, None] + nk - nq
        key = torch.arange(nk)[None, :]
        sliding = (key > pos - size) & (key <= pos)  # masking_utils.sliding_window_overlay + causal
        chunked = (key // size == pos // size) & (key <= pos)  # chunked_overlay + causal
        assert torch.equal(local_mask(nq, nk, causal=True, left=size - 1), sliding)
        assert torch.equal(local_mask(nq, nk, causal=True, chunk=size), chunked)


def inputs(seed: int, nq: int, nk: int, hq: int = 8, hk: int = 2, d: int = 16, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, hk, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, hk, nk, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) * 2
    return q, k, v, sinks, gen


LOCAL = [  # (causal, window_size, attention_chunk)
    (False, (-1, -1), 0),
    (True, (-1, -1), 0),
    (True, (5, -1), 0),
    (False, (17, 3), 0),
    (False, (-1, 9), 0),
    (True, (-1, -1), 16),
    (False, (3, 0), 5),
]
SHAPES = [(19, 70), (70, 19), (37, 37)]


def test_defaults_are_todays_reference():
    q, k, v, _, _ = inputs(11, 70, 19)
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * 0.3
    rows, cols = torch.arange(70)[:, None], torch.arange(19)[None, :]
    scores = scores.masked_fill(~(cols <= rows + 19 - 70), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0) @ v.repeat_interleave(group, 1)
    got, got_lse = attention_reference(q, k, v, causal=True, scale=0.3)
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


@pytest.mark.parametrize(("nq", "nk"), SHAPES, ids=str)
@pytest.mark.parametrize(("causal", "window", "chunk"), LOCAL, ids=str)
def test_sinks_are_gpt_oss_eager(nq, nk, causal, window, chunk):
    q, k, v, sinks, _ = inputs(nq * 100 + nk, nq, nk)
    sinks[0] = float("-inf")  # no sink on head 0
    scale = 0.25
    out, lse = attention_reference(
        q, k, v, causal=causal, scale=scale, window_size=window, attention_chunk=chunk, sinks=sinks
    )
    # modeling_gpt_oss.eager_attention_forward: the sink as an extra column after scaling.
    keys, values = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    logits = (q @ keys.transpose(-1, -2)) * scale
    keep = local_mask(nq, nk, causal=causal, left=window[0], right=window[1], chunk=chunk)
    logits = logits.masked_fill(~keep, float("-inf"))
    combined = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(2, -1, nq, 1)], dim=-1)
    want = torch.nan_to_num(torch.softmax(combined, dim=-1)[..., :-1], nan=0.0) @ values
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(combined, dim=-1), rtol=1e-12, atol=1e-12)
    blind = ~keep.any(dim=1)
    if blind.any():
        assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind]))
        assert torch.equal(lse[:, :, blind], sinks[None, :, None].expand(2, -1, int(blind.sum())))


@pytest.mark.parametrize("cap", [5.0, 50.0])
def test_softcap_caps_scaled_scores_before_the_mask(cap):
    q, k, v, sinks, _ = inputs(7, 37, 37)
    q = q * 4  # scores well into tanh's saturation
    out, lse = attention_reference(
        q, k, v, causal=True, scale=0.5, window_size=(6, -1), softcap=cap, sinks=sinks
    )
    logits = q @ k.repeat_interleave(4, 1).transpose(-1, -2) * 0.5
    logits = (cap * torch.tanh(logits / cap)).masked_fill(
        ~local_mask(37, 37, causal=True, left=6), float("-inf")
    )
    want_lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), sinks[:, None])
    want = torch.exp(logits - want_lse[..., None]) @ v.repeat_interleave(4, 1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("nq", "nk"), SHAPES, ids=str)
@pytest.mark.parametrize(("causal", "window", "chunk"), LOCAL[1:], ids=str)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["dO", "dO+dlse"])
def test_sink_gradient_is_closed_form(nq, nk, causal, window, chunk, with_dlse):
    q, k, v, sinks, gen = inputs(nq * 7 + nk + chunk, nq, nk)
    for t in (q, k, v, sinks):
        t.requires_grad_(True)
    out, lse = attention_reference(
        q, k, v, causal=causal, scale=0.3, window_size=window, attention_chunk=chunk, softcap=4.0, sinks=sinks
    )
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64) if with_dlse else torch.zeros_like(lse)
    grads = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        p_sink = torch.exp(sinks[None, :, None] - lse)  # d lse / d sink
        delta = (d_out * out).sum(dim=-1)
        want = (p_sink * (d_lse - delta)).sum(dim=(0, 2))
    torch.testing.assert_close(grads[3], want, rtol=1e-10, atol=1e-12)
    assert want.abs().min() > 0


def test_varlen_is_each_sequence_alone():
    lens_q, lens_k = [5, 0, 19, 70, 4, 0], [23, 0, 70, 19, 0, 6]
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)])
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), 8, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(8, generator=gen, dtype=torch.float64)
    for causal, window, chunk in LOCAL:
        local = {"window_size": window, "attention_chunk": chunk, "softcap": 3.0, "sinks": sinks}
        out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=0.3, **local)
        for b in range(len(lens_q)):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            seq = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            o, s = attention_reference(*seq, causal=causal, scale=0.3, **local)
            torch.testing.assert_close(out[q0:q1], o[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse[:, q0:q1], s[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(lse[:, cu_q[4] : cu_q[5]], sinks[:, None].expand(-1, 4))  # queries without keys
    assert not out[cu_q[4] : cu_q[5]].any()


def test_sampled_error_sees_the_window():
    q, k, v, sinks, gen = inputs(3, 70, 90)
    local = {"window_size": (5, -1), "attention_chunk": 16, "softcap": 4.0, "sinks": sinks}
    out, _ = attention_reference(q, k, v, causal=True, scale=0.3, **local)
    assert sampled_error(out, q, k, v, causal=True, scale=0.3, rows=16, generator=gen, **local) < 1e-14
    assert sampled_error(out, q, k, v, causal=True, scale=0.3, rows=16, generator=gen) > 1e-2
    wrong = out + 1e-3 * torch.randn(out.shape, generator=gen, dtype=torch.float64)
    assert sampled_error(wrong, q, k, v, causal=True, scale=0.3, rows=16, generator=gen, **local) > 1e-4
