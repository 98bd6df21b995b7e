"""Every page size the README allows (any positive multiple of 16) is served: paged decode, with
appended tokens, matches float64 at 48, 80, 112, 144 and 208 (whose key tiles must be 16) as at
16 and 272, on every path; the default Variant and the search space pick key tiles that divide
the page; a Winner whose tile does not divide the page is never served; other page sizes are
refused, naming k_cache's page size (or KVCache's page_size)."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import DECODE_PATHS, REL_TOL, assert_lse, gathered, on_path, record_winner, reference, rel_err
from tunegen.calls.decode import DecodeCall
from tunegen.kernels import dispatch, snapshot
from tunegen.kernels.families import base, decode
from tunegen.kernels.gpu import Gpu, gpu_of, interpreter_gpu
from tunegen.kernels.problem import Problem

PAGES = [16, 48, 80, 112, 144, 208, 272]
H100 = Gpu("H100", (9, 0), 132, 232448, "3.6.0", "2.11", "cuda")


@pytest.fixture(params=DECODE_PATHS)
def path(request, monkeypatch):
    return on_path(request.param, monkeypatch)


@pytest.mark.parametrize("page", PAGES)
def test_every_multiple_of_16_is_served_with_appended_tokens(path, user_db, page):
    device, strict = path
    gen = torch.Generator().manual_seed(page)
    batch, hq, hkv, d, nq, new, dtype = 2, 4, 2, 32, 2, 2, torch.float16
    lengths = [page - 1, 2 * page + 5]  # the new tokens cross a page boundary in sequence 0
    pages = 3
    num_pages = batch * pages + 1
    table = (
        torch.randperm(num_pages, generator=gen)[: batch * pages].view(batch, pages).to(device, torch.int32)
    )
    k_cache, v_cache = (torch.randn(num_pages, page, hkv, d, generator=gen).to(device, dtype) for _ in "kv")
    q = torch.randn(batch, nq, hq, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, new, hkv, d, generator=gen).to(device, dtype) for _ in "kv")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = tunegen.decode_attention(
        q, k_cache, v_cache, seqlens, k=k, v=v, block_table=table, return_lse=True, strict=strict
    )
    for b, n in enumerate(lengths):
        assert torch.equal(gathered(k_cache, table, b, n + new)[:, n:], k[b].transpose(0, 1))
        assert torch.equal(gathered(v_cache, table, b, n + new)[:, n:], v[b].transpose(0, 1))
    ref, ref_lse = reference(q, k_cache, v_cache, table, [n + new for n in lengths], True, d**-0.5)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)
    if strict:
        call = DecodeCall.checked(q, k_cache, v_cache, seqlens, block_table=table, return_lse=True)
        problem = call.problem()
        assert page % dispatch.choice_for(problem, gpu_of(device)).kernel.variant.block_n == 0


@pytest.mark.parametrize("gpu", [interpreter_gpu(), H100], ids=lambda g: g.arch)
@pytest.mark.parametrize("page", range(16, 528, 16))
def test_default_and_searched_tiles_divide_the_page(gpu, page):
    problem = Problem("decode", "bfloat16", 128, True, 32, 8, 4, 1, 4096, paged=True, page_size=page)
    default = decode.FAMILY.default_variant(problem, gpu)
    decode.FAMILY.check_variant(default, problem, gpu)
    largest = page & -page  # the largest power of two dividing the page
    assert default.block_n == min(largest, 32 if gpu.arch == "interpreter" else 64)
    tiles = decode.FAMILY.search_space(problem, gpu)["block_n"]
    assert tiles and all(page % t == 0 for t in tiles)


def decode_problem(page: int, batch: int = 4) -> dict:
    return Problem("decode", "float16", 32, True, 4, 2, batch, 1, 64, paged=True, page_size=page).as_dict()


def test_a_winner_whose_tile_does_not_divide_the_page_is_never_served(user_db):
    """Dispatch keys Winners by page size (a feature, not a bucketed size), and refuses a tile
    that does not divide the page even in a Winner stored for exactly this Problem."""
    gpu = interpreter_gpu()
    tuned = {"block_n": 32, "num_splits": 2, "num_warps": 4, "num_stages": 1, "pack_gqa": True}
    record_winner(user_db, decode_problem(64), tuned, family="decode")
    record_winner(user_db, decode_problem(48), tuned, family="decode")  # a junk row, say imported
    taken = snapshot.for_gpu(gpu)
    at_64 = dispatch.select(Problem(**decode_problem(64)), gpu, taken)
    assert at_64.source == "winner" and at_64.variant.block_n == 32, "the Winners are there to find"
    at_48 = dispatch.select(Problem(**decode_problem(48)), gpu, taken)
    assert at_48.source == "default" and at_48.variant.block_n == 16
    dispatch.forget()
    record_winner(user_db, decode_problem(48, batch=2), {**tuned, "block_n": 16}, family="decode")
    nearest = dispatch.select(Problem(**decode_problem(48)), gpu, snapshot.for_gpu(gpu))
    assert nearest.source == "nearest" and nearest.variant.block_n == 16


def test_the_tuners_case_runs_a_page_that_does_not_divide_the_length():
    problem = Problem("decode", "float16", 32, True, 4, 2, 2, 1, 64, paged=True, page_size=48)
    gpu = interpreter_gpu()
    kernel = base.build(decode.FAMILY, decode.FAMILY.default_variant(problem, gpu), problem, gpu)
    case = decode.FAMILY.case(problem, kernel, torch.device("cpu"), seed=3)
    case.launch()
    assert case.error() < REL_TOL[torch.float16]


@pytest.mark.parametrize("page", [8, 24, 40, 100])
def test_other_page_sizes_are_refused_by_name(path, page):
    device, strict = path
    q = torch.randn(1, 1, 2, 16, device=device, dtype=torch.float16)
    cache = torch.zeros(4, page, 1, 16, device=device, dtype=torch.float16)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(
        ValueError, match=rf"k_cache: the page size \(dimension 1\) .* multiple of 16, got {page}"
    ):
        tunegen.decode_attention(q, cache, cache, lengths, block_table=table, strict=strict)
    with pytest.raises(ValueError, match=rf"page_size: expected a positive multiple of 16, got {page}"):
        tunegen.KVCache(1, 64, 1, 16, dtype=torch.float16, device=device, page_size=page)
    problem = Problem("decode", "float16", 16, True, 2, 1, 1, 1, 64, paged=True, page_size=page)
    with pytest.raises(
        ValueError, match=rf"problem.page_size: expected a positive multiple of 16, got {page}"
    ):
        decode.FAMILY.check_variant(decode.DecodeVariant(block_n=16), problem, interpreter_gpu())


@pytest.mark.parametrize("page_size", [0, -16, 16.0, True, "16"])
def test_kvcache_refuses_page_sizes_that_are_not_ints(page_size):
    with pytest.raises(ValueError, match=r"page_size: expected a positive multiple of 16"):
        tunegen.KVCache(1, 64, 1, 16, dtype=torch.float16, device="cpu", page_size=page_size)
