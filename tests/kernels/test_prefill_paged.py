"""Chunked prefill over a paged cache, kernel by kernel: packed queries over K/V in shuffled pages
behind a block table (spare pages hold NaN, so a wrong page shows), each sequence's keys counted
by seqused_k, against float64 on the same keys laid out contiguously. FlashAttention-2's loop on
the interpreter (CPU) and the GPU; the Hopper schedule on an sm_90 GPU. Ragged chunks: empty and
one-token sequences, chunks shorter than their keys, a sequence with no key, GQA, head dims that
tiles pad; the rules a paged Problem sets on Variants, and the tuning case."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from conftest import NEEDS_INTERPRETER

from helpers import H100, HOPPER, REL_TOL, assert_lse, paged, rel_err
from tunegen.calls.local import Local
from tunegen.kernels import render
from tunegen.kernels.families import base, prefill, prefill_paged
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_varlen_reference

INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
PAGED = Problem(
    "prefill", "bfloat16", 128, True, 32, 8, 4, 2048, 16384, varlen=True, paged=True, page_size=64
)
WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=64, consumers=2, overlap=True)
DYNAMIC = {"persistent": True, "dynamic": True, "q_stages": 2}
# (query lengths, key lengths): a new chunk of each prompt over its cached keys, which include it.
CHUNKS = [([0, 1, 45, 70, 130], [23, 1, 160, 70, 300]), ([40, 17], [12, 0])]


def _check(variant, lengths_q, lengths_k, d, page, causal, dtype, device, hq=4, hkv=2, local=None):
    seed = sum(lengths_q) + d + page
    stale = variant.schedule == "ws"  # FA2's loop masks its loads: NaN past a sequence's keys there
    x = paged(lengths_q, lengths_k, hq, hkv, d, page, dtype, torch.device(device), seed=seed, stale=stale)
    local = local or Local()
    features = local.reference_args()
    q, cu = x.q, (x.cu_seqlens_q, x.cu_seqlens_k)
    ref, ref_lse = attention_varlen_reference(q, x.k, x.v, *cu, causal=causal, scale=0.3, **features)
    problem = dataclasses.replace(
        PAGED,
        dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype],
        head_dim=d,
        causal=causal,
        num_heads_q=hq,
        num_heads_kv=hkv,
        page_size=page,
        return_lse=True,
        **local.key(),
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device=device)
    args = PrefillArgs(
        q, x.k_cache, x.v_cache, out, lse, 0.3, cu_seqlens_q=x.cu_seqlens_q, max_seqlen_q=x.max_seqlen_q
    )
    args.softcap, args.sinks = local.softcap, local.sinks
    args.seqused_k, args.block_table = x.seqused_k, x.block_table
    base.build(prefill.FAMILY, variant, problem, gpu_of(q.device)).launch(args)
    assert rel_err(out, ref) < REL_TOL[dtype], (lengths_q, variant)
    assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa2_loop_gathers_pages_against_float64(device, page, d, causal):
    tiles = (16, 16) if device.type == "cpu" else (64, 32)
    variant = prefill.PrefillVariant(block_m=tiles[0], block_n=tiles[1], num_warps=4, num_stages=1)
    for lengths_q, lengths_k in CHUNKS:
        _check(variant, lengths_q, lengths_k, d, page, causal, torch.float16, device)


def test_paged_problems_take_packed_queries_pointer_loads_and_blocks_in_one_page():
    fa2 = prefill.PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match=r"problem.paged: a paged cache serves packed \(varlen\) queries"):
        prefill.FAMILY.check_variant(fa2, dataclasses.replace(PAGED, varlen=False), H100)
    with pytest.raises(ValueError, match=r"variant.load: a paged cache's rows are gathered by pointer"):
        prefill.FAMILY.check_variant(fa2.replace(load="desc"), PAGED, H100)
    with pytest.raises(ValueError, match=r"variant.block_n: .* 128 keys and pages of 48 rows are neither"):
        prefill.FAMILY.check_variant(WS.replace(block_n=128), dataclasses.replace(PAGED, page_size=48), H100)
    for page in (16, 64, 256):  # blocks of whole pages, or in one page
        prefill.FAMILY.check_variant(
            WS.replace(block_n=128), dataclasses.replace(PAGED, page_size=page), H100
        )
    assert prefill.FAMILY.search_space(PAGED, H100)["load"] == ["ptr"]


@pytest.mark.parametrize(
    ("page", "block_n"), [(64, 128), (256, 128), (32, 128), (16, 128), (48, None), (96, 32)]
)
def test_the_default_takes_blocks_that_lie_in_a_page_or_hold_whole_pages(page, block_n):
    problem = dataclasses.replace(PAGED, page_size=page)
    variant = prefill.FAMILY.default_variant(problem, H100)
    prefill.FAMILY.check_variant(variant, problem, H100)
    assert variant.schedule == ("ws" if block_n else "fa2") and variant.load == "ptr"
    assert block_n is None or variant.block_n == block_n


@NEEDS_INTERPRETER
def test_the_hopper_schedule_reads_pages_a_whole_number_of_rows_apart():
    """Back to back (vLLM's caches), or K's and V's pages interleaved (FlashInfer's): the rows from
    one page to the next; heads not back to back within a row are refused by name."""
    variant = WS.replace(block_n=128)
    features = prefill.FAMILY.features(dataclasses.replace(PAGED, page_size=16), INSTALLED)
    module = render.load(render.render(prefill.FAMILY.template, "prefill", variant, features), interpret=True)
    cache = torch.zeros(10, 2, 16, 8, 128, dtype=torch.bfloat16)
    assert module._pages(cache[:, 0])[1] == 32 and module._pages(cache[0])[1] == 16
    with pytest.raises(ValueError, match=r"k, v: the Hopper schedule reads a paged cache whose rows hold"):
        module._pages(cache[0].transpose(1, 2).contiguous().transpose(1, 2))


def test_the_paged_cache_of_a_case_holds_each_sequences_keys_in_its_pages():
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, 100, 8, generator=gen) for _ in range(2))
    k_cache, v_cache, table, seqused = prefill_paged.paged(k, v, 32, torch.Generator().manual_seed(1))
    assert k_cache.shape == (3 * 4 + 2, 32, 2, 8) and table.shape == (3, 4) and seqused.tolist() == [100] * 3
    assert sorted(table.flatten().tolist()) != list(range(12)) or table.flatten().tolist() != list(range(12))
    for b in range(3):
        rows = k_cache[table[b].long()].flatten(0, 1)[:100].transpose(0, 1)
        assert torch.equal(rows, k[b]) and not torch.isnan(rows).any()
    spare = sorted(set(range(14)) - set(table.flatten().tolist()))
    assert torch.isnan(k_cache[spare]).all() and torch.isnan(v_cache[spare]).all()


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    "variant",
    [
        WS,
        WS.replace(**DYNAMIC, reverse_m=True),
        WS.replace(num_stages=3, o_store="q_slot", persistent=True),
        WS.replace(block_n=32, num_stages=4, overlap=False, pingpong=True, **DYNAMIC, order="head_inner"),
        WS.replace(o_store="registers", mask_branch=True, **DYNAMIC),
        WS.replace(block_n=128, **DYNAMIC, reverse_m=True),
    ],
    ids=lambda v: v.to_json(),
)
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_schedule_reads_pages_against_float64(variant, page, causal):
    for lengths_q, lengths_k in [*CHUNKS, ([300, 1, 517], [900, 1, 1500])]:
        _check(variant, lengths_q, lengths_k, 128, page, causal, torch.bfloat16, "cuda", hq=8, hkv=2)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [64, 96, 192, 256])
def test_hopper_schedule_defaults_at_other_head_dims(d):
    for causal in (False, True):
        problem = dataclasses.replace(PAGED, head_dim=d, causal=causal)
        variant = prefill.FAMILY.default_variant(problem, INSTALLED)
        assert variant.schedule == "ws"
        for lengths_q, lengths_k in CHUNKS:
            _check(variant, lengths_q, lengths_k, d, 64, causal, torch.bfloat16, "cuda", hq=8, hkv=2)


# (causal, window_size, attention_chunk, softcap, sinks): current models' attention over pages.
FEATURES = {
    "window causal": (True, (100, -1), 0, 0.0, False),
    "chunk causal": (True, (-1, -1), 96, 0.0, False),
    "every feature": (False, (70, 30), 128, 3.0, True),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_fa2_loop_over_pages_with_the_attention_of_current_models(device, name):
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)).to(device) if with_sinks else None
    local = Local(window[0], window[1], chunk, softcap, sinks)
    tiles = (16, 16) if device.type == "cpu" else (64, 32)
    variant = prefill.PrefillVariant(block_m=tiles[0], block_n=tiles[1], num_warps=4, num_stages=1)
    for lengths_q, lengths_k in CHUNKS:
        _check(variant, lengths_q, lengths_k, 64, 32, causal, torch.float16, device, local=local)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("name", list(FEATURES))
def test_hopper_schedule_over_pages_with_the_attention_of_current_models(name):
    causal, window, chunk, softcap, with_sinks = FEATURES[name]
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)).cuda() if with_sinks else None
    local = Local(window[0], window[1], chunk, softcap, sinks)
    for variant in (WS.replace(mask_branch=True, **DYNAMIC), WS.replace(o_store="q_slot")):
        for lengths_q, lengths_k in [*CHUNKS, ([300, 1, 517], [900, 1, 1500])]:
            _check(
                variant,
                lengths_q,
                lengths_k,
                128,
                64,
                causal,
                torch.bfloat16,
                "cuda",
                hq=8,
                hkv=2,
                local=local,
            )


def test_the_tuning_case_runs_paged(device):
    """The tuner's case for a paged Problem: chunks over shuffled pages, checked against float64."""
    sizes = {"batch": 2, "seqlen_q": 48, "seqlen_k": 160, "page_size": 32, "return_lse": True}
    problem = dataclasses.replace(PAGED, dtype="float16", head_dim=64, num_heads_q=4, num_heads_kv=2, **sizes)
    gpu = gpu_of(device)
    variant = prefill.FAMILY.default_variant(problem, gpu)
    case = prefill.FAMILY.case(problem, base.build(prefill.FAMILY, variant, problem, gpu), device, seed=3)
    case.launch()
    assert case.error() < REL_TOL[torch.float16]
