"""Decode over a KV cache with the attention of current models (sliding windows, chunks, logit
softcap, attention sinks): against float64 for contiguous and paged caches, one query token and
several, ragged lengths, GQA packed or not, one split or several (sinks join the merge), into
poisoned outputs; cache pages before a window's first key hold NaN and are never read; repeat
calls take the fast path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tunegen
from helpers import H100, NEEDS_GPU, REL_TOL, assert_lse, gathered, make_cache, rel_err
from tunegen.calls.decode import DecodeCall
from tunegen.kernels import dispatch
from tunegen.kernels.families import base, decode
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference

# (causal, window_size, attention_chunk, softcap, sinks)
FEATURES = {
    "window (gpt-oss)": (True, (11, -1), 0, 0.0, True),
    "window and cap (Gemma 2)": (True, (11, -1), 0, 2.0, False),
    "chunk (Llama 4)": (True, (-1, -1), 32, 0.0, False),
    "every feature": (False, (20, 1), 32, 2.0, True),
}
VARIANTS = [
    decode.DecodeVariant(block_n=16, num_splits=1, pack_gqa=True),
    decode.DecodeVariant(block_n=16, num_splits=3, pack_gqa=False),
]
LENGTHS = [0, 2, 40, 77]  # 2: fewer keys than three query tokens


def _reference(q, k_cache, v_cache, table, lengths, causal, local, sinks):
    """float64, one sequence at a time over its gathered keys; no key: zeros and the sink."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64, device=q.device
    )
    for b, n in enumerate(lengths):
        if n == 0:
            if sinks is not None:
                lse[b] = sinks.double()[:, None]
            continue
        keys, values = (gathered(c, table, b, n)[None] for c in (k_cache, v_cache))
        o, s = attention_reference(
            q[b].transpose(0, 1)[None], keys, values, causal=causal, scale=0.3, sinks=sinks, **local
        )
        out[b], lse[b] = o[0].transpose(0, 1), s[0]
    return out, lse


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("page", [0, 16])
def test_features_against_float64(device, name, nq, page):
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    dtype = torch.float16
    gen = torch.Generator().manual_seed(nq * 7 + page + len(name))
    k_cache, v_cache, table = make_cache(4, 2, 24, LENGTHS, 96, page, dtype, device, gen)
    q = torch.randn(4, nq, 4, 24, generator=gen).to(device, dtype)
    sinks = torch.randn(4, generator=gen).to(device) if with_sinks else None
    seqlens = torch.tensor(LENGTHS, dtype=torch.int32, device=device)
    local = {"window_size": window, "attention_chunk": chunk, "softcap": softcap}
    ref, ref_lse = _reference(q, k_cache, v_cache, table, LENGTHS, causal, local, sinks)
    call = DecodeCall.checked(
        q,
        k_cache,
        v_cache,
        seqlens,
        block_table=table,
        causal=causal,
        scale=0.3,
        return_lse=True,
        sinks=sinks,
        **local,
    )
    for variant in VARIANTS:
        out, lse = call.outputs()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        kernel = base.build(decode.FAMILY, variant, call.problem(), gpu_of(q.device))
        kernel.launch(call.args(out, lse))
        assert rel_err(out, ref) < REL_TOL[dtype], variant
        assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("page", [0, 16])
