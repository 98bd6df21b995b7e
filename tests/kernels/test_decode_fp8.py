"""Decode over an FP8 (e4m3) KV cache: the kernel widens the cache to float16 in registers and must match
float64 on the dequantized cache as tightly as a 16-bit cache does; appended tokens land
quantized exactly as PyTorch rounds them; KVCache's FP8 option calibrates, appends and attends."""

from __future__ import annotations

import math

import pytest
import torch

import tunegen
from helpers import REL_TOL, assert_lse, gathered, make_cache, reference, rel_err, run_decode_variant
from tunegen.kernels import fp8
from tunegen.kernels.families import base, decode
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import TOLERANCE, attention_reference, tolerance


def rows_of(table, b):
    """The cache rows (contiguous: sequence b; paged: its pages) a sequence's descale applies to."""
    return [b] if table is None else table[b].tolist()


def to_fp8(cache, table, descale):
    """Quantize a 16-bit cache with one descale per (sequence, KV head)."""
    out = torch.zeros(cache.shape, dtype=fp8.E4M3, device=cache.device)
    for b in range(descale.shape[0]):
        rows = rows_of(table, b)
        out[rows] = fp8.quantize_kv(cache[rows].flatten(0, 1)[None], descale[b : b + 1]).view(
            cache[rows].shape
        )
    return out


def widened(cache8, table, descale):
    """The float64 values an FP8 cache stands for."""
    out = torch.zeros(cache8.shape, dtype=torch.float64, device=cache8.device)
    for b in range(descale.shape[0]):
        rows = rows_of(table, b)
        out[rows] = cache8[rows].double() * descale[b].double()[None, None, :, None]
    return out


def fp8_reference(q, k_cache, v_cache, table, descales, lengths, scale):
    """float64 attention of q over the values an FP8 cache stands for, and its log-sum-exp."""
    k, v = (widened(c, table, d) for c, d in zip((k_cache, v_cache), descales, strict=True))
    return reference(q, k, v, table, lengths, True, scale)


CASES = [
    # batch, hq, hkv, d, nq, lengths, capacity, page, variant
    (3, 8, 2, 64, 1, [0, 37, 100], 128, 0, decode.DecodeVariant(block_n=16, num_splits=1, num_stages=1)),
    (2, 8, 1, 80, 2, [23, 90], 96, 32, decode.DecodeVariant(block_n=16, num_splits=3, num_stages=1)),
    (
        2,
        4,
        2,
        32,
        3,
        [65, 5],
        96,
        16,
        decode.DecodeVariant(block_n=16, num_splits=2, num_stages=1, pack_gqa=False),
    ),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("batch", "hq", "hkv", "d", "nq", "lengths", "capacity", "page", "variant"), CASES)
def test_fp8_cache_matches_float64_and_appends_quantized(
    device, dtype, batch, hq, hkv, d, nq, lengths, capacity, page, variant
):
    gen = torch.Generator().manual_seed(sum(lengths) + d)
    k16, v16, table = make_cache(batch, hkv, d, lengths, capacity, page, dtype, device, gen)
    descales = [torch.rand(batch, hkv, generator=gen).to(device) * 0.02 + 0.005 for _ in range(2)]
    k_cache, v_cache = to_fp8(k16, table, descales[0]), to_fp8(v16, table, descales[1])
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    new = [torch.randn(batch, nq, hkv, d, generator=gen).to(device, dtype) for _ in range(2)]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table, *new, descales=descales)
    for b, n in enumerate(lengths):
        for cache, tokens, descale in ((k_cache, new[0], descales[0]), (v_cache, new[1], descales[1])):
            written = gathered(cache, table, b, n + nq)[:, n:].view(torch.uint8)
            expected = fp8.quantize_kv(tokens[b : b + 1], descale[b : b + 1])[0].transpose(0, 1)
            assert torch.equal(written, expected.view(torch.uint8)), (
                "appended tokens are rounded as PyTorch does"
            )
    total = [n + nq for n in lengths]
    ref, ref_lse = fp8_reference(q, k_cache, v_cache, table, descales, total, d**-0.5)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


