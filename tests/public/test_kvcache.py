"""KVCache: a decode loop over several layers gives float64 attention over everything appended,
without concatenation; pages are handed out on demand and returned on reset."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import REL_TOL, rel_err
from tunegen.kernels.reference import attention_reference


@pytest.mark.parametrize("page_size", [None, 16, 32])
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
    with pytest.raises(ValueError, match="would pass the capacity 32"):
        cache.advance(33)
    with pytest.raises(ValueError, match="layer: expected 0 to 0"):
        cache.attend(1, torch.randn(1, 1, 1, 16).half())
    with pytest.raises(ValueError, match="page_size: expected a multiple of 16"):
        tunegen.KVCache(1, 32, 1, 16, device="cpu", page_size=24)
    with pytest.raises(ValueError, match="capacity: expected a positive int"):
        tunegen.KVCache(1, 0, 1, 16, device="cpu")
