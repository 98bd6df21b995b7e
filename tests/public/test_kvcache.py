"""KVCache: a decode loop over several layers gives float64 attention over everything appended,
without concatenation, at any page size that is a multiple of 16; pages are handed out on demand
and returned on reset; a refused call changes nothing, and no call reads or writes a page the
sequence does not own."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import DECODE_PATHS, REL_TOL, on_path, rel_err
from tunegen.kernels.reference import attention_reference


@pytest.fixture(params=DECODE_PATHS)
def path(request, monkeypatch):
    return on_path(request.param, monkeypatch)


@pytest.mark.parametrize("page_size", [None, 16, 32, 48])
def test_a_decode_loop_matches_attention_over_everything_appended(device, page_size):
    gen = torch.Generator().manual_seed(60)
    batch, hq, hkv, d, layers = 2, 4, 2, 32, 2
    cache = tunegen.KVCache(
        batch, 80, hkv, d, num_layers=layers, dtype=torch.float16, device=device, page_size=page_size
    )
    history = [([], []) for _ in range(layers)]
    for step, new in enumerate((7, 1, 1, 3)):  # a prompt, then decode steps
        for layer in range(layers):
            q = torch.randn(batch, new, hq, d, generator=gen).to(device, torch.float16)
            k = torch.randn(batch, new, hkv, d, generator=gen).to(device, torch.float16)
            v = torch.randn(batch, new, hkv, d, generator=gen).to(device, torch.float16)
            out = cache.attend(layer, q, k, v)
            history[layer][0].append(k)
            history[layer][1].append(v)
            keys = torch.cat(history[layer][0], 1).transpose(1, 2)
            values = torch.cat(history[layer][1], 1).transpose(1, 2)
            ref, _ = attention_reference(q.transpose(1, 2), keys, values, causal=True, scale=d**-0.5)
            assert rel_err(out, ref.transpose(1, 2)) < REL_TOL[torch.float16], (step, layer)
        cache.advance(new)
    assert cache.lengths() == [12, 12] and cache.seqlens.tolist() == [12, 12]
    memory = cache.memory()
    assert memory.tokens == 24 and memory.used_bytes == 24 * 2 * layers * hkv * d * 2
    if page_size is not None:
        assert memory.pages_used == batch * -(-12 // page_size)


def test_pages_are_given_out_on_demand_and_returned():
    cache = tunegen.KVCache(3, 64, 1, 16, dtype=torch.float16, device="cpu", page_size=16, num_pages=6)
    assert cache.memory().pages_free == 6
    cache.reserve(20)
    cache.advance(20)
    assert cache.memory().pages_used == 6 and cache.memory().pages_free == 0
    used = cache.block_table[:, :2].flatten().tolist()
    assert sorted(used) == list(range(6)), "each page belongs to one sequence"
    with pytest.raises(ValueError, match="page pool is exhausted"):
        cache.reserve(20)
    cache.reset(1)
    assert cache.lengths() == [20, 0, 20] and cache.memory().pages_free == 2
    cache.reset()
    assert cache.memory().pages_free == 6 and cache.seqlens.tolist() == [0, 0, 0]


def test_capacity_and_arguments_are_checked():
    cache = tunegen.KVCache(1, 32, 1, 16, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="would hold 40 tokens, capacity is 32"):
        cache.reserve(40)
    with pytest.raises(ValueError, match="new_tokens: sequence 0 would hold 33 tokens, capacity is 32"):
        cache.advance(33)
    with pytest.raises(ValueError, match="layer: expected an int from 0 to 0, got 1"):
        cache.attend(1, torch.randn(1, 1, 1, 16).half())
    with pytest.raises(ValueError, match="page_size: expected a positive multiple of 16"):
        tunegen.KVCache(1, 32, 1, 16, device="cpu", page_size=24)
    with pytest.raises(ValueError, match="capacity: expected a positive int"):
        tunegen.KVCache(1, 0, 1, 16, device="cpu")


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda c: c.reset(-1), r"sequence: expected None or an int from 0 to 1, got -1"),
        (lambda c: c.reset(2), r"sequence: expected None or an int from 0 to 1, got 2"),
        (lambda c: c.advance(-1), r"new_tokens: expected an int of at least 0, got -1"),
        (lambda c: c.reserve(1.5), r"new_tokens: expected an int of at least 0, got 1.5"),
        (lambda c: c.attend(True, torch.randn(2, 1, 2, 16).half()), r"layer: expected an int from 0 to 0"),
    ],
)
def test_methods_refuse_what_would_touch_another_sequence(call, pattern):
    """reset(-1) emptied the last sequence and advance(-1) made lengths negative."""
    cache = tunegen.KVCache(2, 64, 1, 16, dtype=torch.float16, device="cpu", page_size=16)
    cache.advance(5)
    with pytest.raises(ValueError, match=pattern):
        call(cache)
    assert cache.lengths() == [5, 5] and cache.seqlens.tolist() == [5, 5]
    assert cache.memory().pages_used == 2


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_pages": 4}, r"num_pages: applies to a paged cache \(give page_size\), got 4"),
        ({"page_size": 16, "num_pages": 2.5}, r"num_pages: expected a positive int, got 2.5"),
        ({"page_size": 16, "num_pages": 0}, r"num_pages: expected a positive int, got 0"),
        (
            {"dtype": torch.int8},
            r"dtype: expected float16, bfloat16, float32 or float8_e4m3fn, got torch\.int8",
        ),
        ({"batch": True}, r"batch: expected a positive int, got True"),
    ],
)
def test_constructor_arguments_are_checked(kwargs, pattern):
    args = {"batch": 1, "capacity": 32, "kv_heads": 1, "head_dim": 16, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=pattern):
        tunegen.KVCache(**args)


def test_an_exhausted_pool_takes_no_pages():
    cache = tunegen.KVCache(3, 64, 1, 16, dtype=torch.float16, device="cpu", page_size=16, num_pages=5)
    with pytest.raises(ValueError, match=r"new_tokens: the page pool is exhausted \(5 free, 6 needed\)"):
        cache.reserve(20)
    assert cache.memory().pages_free == 5 and cache.block_table.eq(-1).all()


def test_pages_past_a_sequences_own_are_minus_one_and_advance_takes_its_pages(path):
    """A block table entry a sequence does not own names no page (-1), never page 0 of another
    sequence; advance() without attend() (tokens written by the caller) takes the pages too."""
    device, _ = path
    cache = tunegen.KVCache(2, 64, 1, 16, dtype=torch.float16, device=device, page_size=16)
    cache.advance(20)
    table = cache.block_table.tolist()
    assert sorted(table[0][:2] + table[1][:2]) == [0, 1, 2, 3] and table[0][2:] == table[1][2:] == [-1, -1]
    cache.reset(0)
    assert cache.block_table[0].eq(-1).all() and cache.memory().pages_free == 6
    out = cache.attend(0, torch.randn(2, 1, 1, 16, device=device, dtype=torch.float16))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["fp16", "fp8"])
def test_a_refused_attend_changes_nothing(path, fp8_cache):
    device, _ = path
    dtype = torch.float8_e4m3fn if fp8_cache else torch.float16
    cache = tunegen.KVCache(2, 32, 1, 16, dtype=dtype, device=device, page_size=16)
    q = torch.randn(2, 1, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(2, 3, 1, 16, device=device, dtype=torch.float16)
    state = lambda: (
        cache.lengths(),
        cache.memory(),
        cache.block_table.tolist(),
        cache.k.view(torch.uint8).clone(),
        cache.k_descale.clone() if fp8_cache else None,
    )
    before = state()
    with pytest.raises(ValueError, match=r"v: expected \(batch 2, new_tokens, kv_heads 1, head_dim\)"):
        cache.attend(0, q, k, k[:1])
    with pytest.raises(ValueError, match=r"k: sequence 0 would hold 40 tokens, capacity is 32"):
        cache.attend(0, q, *(torch.randn(2, 40, 1, 16, device=device, dtype=torch.float16) for _ in "kv"))
    with pytest.raises(ValueError, match=r"k: expected a torch.Tensor"):
        cache.attend(0, q, [1.0], k)
    after = state()
    assert after[:3] == before[:3] and torch.equal(after[3], before[3])
    assert not fp8_cache or torch.equal(after[4], before[4])