def test_pages_before_the_window_are_never_read(device, page):
    """One query token at position 95 with a window of 20 keys back: its keys start at 75, so the
    cache's first 64 slots (whole 16-key pages) hold NaN and must not reach the output, with one
    split or several, through the public call, and (contiguous) with key tiles of 128, whose
    first holds them: no slot before the first key seen is loaded."""
    import tunegen

    dtype = torch.float16
    gen = torch.Generator().manual_seed(3 + page)
    k_cache, v_cache, table = make_cache(2, 2, 24, [96, 96], 96, page, dtype, device, gen)
    q = torch.randn(2, 1, 4, 24, generator=gen).to(device, dtype)
    ref, _ = _reference(q, k_cache, v_cache, table, [96, 96], True, {"window_size": (20, -1)}, None)
    for b in range(2):
        if table is None:
            k_cache[b, :64], v_cache[b, :64] = float("nan"), float("nan")
        else:
            k_cache[table[b, :4].long()], v_cache[table[b, :4].long()] = float("nan"), float("nan")
    seqlens = torch.tensor([96, 96], dtype=torch.int32, device=device)
    call = DecodeCall.checked(
        q, k_cache, v_cache, seqlens, block_table=table, scale=0.3, window_size=(20, -1)
    )
    wide = [decode.DecodeVariant(block_n=128, num_splits=2, pack_gqa=True)] if page == 0 else []
    for variant in VARIANTS + wide:
        out, lse = call.outputs()
        base.build(decode.FAMILY, variant, call.problem(), gpu_of(q.device)).launch(call.args(out, lse))
        assert rel_err(out, ref) < REL_TOL[dtype], variant
    out = tunegen.decode_attention(
        q, k_cache, v_cache, seqlens, block_table=table, scale=0.3, window_size=(20, -1), strict=True
    )
    assert rel_err(out, ref) < REL_TOL[dtype]


def test_decode_attention_checks_them_by_name():
    import tunegen

    q = torch.randn(1, 1, 4, 16)
    cache = torch.randn(1, 8, 2, 16)
    seqlens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        tunegen.decode_attention(q, cache, cache, seqlens, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="window_size: expected a pair of ints"):
        tunegen.decode_attention(q, cache, cache, seqlens, window_size=5)


@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_steps_with_a_window_and_sinks(device, page_size):
    """gpt-oss's decode through `KVCache.attend`: tokens appended one step at a time, each step's
    output against float64 over everything cached; a refused call takes no page."""
    import tunegen

    gen = torch.Generator().manual_seed(21)
    cache = tunegen.KVCache(2, 48, 2, 16, dtype=torch.float16, device=device, page_size=page_size)
    sinks = torch.randn(4, generator=gen).to(device)
    keys, values = [], []
    for step in range(16):  # then the next token needs a page of its own
        q, k, v = (torch.randn(2, 1, h, 16, generator=gen).to(device, torch.float16) for h in (4, 2, 2))
        keys.append(k)
        values.append(v)
        out = cache.attend(0, q, k, v, window_size=(6, -1), sinks=sinks)
        cache.advance(1)
        kk, vv = (torch.cat(t, dim=1).transpose(1, 2) for t in (keys, values))
        ref, _ = attention_reference(
            q.transpose(1, 2), kk, vv, causal=True, scale=16**-0.5, window_size=(6, -1), sinks=sinks
        )
        assert rel_err(out, ref.transpose(1, 2)) < REL_TOL[torch.float16], step
    before = (cache.lengths(), cache.memory())
    with pytest.raises(ValueError, match="window_size: expected a pair of ints"):
        cache.attend(0, q, k, v, window_size=6)
    assert (cache.lengths(), cache.memory()) == before


def test_the_tuning_case_runs_and_checks_them(device):
    """The tuner's case for a decode Problem with every feature checks against float64 with them
    (a kernel built without them fails it) and times no SDPA peer."""
    from tunegen.kernels.problem import Problem

    features = {"window_left": 9, "attention_chunk": 32, "softcap": True, "sinks": True}
    problem = Problem("decode", "float16", 16, True, 4, 2, 2, 2, 64, return_lse=True, **features)
    plain = Problem("decode", "float16", 16, True, 4, 2, 2, 2, 64, return_lse=True)
    gpu = gpu_of(torch.device(device))
    for built, good in ((problem, True), (plain, False)):
        kernel = base.build(decode.FAMILY, decode.FAMILY.default_variant(built, gpu), built, gpu)
        case = decode.FAMILY.case(problem, kernel, torch.device(device), seed=4)
        case.launch()
        assert (case.error() < REL_TOL[torch.float16]) == good
        assert case.peers == {}