def test_fp8_cache_takes_query_rows_past_float16s_range(device):
    """The products run in float16: bfloat16 query rows beyond its range (an element of 1e5, over
    a head-dim column the keys hold zeros in) are divided by a power of two first, not sent to inf;
    an infinite element poisons its own head only."""
    gen = torch.Generator().manual_seed(71)
    k16, v16, table = make_cache(2, 2, 64, [45, 70], 96, 0, torch.bfloat16, device, gen)
    k16[..., 0] = 0
    descales = [torch.rand(2, 2, generator=gen).to(device) * 0.02 + 0.005 for _ in range(2)]
    k_cache, v_cache = to_fp8(k16, table, descales[0]), to_fp8(v16, table, descales[1])
    q = torch.randn(2, 1, 4, 64, generator=gen).to(device, torch.bfloat16)
    q[..., 0] = 1e5
    seqlens = torch.tensor([45, 70], dtype=torch.int32, device=device)
    variant = decode.DecodeVariant(block_n=16, num_splits=2, num_stages=1)
    out, lse = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table, None, None, descales=descales)
    ref, ref_lse = fp8_reference(q, k_cache, v_cache, table, descales, [45, 70], 0.125)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
    assert_lse(lse, ref_lse, torch.bfloat16)
    # An infinite element makes its own query head NaN, as over a 16-bit cache, and no other head
    # of its KV head's group (the power of two is taken over finite elements).
    q[0, 0, 1, 5] = float("inf")
    out, _ = run_decode_variant(variant, q, k_cache, v_cache, seqlens, table, None, None, descales=descales)
    assert out[0, 0, 1].isnan().all()
    keep = torch.ones(out.shape[:3], dtype=torch.bool, device=device)
    keep[0, 0, 1] = False
    assert not out[keep].isnan().any() and rel_err(out[keep], ref[keep]) < REL_TOL[torch.bfloat16]


def test_public_decode_attention_over_an_fp8_cache(device):
    gen = torch.Generator().manual_seed(70)
    k16, v16, table = make_cache(2, 2, 32, [40, 9], 64, 16, torch.bfloat16, device, gen)
    k_cache, v_cache = (to_fp8(c, table, torch.ones(2, 2, device=device)) for c in (k16, v16))
    q = torch.randn(2, 1, 4, 32, generator=gen).to(device, torch.bfloat16)
    seqlens = torch.tensor([40, 9], dtype=torch.int32, device=device)
    out = tunegen.decode_attention(q, k_cache, v_cache, seqlens, block_table=table, strict=True)
    ones = torch.ones(2, 2, device=device)
    ref, _ = fp8_reference(q, k_cache, v_cache, table, (ones, ones), [40, 9], 32**-0.5)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < REL_TOL[torch.bfloat16], (
        "descales default to 1"
    )
    # One descale given, the other None: the None one is 1, on the first call and on the later
    # calls of the same launch key (on CUDA, the fast path).
    k_descale = torch.rand(2, 2, generator=gen).to(device) + 0.5
    ref, _ = fp8_reference(q, k_cache, v_cache, table, (k_descale, ones), [40, 9], 32**-0.5)
    for _ in range(2):
        out = tunegen.decode_attention(q, k_cache, v_cache, seqlens, block_table=table, k_descale=k_descale)
        assert rel_err(out, ref) < REL_TOL[torch.bfloat16], "a descale not given is 1"


@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_fp8_calibrates_appends_and_attends(device, page_size):
    gen = torch.Generator().manual_seed(71)
    batch, hq, hkv, d = 2, 4, 2, 32
    cache = tunegen.KVCache(batch, 48, hkv, d, dtype=fp8.E4M3, device=device, page_size=page_size)
    half = tunegen.KVCache(batch, 48, hkv, d, dtype=torch.float16, device=device, page_size=page_size)
    keys, values = [], []
    for step, new in enumerate((9, 1, 2)):
        q, k, v = (
            torch.randn(batch, new, h, d, generator=gen).to(device, torch.float16) for h in (hq, hkv, hkv)
        )
        out = cache.attend(0, q, k, v)
        if step == 0:
            expected = k.float().abs().amax(dim=(1, 3)) * 2.0 / fp8.E4M3_MAX
            assert torch.allclose(cache.k_descale[0], expected), "the first append sets the scales"
        keys.append(k)
        values.append(v)
        ref, _ = attention_reference(
            q.transpose(1, 2),
            torch.cat(keys, 1).transpose(1, 2),
            torch.cat(values, 1).transpose(1, 2),
            causal=True,
            scale=d**-0.5,
        )
        assert rel_err(out, ref.transpose(1, 2)) < 0.06, step
        half.attend(0, q, k, v)
        cache.advance(new)
        half.advance(new)
    assert cache.memory().used_bytes * 2 == half.memory().used_bytes


