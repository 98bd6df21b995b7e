"""Decode attention over a KV cache against float64: ragged and empty lengths, page sizes 16 to
256, shuffled block tables, GQA/MQA, 1 to 4 query tokens with causal alignment, appended
tokens, every split count (the combine), packed and unpacked heads, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import REL_TOL, assert_lse, gathered, make_cache, reference, rel_err, run_decode_variant
from tunegen.kernels.families import decode

CASES = [
    # batch, hq, hkv, d, nq, lengths, capacity, page
    (4, 8, 2, 64, 1, [0, 1, 37, 130], 160, 0),
    (3, 8, 8, 64, 2, [5, 64, 100], 128, 16),
    (2, 8, 1, 80, 4, [23, 90], 96, 32),  # MQA, odd head dim
    (3, 16, 2, 32, 3, [1, 200, 0], 256, 64),  # GQA 8
    (2, 4, 1, 64, 1, [255, 3], 512, 256),
    (2, 4, 4, 128, 1, [17, 129], 160, 128),
]
VARIANTS = [
    decode.DecodeVariant(block_n=16, num_splits=1, num_stages=1),
    decode.DecodeVariant(block_n=16, num_splits=3, num_stages=1, pack_gqa=False),
    decode.DecodeVariant(block_n=16, num_splits=4, num_stages=1),
    # Merges in several chunks of rows (MERGE_ROWS below the program's rows), most splits empty.
    decode.DecodeVariant(block_n=16, num_splits=16, num_stages=1),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"splits{v.num_splits}-pack{v.pack_gqa}")
@pytest.mark.parametrize(("batch", "hq", "hkv", "d", "nq", "lengths", "capacity", "page"), CASES)
def test_decode_matches_float64(device, variant, batch, hq, hkv, d, nq, lengths, capacity, page):
    gen = torch.Generator().manual_seed(sum(lengths) + d + nq)
    dtype = torch.float16
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    k_cache, v_cache, table = make_cache(batch, hkv, d, lengths, capacity, page, dtype, device, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table)
    ref, ref_lse = reference(q, k_cache, v_cache, table, lengths, True, d**-0.5)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.all(out[b] == 0), "an empty cache gives zeros"


@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("splits", [1, 2])
def test_appended_tokens_are_written_in_place_then_attended(device, page, splits):
    gen = torch.Generator().manual_seed(40 + page + splits)
    dtype = torch.float16
    batch, hq, hkv, d, nq, new = 3, 8, 2, 64, 2, 2
    lengths = [0, 9, 40]
    k_cache, v_cache, table = make_cache(batch, hkv, d, lengths, 64, page, dtype, device, gen)
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    k_new = torch.randn(batch, new, hkv, d, generator=gen).to(device, dtype)
    v_new = torch.randn(batch, new, hkv, d, generator=gen).to(device, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    variant = decode.DecodeVariant(block_n=16, num_splits=splits, num_stages=1)
    out, lse = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table, k_new, v_new)
    for b, n in enumerate(lengths):
        assert torch.equal(gathered(k_cache, table, b, n + new)[:, n:], k_new[b].transpose(0, 1))
        assert torch.equal(gathered(v_cache, table, b, n + new)[:, n:], v_new[b].transpose(0, 1))
        assert torch.equal(gathered(k_cache, table, b, n), gathered(before_k, table, b, n)), (
            "older tokens kept"
        )
        assert torch.equal(gathered(v_cache, table, b, n), gathered(before_v, table, b, n))
    ref, ref_lse = reference(q, k_cache, v_cache, table, [n + new for n in lengths], True, d**-0.5)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_public_decode_attention(device, dtype, causal):
    gen = torch.Generator().manual_seed(50)
    batch, hq, hkv, d, nq = 2, 4, 2, 64, 3
    lengths = [30, 77]
    k_cache, v_cache, table = make_cache(batch, hkv, d, lengths, 96, 32, dtype, device, gen)
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = tunegen.decode_attention(
        q, k_cache, v_cache, seqlens, block_table=table, causal=causal, return_lse=True, strict=True
    )
    ref, ref_lse = reference(q, k_cache, v_cache, table, lengths, causal, d**-0.5)
    assert out.shape == q.shape and lse.shape == (batch, hq, nq)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


def _inputs():
    q = torch.randn(2, 1, 4, 32).half()
    kc = torch.randn(2, 64, 2, 32).half()
    return q, kc, kc.clone(), torch.tensor([3, 5], dtype=torch.int32)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()},
            r"cache_seqlens: expected a 1-D int32 tensor",
        ),
        (
            lambda a: {**a, "cache_seqlens": torch.tensor([3], dtype=torch.int32)},
            r"cache_seqlens: expected 2 lengths",
        ),
        (
            lambda a: {**a, "cache_seqlens": torch.tensor([3, 70], dtype=torch.int32)},
            r"cache_seqlens: sequence 1 needs 70 slots \(70 cached \+ 0 new\), the cache holds 64",
        ),
        (lambda a: {**a, "v_cache": a["v_cache"][:, :32]}, r"v_cache: expected shape \(2, 64, 2, 32\)"),
        (lambda a: {**a, "q": torch.randn(2, 1, 3, 32).half()}, r"k_cache: the number of query heads \(3\)"),
        (lambda a: {**a, "q": torch.randn(2, 17, 4, 32).half()}, r"q: decode takes at most 16 query tokens"),
        (lambda a: {**a, "k": torch.randn(2, 1, 2, 32).half()}, r"k, v: pass both"),
        (
            lambda a: {**a, "k": torch.randn(2, 65, 2, 32).half(), "v": torch.randn(2, 65, 2, 32).half()},
            r"k: 65 new tokens do not fit the cache's 64 slots per sequence",
        ),
        (
            lambda a: {
                **a,
                "k_cache": torch.randn(4, 24, 2, 32).half(),
                "v_cache": torch.randn(4, 24, 2, 32).half(),
                "block_table": torch.zeros(2, 3, dtype=torch.int32),
            },
            r"k_cache: the page size \(dimension 1\) must be a positive multiple of 16, got 24",
        ),
        (
            lambda a: {
                **a,
                "k_cache": torch.randn(4, 32, 2, 32).half(),
                "v_cache": torch.randn(4, 32, 2, 32).half(),
                "block_table": torch.tensor([[0, 9], [1, 2]], dtype=torch.int32),
                "cache_seqlens": torch.tensor([40, 5], dtype=torch.int32),
            },
            r"block_table: sequence 0 names pages \[9\], outside the cache's pages 0\.\.3",
        ),
    ],
)
def test_decode_rejects(change, pattern):
    q, kc, vc, lens = _inputs()
    args = change({"q": q, "k_cache": kc, "v_cache": vc, "cache_seqlens": lens})
    with pytest.raises(ValueError, match=pattern):
        tunegen.decode_attention(
            args.pop("q"),
            args.pop("k_cache"),
            args.pop("v_cache"),
            args.pop("cache_seqlens"),
            check=True,
            **args,
        )


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page", [0, 16])
def test_lengths_and_pages_that_do_not_fit_give_nan_and_touch_nothing(device, page, splits):
    """Without check=True nothing is read back: a sequence whose length is negative or leaves no
    room for its new tokens gets NaN and writes nothing; one whose block table names a page
    outside the cache gets NaN (its new token, on a valid page, is still written); the others
    are attended and appended as usual; nothing is written anywhere else."""
    gen = torch.Generator().manual_seed(60 + page + splits)
    dtype = torch.float16
    batch, hq, hkv, d, nq, new, capacity = 4, 4, 2, 32, 1, 1, 64
    k_cache, v_cache, table = make_cache(batch, hkv, d, [0] * batch, capacity, page, dtype, device, gen)
    lengths = [20, capacity, -3, 33]  # fits, no room for the new token, negative, fits
    if table is not None:
        table[3, 1] = k_cache.shape[0] + 5  # sequence 3's second page lies outside the cache
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    k_new, v_new = (torch.randn(batch, new, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    variant = decode.DecodeVariant(block_n=16, num_splits=splits, num_stages=1)
    out, lse = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table, k_new, v_new)
    bad = [1, 2, 3] if page else [1, 2]
    good = [b for b in range(batch) if b not in bad]
    assert torch.isnan(out[bad]).all() and torch.isnan(lse[bad]).all()
    assert not torch.isnan(out[good]).any()
    for b in good:
        n = lengths[b]
        assert torch.equal(gathered(k_cache, table, b, n + new)[:, n:], k_new[b].transpose(0, 1))
        one = slice(b, b + 1)
        if table is None:
            ref, _ = reference(q[one], k_cache[one], v_cache[one], None, [n + new], True, d**-0.5)
        else:
            ref, _ = reference(q[one], k_cache, v_cache, table[one], [n + new], True, d**-0.5)
        assert rel_err(out[b : b + 1], ref) < REL_TOL[dtype]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    for b in (0, 3):
        n = lengths[b]
        if table is None:
            written[b, n : n + new] = True
        else:
            written[table[b, n // page].long(), n % page] = True
    assert torch.equal(k_cache[~written], before_k[~written]), "nothing written outside the good slots"
    assert torch.equal(v_cache[~written], before_v[~written])


def test_check_reads_lengths_back_and_names_the_problem(device):
    q, kc, vc, _ = _inputs()
    q, kc, vc = q.to(device), kc.to(device), vc.to(device)
    lens = torch.tensor([3, 70], dtype=torch.int32, device=device)
    out = tunegen.decode_attention(q, kc, vc, lens)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    with pytest.raises(ValueError, match=r"cache_seqlens: sequence 1 needs 70 slots"):
        tunegen.decode_attention(q, kc, vc, lens, check=True)
    from tunegen import decode as module

    module.CHECK = True  # what TUNEGEN_CHECK=1 at import sets
    try:
        with pytest.raises(ValueError, match=r"cache_seqlens: sequence 1 needs 70 slots"):
            tunegen.decode_attention(q, kc, vc, lens)
    finally:
        module.CHECK = False
    assert torch.isnan(tunegen.decode_attention(q, kc, vc, lens, check=False)[1]).all()