def test_appended_tokens_with_several_queries(device):
    """Three new tokens appended and attended by three query tokens under every feature: the
    window's first key counts the new tokens."""
    causal, window, chunk, softcap, _ = FEATURES["every feature"]
    dtype = torch.float16
    gen = torch.Generator().manual_seed(41)
    lengths = [0, 30, 61]
    k_cache, v_cache, table = make_cache(3, 2, 24, lengths, 64, 16, dtype, device, gen)
    q = torch.randn(3, 3, 4, 24, generator=gen).to(device, dtype)
    k, v = (torch.randn(3, 3, 2, 24, generator=gen).to(device, dtype) for _ in range(2))
    sinks = torch.randn(4, generator=gen).to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    local = {"window_size": window, "attention_chunk": chunk, "softcap": softcap}
    for variant in VARIANTS:
        kc, vc = k_cache.clone(), v_cache.clone()
        call = DecodeCall.checked(
            q, kc, vc, seqlens, k=k, v=v, block_table=table, causal=causal, scale=0.3, sinks=sinks, **local
        )
        out, lse = call.outputs()
        base.build(decode.FAMILY, variant, call.problem(), gpu_of(q.device)).launch(call.args(out, lse))
        ref, _ = _reference(q, kc, vc, table, [n + 3 for n in lengths], causal, local, sinks)
        assert rel_err(out, ref) < REL_TOL[dtype], variant


def test_pages_freed_before_a_window_or_chunk_serve_every_path_alike(device):
    """A paged sequence whose block table names no page before its window's (or chunk's) first
    key: the kernel, the PyTorch path and check=True all take it, with float64's answer."""
    import tunegen

    dtype = torch.float16
    gen = torch.Generator().manual_seed(43)
    k_cache, v_cache, _ = make_cache(1, 2, 24, [90], 96, 16, dtype, device, gen)
    table = torch.tensor([[-1, -1, -1, -1, 4, 5]], dtype=torch.int32, device=device)
    q = torch.randn(1, 1, 4, 24, generator=gen).to(device, dtype)
    seqlens = torch.tensor([90], dtype=torch.int32, device=device)
    for local in ({"window_size": (20, -1)}, {"attention_chunk": 64}):
        # Positions 64 to 89 (pages 4 and 5): the same mask over them, a chunk starting at 64.
        keys, values = (
            c[table[0, 4:].long()].reshape(1, 32, 2, 24)[:, :26].transpose(1, 2) for c in (k_cache, v_cache)
        )
        ref, _ = attention_reference(q.transpose(1, 2), keys, values, causal=True, scale=0.3, **local)
        call = DecodeCall.checked(q, k_cache, v_cache, seqlens, block_table=table, scale=0.3, **local)
        for variant in VARIANTS:
            out, lse = call.outputs()
            base.build(decode.FAMILY, variant, call.problem(), gpu_of(q.device)).launch(call.args(out, lse))
            assert rel_err(out, ref.transpose(1, 2)) < REL_TOL[dtype], (local, variant)
        fallback, _ = call.fallback()
        assert rel_err(fallback, ref.transpose(1, 2)) < REL_TOL[dtype], local
        tunegen.decode_attention(
            q, k_cache, v_cache, seqlens, block_table=table, scale=0.3, check=True, **local
        )


@pytest.mark.parametrize(("batch", "splits"), [(1, 16), (8, 2), (32, 1)])
def test_a_window_takes_longer_programs_within_one_wave(batch, splits):
    """Under a window the default's programs over a contiguous cache stay within one wave (H100:
    132 SMs, 8 KV heads) over key tiles of 128; the whole cache keeps splitting until they cover
    it, and a paged cache takes the whole cache's Variant."""
    window = Problem("decode", "bfloat16", 128, True, 32, 8, batch, 1, 32768, window_left=4095)
    default = decode.FAMILY.default_variant(window, H100)
    assert (default.block_n, default.num_splits) == (128, splits)
    assert default.num_splits == 1 or batch * 8 * default.num_splits <= H100.sm_count
    paged = dataclasses.replace(window, paged=True, page_size=64)
    whole_paged = dataclasses.replace(paged, window_left=-1)
    assert decode.FAMILY.default_variant(paged, H100) == decode.FAMILY.default_variant(whole_paged, H100)
    whole = decode.FAMILY.default_variant(dataclasses.replace(window, window_left=-1), H100)
    assert whole.block_n == 64 and batch * 8 * whole.num_splits >= min(H100.sm_count, batch * 8 * 32)
    # A right side alone reads the whole cache; a narrow window splits no further than its tiles.
    right = dataclasses.replace(window, window_left=-1, window_right=1, causal=False, seqlen_q=4)
    assert decode.FAMILY.default_variant(right, H100) == decode.FAMILY.default_variant(
        dataclasses.replace(right, window_right=-1), H100
    )
    narrow = decode.FAMILY.default_variant(dataclasses.replace(window, window_left=127), H100)
    assert narrow.num_splits == 1