def test_fp8_cache_refusals():
    q = torch.randn(2, 1, 4, 32).half()
    cache = torch.zeros(2, 64, 2, 32, dtype=fp8.E4M3)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: a float8_e4m3fn cache takes float16 or bfloat16 queries"):
        tunegen.decode_attention(q.float(), cache, cache, lens)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(2, 2\), got \(2,\)"):
        tunegen.decode_attention(q, cache, cache, lens, k_descale=torch.ones(2))
    with pytest.raises(ValueError, match=r"v_descale: descales apply to float8_e4m3fn caches"):
        tunegen.decode_attention(q, cache.half(), cache.half(), lens, v_descale=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"v_cache: expected dtype float8_e4m3fn, got torch.float16"):
        tunegen.decode_attention(q, cache, cache.half(), lens)


def test_appended_values_round_to_nearest_even_and_saturate(device):
    """Every tie between neighbouring e4m3 values (normal and subnormal), values just off the
    ties, and values past ±448, appended through the kernel, land as PyTorch rounds them."""
    grid = torch.arange(127, dtype=torch.uint8).view(fp8.E4M3).double()  # 0 .. 448
    ties = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([ties, ties * (1 + 2**-6), ties * (1 - 2**-6), torch.tensor([460.0, 470.0, 1e4])])
    values = torch.cat([values, -values])
    values = torch.cat([values, torch.zeros(1024 - values.numel(), dtype=torch.float64)]).view(1, 16, 1, 64)
    new = values.to(device, torch.float16)
    assert torch.equal(new.double(), values.to(device)), "the test values are exact in float16"
    cache = torch.zeros(1, 16, 1, 64, dtype=fp8.E4M3, device=device)
    v_cache = torch.zeros_like(cache)
    q = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.float16)
    seqlens = torch.zeros(1, dtype=torch.int32, device=device)
    ones = torch.ones(1, 1, device=device)
    tunegen.decode_attention(
        q, cache, v_cache, seqlens, k=new, v=new, k_descale=ones, v_descale=ones, strict=True
    )
    expected = new.float().clamp(-448, 448).to(fp8.E4M3)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("page_size", [0, 16])
def test_the_tuners_fp8_cache_case_checks_the_kernel_it_times(page_size):
    problem = Problem(
        "decode", "bfloat16", 32, True, 4, 2, 2, 1, 64, paged=page_size > 0, page_size=page_size, fp8=True
    )
    gpu = gpu_of(torch.device("cpu"))
    kernel = base.build(decode.FAMILY, decode.FAMILY.default_variant(problem, gpu), problem, gpu)
    case = decode.FAMILY.case(problem, kernel, torch.device("cpu"), seed=4)
    assert math.isnan(case.error()), "unwritten outputs read as NaN"
    case.launch()
    assert case.error() < tolerance(problem) == TOLERANCE["bfloat16"]
    assert decode.FAMILY.measure(problem) == ("GB/s", 2.0 * 2 * 64 * 2 * 32), "one byte per cached value"


def test_pytorch_fallback_appends_quantized_and_attends(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
    gen = torch.Generator().manual_seed(72)
    k16, v16, table = make_cache(2, 2, 32, [20, 7], 64, 16, torch.float16, "cpu", gen)
    descales = [torch.rand(2, 2, generator=gen) * 0.02 + 0.005 for _ in range(2)]
    k_cache, v_cache = to_fp8(k16, table, descales[0]), to_fp8(v16, table, descales[1])
    q = torch.randn(2, 2, 4, 32, generator=gen).half()
    new = [torch.randn(2, 2, 2, 32, generator=gen).half() for _ in range(2)]
    seqlens = torch.tensor([20, 7], dtype=torch.int32)
    out = tunegen.decode_attention(
        q,
        k_cache,
        v_cache,
        seqlens,
        k=new[0],
        v=new[1],
        block_table=table,
        k_descale=descales[0],
        v_descale=descales[1],
    )
    for b, n in enumerate([20, 7]):
        written = gathered(k_cache, table, b, n + 2)[:, n:].view(torch.uint8)
        expected = fp8.quantize_kv(new[0][b : b + 1], descales[0][b : b + 1])[0].transpose(0, 1)
        assert torch.equal(written, expected.view(torch.uint8))
    ref, _ = fp8_reference(q, k_cache, v_cache, table, descales, [22, 9], 32**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
