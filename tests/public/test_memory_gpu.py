"""Memory comes back: hundreds of distinct shapes through every public path, each call's tensors
dropped, leave the GPU's allocated memory at its baseline (within 1 MiB: the small workspace
launches on one stream share, and the read-only descale of one), with the bound calls still
cached. A serving process that meets thousands of shapes must not grow with them.

The CPU side (a bound call keeps no tensor of the call that bound it; the caches' bound) is
tests/kernels/test_bound_memory.py."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from conftest import HAS_CUDA, INTERPRETING

import tunegen
from helpers import REL_TOL, make_cache, reference, rel_err
from tunegen.kernels import fp8, launcher

SHAPES = 500
SLACK = 1 << 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a GPU, compiled kernels"),
    pytest.mark.usefixtures("user_db"),
]


def _hopper() -> bool:
    return HAS_CUDA and not INTERPRETING and torch.cuda.get_device_capability() >= (9, 0)


def _randn(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _prefill(i: int, rng: random.Random) -> None:
    n = 64 + i
    q, k, v = _randn(1, 4, n, 64), _randn(1, 2, n, 64), _randn(1, 2, n, 64)
    out = tunegen.attention(q, k, v, causal=i % 2 == 0, return_lse=i % 3 == 0)
    assert not torch.isnan(out[0] if isinstance(out, tuple) else out).any()


def _prefill_ws(i: int, rng: random.Random) -> None:
    n = 1025 + i  # two sequences of 16 heads: over one wave of 128-row tiles, the Hopper schedule
    q, k, v = _randn(2, 16, n, 128), _randn(2, 4, n, 128), _randn(2, 4, n, 128)
    tunegen.attention(q, k, v, causal=i % 2 == 0, return_lse=i % 3 == 0)


def _varlen(i: int, rng: random.Random) -> None:
    lengths = [rng.randint(0, 200) for _ in range(1 + i % 4)]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v = _randn(total, 4, 64), _randn(total, 2, 64), _randn(total, 2, 64)
    tunegen.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=i % 2 == 0)


def _decode(i: int, rng: random.Random, *, paged: bool, cache_dtype=torch.bfloat16) -> None:
    """A cache shape of its own per call (the page pool, or the slots, grow by one each time)
    over a few Problems, so that hundreds of shapes take a few compiles."""
    batch, new, page = 1 + i % 2, 1 + i % 2, (16, 48)[i // 2 % 2]
    pages_each = 4 + i // 4 % 4
    capacity = pages_each * page
    if paged:
        k_cache = _randn(batch * pages_each + i, page, 2, 128).to(cache_dtype)
        table = torch.randperm(batch * pages_each + i, device="cuda")[: batch * pages_each]
        table = table.int().view(batch, pages_each)
    else:
        capacity = 300 + i
        k_cache, table = _randn(batch, capacity, 2, 128).to(cache_dtype), None
    v_cache = torch.empty_like(k_cache).copy_(k_cache)
    lengths = torch.randint(0, capacity - new + 1, (batch,), device="cuda", dtype=torch.int32)
    q, k, v = _randn(batch, new, 8, 128), _randn(batch, new, 2, 128), _randn(batch, new, 2, 128)
    descales = {}
    if cache_dtype == fp8.E4M3:
        descales = {n: torch.rand(batch, 2, device="cuda") + 0.5 for n in ("k_descale", "v_descale")}
    out = tunegen.decode_attention(q, k_cache, v_cache, lengths, k=k, v=v, block_table=table, **descales)
    assert not torch.isnan(out).any()


def _backward(i: int, rng: random.Random) -> None:
    n = 64 + i
    q, k, v = (_randn(1, h, n, 64).requires_grad_() for h in (4, 2, 2))
    tunegen.attention(q, k, v, causal=i % 2 == 1).sum().backward()
    assert q.grad is not None and k.grad is not None


def _fp8(i: int, rng: random.Random) -> None:
    n = 200 + 7 * i  # both schedules: short ones on FA2's loop, longer ones on the Hopper schedule
    q, k, v = _randn(2, 16, n, 128), _randn(2, 8, n, 128), _randn(2, 8, n, 128)
    if i % 2:
        tunegen.attention(q, k, v, causal=i % 4 == 1, precision="fp8")
    else:
        x = tunegen.quantize_fp8(q, k, v)
        tunegen.attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)


def _kvcache(i: int, rng: random.Random) -> None:
    batch, page = 1 + i % 3, (None, 16, 64)[i % 3]
    dtype = fp8.E4M3 if i % 5 == 0 else torch.bfloat16
    cache = tunegen.KVCache(
        batch, 64 + 16 * i, 2, 64, num_layers=2, dtype=dtype, device="cuda", page_size=page
    )
    for _ in range(2):
        for layer in range(2):
            cache.attend(layer, _randn(batch, 1, 4, 64), _randn(batch, 1, 2, 64), _randn(batch, 1, 2, 64))
        cache.advance(1)


PATHS = {
    "prefill": _prefill,
    "prefill-ws": _prefill_ws,
    "varlen": _varlen,
    "decode": lambda i, rng: _decode(i, rng, paged=False),
    "decode-paged": lambda i, rng: _decode(i, rng, paged=True),
    "decode-fp8-cache": lambda i, rng: _decode(i, rng, paged=i % 2 == 0, cache_dtype=fp8.E4M3),
    "backward": _backward,
    "fp8": _fp8,
    "kvcache": _kvcache,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_memory_returns_to_its_baseline_after_hundreds_of_shapes(path):
    if path in ("prefill-ws", "fp8") and not _hopper():
        pytest.skip("the Hopper schedule and e4m3 products need sm_90")
    run, rng = PATHS[path], random.Random(0)
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    for i in range(SHAPES):
        run(i, rng)
    if path == "prefill-ws":
        q = _randn(2, 16, 1500, 128)
        assert tunegen.explain(q, q[:, :4], q[:, :4])["variant"]["schedule"] == "ws"
        del q
    torch.cuda.synchronize()
    gc.collect()
    held = torch.cuda.memory_allocated() - baseline
    assert held <= SLACK, f"{path}: {held / 2**20:.1f} MiB still allocated after {SHAPES} shapes"


def test_decode_kernels_sharing_a_streams_workspace_stay_exact():
    """Decode Problems of different splits and sizes take turns on one stream, on the workspace kept
    for it (grown as they come) and, past its bound, on one of their own per call: each call still
    matches float64, and only a workspace within the bound is kept."""
    gen = torch.Generator().manual_seed(27)
    cases = []  # (batch, query tokens, query heads, cache lengths): small, batch-1 wide, past the bound
    for batch, nq, hq, top in ((2, 1, 8, 300), (1, 1, 32, 4000), (4, 16, 64, 900)):
        lengths = torch.randint(1, top, (batch,), generator=gen).tolist()
        page = 16 if batch == 1 else 0
        k_cache, v_cache, table = make_cache(batch, 8, 128, lengths, top, page, torch.bfloat16, "cuda", gen)
        q = torch.randn(batch, nq, hq, 128, generator=gen).to("cuda", torch.bfloat16)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        ref, _ = reference(q, k_cache, v_cache, table, lengths, True, 128**-0.5)
        cases.append(((q, k_cache, v_cache, seqlens), {"block_table": table}, ref))
    for _ in range(3):
        for args, kwargs, ref in cases:
            assert rel_err(tunegen.decode_attention(*args, **kwargs), ref) < REL_TOL[torch.bfloat16]
    kept = [t for parts, *_ in launcher._WORKSPACES.values() for t in parts[:2] if t is not None]
    assert kept and 4 * sum(t.numel() for t in kept) <= launcher.WORKSPACE_KEPT