def test_what_decode_refuses_and_takes():
    """Values that only look like defaults are refused on every path; sinks that autograd records
    are taken (decode has no backward); a refused KVCache call (a bad scale) takes no page."""
    import tunegen

    q = torch.randn(1, 1, 4, 16)
    cache = torch.randn(1, 8, 2, 16)
    seqlens = torch.tensor([4], dtype=torch.int32)
    tunegen.decode_attention(q, cache, cache, seqlens)  # a plain call first
    with pytest.raises(ValueError, match="attention_chunk: expected an int >= 0"):
        tunegen.decode_attention(q, cache, cache, seqlens, attention_chunk=0.0)
    with pytest.raises(ValueError, match="softcap: expected a finite float >= 0"):
        tunegen.decode_attention(q, cache, cache, seqlens, softcap=False)
    sinks = torch.zeros(4, requires_grad=True)
    tunegen.decode_attention(q, cache, cache, seqlens, sinks=sinks)
    paged = tunegen.KVCache(1, 32, 2, 16, dtype=torch.float16, device="cpu", page_size=16)
    before = (paged.lengths(), paged.memory())
    k = torch.randn(1, 1, 2, 16).half()
    with pytest.raises(ValueError, match="scale"):
        paged.attend(0, q.half(), k, k, scale=-1.0)
    assert (paged.lengths(), paged.memory()) == before


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("page", [0, 16])
def test_repeat_calls_with_the_features_take_the_fast_path(page):
    """A call with a window, the cap and sinks binds its launch once and repeats it without a
    check or a device wait, as a plain call does; new sinks values are read per call, and another
    window or cap is another launch, not the first one's."""
    gen = torch.Generator().manual_seed(page)
    q = torch.randn(3, 1, 4, 64, generator=gen).to("cuda", torch.float16)
    k_cache, v_cache, table = make_cache(3, 2, 64, [5, 60, 96], 96, page, torch.float16, "cuda", gen)
    lengths = torch.tensor([5, 60, 96], dtype=torch.int32, device="cuda")
    sinks = torch.randn(4, generator=gen).to("cuda")
    features = {"window_size": (20, -1), "softcap": 2.0, "block_table": table, "scale": 0.3}

    def checked(**changes):
        args = {**features, "sinks": sinks, **changes}
        return tunegen.decode_attention(q, k_cache, v_cache, lengths, check=True, **args)

    dispatch.forget()
    first = tunegen.decode_attention(q, k_cache, v_cache, lengths, sinks=sinks, **features)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = tunegen.decode_attention(q, k_cache, v_cache, lengths, sinks=sinks, **features)
        moved = tunegen.decode_attention(q, k_cache, v_cache, lengths, sinks=sinks + 1.0, **features)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(dispatch.fast_calls) == 1
    assert torch.equal(first, again) and torch.equal(first, checked())
    assert torch.equal(moved, checked(sinks=sinks + 1.0)) and not torch.equal(moved, first)
    for changes in ({"window_size": (30, -1)}, {"softcap": 3.0}, {"sinks": None}):
        out = tunegen.decode_attention(
            q, k_cache, v_cache, lengths, **{**features, "sinks": sinks, **changes}
        )
        assert torch.equal(out, checked(**changes))
    assert len(dispatch.fast_calls) == 4, "each other window, cap or sinks is a launch of its own"
