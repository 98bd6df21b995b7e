"""Decode never writes outside what the caller owns, on every path: the kernel under the
interpreter and on the GPU, and the PyTorch path. A sequence whose length is negative or leaves
no room for its new tokens, or whose block table names a page outside the cache (-1, -3, the
page count), reads and writes nothing of another's and gets NaN (output and log-sum-exp); the
other sequences are appended and attended as usual; check=True raises a ValueError naming the
argument and the sequence, and writes nothing. The whole cache is compared before and after."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import NEEDS_GPU

import tunegen
from helpers import DECODE_PATHS, LSE_TOL, REL_TOL, gathered, on_path, rel_err
from tunegen.kernels import fp8
from tunegen.kernels.reference import attention_reference

CAPACITY, PAGE, HQ, HKV, D, NQ = 64, 16, 4, 2, 32, 2
GOOD = 20
# Sequences 1 to 5 are broken: 1 a negative length, 2 no room for its new tokens, 3 to 5 (paged
# caches) a page outside the cache in their block table row: (page index, page id; None: the
# page count). 0 and 6 stay good.
PAGE_FAULTS = {3: (1, -1), 4: (0, -3), 5: (1, None)}
BATCH = 7
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": fp8.E4M3}


@pytest.fixture(params=DECODE_PATHS)
def path(request, monkeypatch):
    return on_path(request.param, monkeypatch)


def setup(device, dtype, paged, new, broken=frozenset(range(1, 6)), seed=0):
    """Random inputs for BATCH sequences, with the sequences in `broken` broken as listed above."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = DTYPES[dtype]
    qdtype = torch.bfloat16 if cache_dtype == fp8.E4M3 else cache_dtype
    lengths = [GOOD] * BATCH
    lengths[6] = 33
    if 1 in broken:
        lengths[1] = -3
    if 2 in broken:
        lengths[2] = CAPACITY + 1 - new
    table = None
    shape = (BATCH, CAPACITY, HKV, D)
    if paged:
        pages = CAPACITY // PAGE
        num_pages = BATCH * pages + 2  # two pages no sequence owns
        table = torch.randperm(num_pages, generator=gen)[: BATCH * pages].view(BATCH, pages).to(torch.int32)
        for b, (index, page) in PAGE_FAULTS.items():
            if b in broken:
                table[b, index] = num_pages if page is None else page
        shape = (num_pages, PAGE, HKV, D)
        table = table.to(device)
    k_cache, v_cache = (torch.randn(shape, generator=gen) for _ in range(2))
    descales = {}
    if cache_dtype == fp8.E4M3:
        k_cache, v_cache = (c.mul(20).to(cache_dtype) for c in (k_cache, v_cache))
        descales = {
            name: (torch.rand(BATCH, HKV, generator=gen) * 0.02 + 0.005).to(device)
            for name in ("k_descale", "v_descale")
        }
    q = torch.randn(BATCH, NQ, HQ, D, generator=gen).to(device, qdtype)
    k, v = (torch.randn(BATCH, new, HKV, D, generator=gen).to(device, qdtype) if new else None for _ in "kv")
    bad = {b for b in broken if paged or b not in PAGE_FAULTS}
    return types.SimpleNamespace(
        q=q,
        k_cache=k_cache.to(device, cache_dtype),
        v_cache=v_cache.to(device, cache_dtype),
        seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        lengths=lengths,
        table=table,
        k=k,
        v=v,
        new=new,
        descales=descales,
        bad=sorted(bad),
        good=[b for b in range(BATCH) if b not in bad],
    )


def call(x, strict, **kw):
    return tunegen.decode_attention(
        x.q,
        x.k_cache,
        x.v_cache,
        x.seqlens,
        k=x.k,
        v=x.v,
        block_table=x.table,
        strict=strict,
        **x.descales,
        **kw,
    )


def bits(t):
    return t.view(torch.uint8)


def own_new_slots(x) -> torch.Tensor:
    """(cache rows, slots) the call may write: each sequence's new tokens whose length leaves room,
    on a page of its own inside the cache (a kernel writes a broken-page sequence's new tokens
    that land on its good pages; the PyTorch path writes none of them)."""
    mask = torch.zeros(x.k_cache.shape[:2], dtype=torch.bool)
    rows = None if x.table is None else x.table.tolist()
    for b, n in enumerate(x.lengths):
        if not 0 <= n <= CAPACITY - x.new:
            continue
        for pos in range(n, n + x.new):
            if rows is None:
                mask[b, pos] = True
            elif 0 <= rows[b][pos // PAGE] < x.k_cache.shape[0]:
                mask[rows[b][pos // PAGE], pos % PAGE] = True
    return mask.to(x.k_cache.device)


def expected(x, b):
    """Float64 attention of sequence b over its cache as the call left it."""
    n = x.lengths[b] + x.new
    keys, values = (gathered(c, x.table, b, n).double() for c in (x.k_cache, x.v_cache))
    if x.descales:
        keys = keys * x.descales["k_descale"][b].double()[:, None, None]
        values = values * x.descales["v_descale"][b].double()[:, None, None]
    out, lse = attention_reference(
        x.q[b].transpose(0, 1)[None], keys[None], values[None], causal=True, scale=D**-0.5
    )
    return out[0].transpose(0, 1), lse[0]


def appended(x, name, b):
    """What sequence b's new tokens must read as in the cache (quantized for an fp8 cache)."""
    tokens = getattr(x, name)[b : b + 1]
    if x.descales:
        tokens = fp8.quantize_kv(tokens, x.descales[f"{name}_descale"][b : b + 1])
    return tokens[0].transpose(0, 1)


@pytest.mark.parametrize("new", [0, 2], ids=["read", "append"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_broken_sequences_get_nan_and_nothing_is_written_outside_the_callers_slots(path, dtype, paged, new):
    device, strict = path
    x = setup(device, dtype, paged, new, seed=len(dtype) + paged + new)
    before = (x.k_cache.clone(), x.v_cache.clone())
    out, lse = call(x, strict, return_lse=True)
    assert torch.isnan(out[x.bad]).all() and torch.isnan(lse[x.bad]).all(), "a broken sequence gets NaN"
    mine = own_new_slots(x)
    for cache, old in zip((x.k_cache, x.v_cache), before, strict=True):
        assert torch.equal(bits(cache[~mine]), bits(old[~mine])), "nothing written outside the caller's slots"
    for b in x.good:
        n = x.lengths[b]
        for name, cache in (("k", x.k_cache), ("v", x.v_cache)):
            if new:
                got = gathered(cache, x.table, b, n + new)[:, n:]
                assert torch.equal(bits(got), bits(appended(x, name, b))), (b, name)
        ref, ref_lse = expected(x, b)
        assert rel_err(out[b], ref) < REL_TOL[x.q.dtype], b
        assert float((lse[b].double() - ref_lse).abs().max()) < LSE_TOL[x.q.dtype], b


CHECKED = [
    (1, False, r"cache_seqlens: sequence 1 has length -3, expected 0 or more"),
    (2, False, r"cache_seqlens: sequence 2 needs 65 slots \(63 cached \+ 2 new\), the cache holds 64"),
    (2, True, r"cache_seqlens: sequence 2 needs 65 slots \(63 cached \+ 2 new\), the cache holds 64"),
    (3, True, r"block_table: sequence 3 names pages \[-1\], outside the cache's pages 0\.\.29"),
    (4, True, r"block_table: sequence 4 names pages \[-3\], outside the cache's pages 0\.\.29"),
    (5, True, r"block_table: sequence 5 names pages \[30\], outside the cache's pages 0\.\.29"),
]


@pytest.mark.parametrize("dtype", ["float16", "fp8"])
@pytest.mark.parametrize(("broken", "paged", "pattern"), CHECKED)
def test_check_names_the_argument_and_the_sequence_and_writes_nothing(path, dtype, broken, paged, pattern):
    device, strict = path
    x = setup(device, dtype, paged, 2, broken={broken})
    before = (x.k_cache.clone(), x.v_cache.clone())
    with pytest.raises(ValueError, match=pattern):
        call(x, strict, check=True)
    assert torch.equal(bits(x.k_cache), bits(before[0])) and torch.equal(bits(x.v_cache), bits(before[1]))
    out = call(x, strict, check=False)
    assert torch.isnan(out[broken]).all() and not torch.isnan(out[x.good]).any()


@pytest.mark.parametrize("length", [2**31 - 1, -(2**31)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_extreme_lengths_on_the_pytorch_path(monkeypatch, length, paged):
    device, strict = on_path("torch", monkeypatch)
    x = setup(device, "float16", paged, 2, broken=frozenset())
    x.seqlens[3] = length
    before = x.k_cache.clone()
    out = call(x, strict)
    assert torch.isnan(out[3]).all() and not torch.isnan(out[[0, 1, 2, 4, 5, 6]]).any()
    x.lengths[3] = length
    mine = own_new_slots(x)
    assert torch.equal(x.k_cache[~mine], before[~mine])
    with pytest.raises(ValueError, match=rf"cache_seqlens: sequence 3 (has length {length}|needs)"):
        call(x, strict, check=True)


# Run in a child process: before the template masks them, such lengths write far outside the
# cache (a crash, or a corrupted heap).
EXTREME_LENGTHS = """
import sys, torch, tunegen
device = sys.argv[1]
for table in (None, torch.arange(8, dtype=torch.int32).view(2, 4)):
    for length in (2**31 - 1, -(2**31)):
        shape = (2, 64, 1, 16) if table is None else (8, 16, 1, 16)
        kc, vc = (torch.zeros(shape, device=device, dtype=torch.float16) for _ in "kv")
        q = torch.ones(2, 1, 1, 16, device=device, dtype=torch.float16)
        new = torch.ones(2, 1, 1, 16, device=device, dtype=torch.float16)
        lengths = torch.tensor([length, 5], dtype=torch.int32, device=device)
        t = None if table is None else table.to(device)
        out = tunegen.decode_attention(q, kc, vc, lengths, k=new, v=new, block_table=t, strict=True)
        assert torch.isnan(out[0]).all(), (length, table is not None, out[0])
        assert int((kc != 0).any(-1).sum()) == 1, "only sequence 1's new token is written"
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_GPU])])
def test_extreme_lengths_on_the_kernel_paths(device):
    """INT32_MAX and INT32_MIN lengths with appended tokens give NaN and write nothing."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    done = subprocess.run(
        [sys.executable, "-c", EXTREME_LENGTHS, device], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
