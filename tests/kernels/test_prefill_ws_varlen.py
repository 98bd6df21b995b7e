"""The Hopper schedule ("ws") over packed batches: the table of tiles its small kernel writes (on
the CPU, under Triton's interpreter), the Variants it takes, and on an sm_90 GPU every kind of
Variant against float64 at ragged lengths (empty and one-token sequences, queries shorter and
longer than the keys, an empty key sequence), GQA, head dims between powers of two, with the
attention of current models, into poisoned outputs; equal lengths give the dense call's bits."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
from conftest import NEEDS_INTERPRETER

import tunegen
from helpers import H100, HOPPER, REL_TOL, assert_lse, packed, rel_err, run_variant
from tunegen.calls.local import Local
from tunegen.calls.prefill import Varlen
from tunegen.kernels import render
from tunegen.kernels.families import backward, prefill
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_varlen_reference

WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True)
DYNAMIC = {"persistent": True, "dynamic": True, "q_stages": 2}
VARIANTS = [
    WS,
    WS.replace(**DYNAMIC, reverse_m=True),
    WS.replace(**DYNAMIC, order="head_inner", reverse_m=True),
    WS.replace(persistent=True, o_store="q_slot", order="head_inner"),
    WS.replace(o_store="registers", overlap=False, pingpong=True, **DYNAMIC),
    WS.replace(overlap=False, mask_branch=True, **DYNAMIC),
    WS.replace(consumers=3, overlap=False, pingpong=True, block_n=64, **DYNAMIC),
    WS.replace(consumers=1, block_m=128, block_n=64, num_stages=3, persistent=True),
    WS.replace(consumers=1, block_n=64, ctas_per_sm=2, persistent=True),
    WS.replace(block_n=64, o_store="q_slot"),
]
INSTALLED = dataclasses.replace(H100, triton_version=triton.__version__)
PACKED = Problem("prefill", "bfloat16", 128, True, 32, 8, 16, 4096, 4096, varlen=True)
# (query lengths, key lengths): self-attention with empty, one-token and ragged sequences around
# the tiles' sizes; a chunk of new queries over longer keys (and one over none); more queries than
# keys, where causal rows see no key.
LENGTHS = {
    "self": ([0, 1, 300, 517, 64, 129, 1000, 2], None),
    "chunks": ([100, 0, 257, 40, 17], [300, 50, 257, 12, 0]),
    "longer queries": ([333, 190], [190, 70]),
}


def _table(variant, lengths: list[int], keys: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
    """The table the Variant's kernel writes for these lengths (under the interpreter), and the
    entries and first entries expected: for order "m_inner" the sequences by keys (most first, in
    order among equals), each one's query blocks together; for "head_inner" query blocks from the
    last (with reverse_m) or the first, sequences in order within one."""
    features = prefill.FAMILY.features(PACKED, INSTALLED)
    module = render.load(render.render(prefill.FAMILY.template, "prefill", variant, features), interpret=True)
    tile_m, batch = module.TILE_M.value, len(lengths)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (lengths, keys))
    entries = module._entries(torch.empty(int(cu_q[-1]), 1, 1), batch, max(lengths))
    n_m_blocks = max(1, -(-max(lengths) // tile_m))
    work = torch.full((2 + batch + entries,), -7, dtype=torch.int32)
    blocks = [-(-n // tile_m) for n in lengths]
    first = []
    if variant.order == "m_inner":
        module._by_sequence[(triton.cdiv(batch, module.SEQUENCE_CHUNK),)](
            cu_q, cu_k, work, batch, tile_m, module.SEQUENCE_CHUNK, False
        )
        ranked = sorted(range(batch), key=lambda b: (-keys[b], b))
        expected = [b for b in ranked for _ in range(blocks[b])]
        first = [sum(blocks[c] for c in ranked[: ranked.index(b)]) for b in range(batch)]
    else:
        module._by_block[(n_m_blocks,)](cu_q, work, batch, tile_m, module.BLOCK_CHUNK, variant.reverse_m)
        order = reversed(range(n_m_blocks)) if variant.reverse_m else range(n_m_blocks)
        expected = [m * batch + b for m in order for b in range(batch) if blocks[b] > m]
    return expected, first, work


TABLES = {
    "m_inner": WS,
    "m_inner one consumer": WS.replace(consumers=1, block_m=128, ctas_per_sm=2, persistent=True),
    "head_inner reversed": WS.replace(order="head_inner", reverse_m=True),
    "head_inner": WS.replace(order="head_inner"),
}


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize(
    ("lengths", "keys"),
    [
        ([0, 1, 128, 129, 300, 0, 1000], None),
        ([5], None),
        ([0, 0], None),
        ([129, 64, 513, 7], [40, 900, 40, 0]),
    ],
    ids=str,
)
def test_the_table_lists_every_tile_in_its_order(name, lengths, keys):
    expected, first, work = _table(TABLES[name], lengths, keys or lengths)
    batch = len(lengths)
    assert work[0].item() == len(expected) and work[1].item() == 0, "its size, and a zeroed counter"
    assert work[2 + batch : 2 + batch + len(expected)].tolist() == expected
    if first:
        assert work[2 : 2 + batch].tolist() == first


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["m_inner", "head_inner reversed"])
def test_the_table_reads_the_lengths_in_chunks(name):
    """More sequences than one program of the table's kernel reads at once."""
    lengths = torch.randint(0, 300, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    expected, first, work = _table(TABLES[name], lengths, lengths)
    assert work[0].item() == len(expected) and work[1502 : 1502 + len(expected)].tolist() == expected
    if first:
        assert work[2:1502].tolist() == first


@pytest.mark.parametrize(
    "changes", [{"order": "grouped"}, {"persistent": True, "dynamic": True, "stream_k": True}], ids=str
)
def test_packed_batches_take_no_groups_of_heads_and_no_tail(changes):
    problem = dataclasses.replace(PACKED, causal=False)
    with pytest.raises(ValueError, match=r"variant.order, variant.stream_k: .* packed batches in order"):
        prefill.FAMILY.check_variant(WS.replace(**changes), problem, H100)
    for order, reverse_m in (("m_inner", False), ("head_inner", True)):
        prefill.FAMILY.check_variant(WS.replace(order=order, reverse_m=reverse_m), problem, H100)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_batches_default_to_the_hopper_schedule(head_dim, causal):
    problem = dataclasses.replace(PACKED, head_dim=head_dim, causal=causal)
    variant = prefill.FAMILY.default_variant(problem, H100)
    assert variant.schedule == "ws" and variant.order == "m_inner"
    prefill.FAMILY.check_variant(variant, problem, H100)
    assert prefill.FAMILY.constraint(variant, problem, H100) is None
    assert "ws" in prefill.FAMILY.search_space(problem, H100)["schedule"]


def test_the_backwards_hopper_schedule_still_takes_dense_batches_only():
    problem = dataclasses.replace(PACKED, family="backward")
    variant = backward.BackwardVariant(64, 128, num_warps=8, schedule="ws")
    with pytest.raises(ValueError, match="'ws' runs dense batches; varlen takes 'loops'"):
        backward.FAMILY.check_variant(variant, problem, H100)


def _check(variant, lengths_q, lengths_k, d, causal, hq=8, hkv=2, local=None, seed=0):
    lengths_k = lengths_k or lengths_q
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, hq, hkv, d, torch.bfloat16, "cuda", seed=seed + d)
    local = local or Local()
    ref, ref_lse = attention_varlen_reference(
        q, k, v, cu_q, cu_k, causal=causal, scale=0.3, **local.reference_args()
    )
    sizes = Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k))
    out, lse = run_variant(variant, q, k, v, causal=causal, scale=0.3, varlen=sizes, local=local)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16], (lengths_q, variant)
    assert_lse(lse, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("name", list(LENGTHS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_variant_kind_against_float64(name, d, causal):
    problem = dataclasses.replace(PACKED, head_dim=d, causal=causal)
    for variant in VARIANTS:
        if prefill.FAMILY.constraint(variant, problem, INSTALLED) is None:
            _check(variant, *LENGTHS[name], d, causal)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("d", [80, 96, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_other_head_dims_against_float64(d, causal):
    """Each head dim's default, and its output from registers."""
    problem = dataclasses.replace(PACKED, head_dim=d, causal=causal)
    default = prefill.FAMILY.default_variant(problem, INSTALLED)
    for variant in (default, default.replace(o_store="registers")):
        _check(variant, *LENGTHS["self"], d, causal)
        _check(variant, *LENGTHS["chunks"], d, causal, hq=4, hkv=4)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("causal", "window", "chunk", "softcap", "with_sinks"),
    [
        (True, (300, -1), 0, 0.0, False),
        (False, (150, 200), 0, 0.0, False),
        (True, (-1, -1), 192, 0.0, False),
        (True, (127, -1), 0, 0.0, True),
        (False, (130, 90), 256, 3.0, True),
    ],
    ids=["window causal", "window both sides", "chunk causal", "window and sinks", "every feature"],
)
def test_the_attention_of_current_models_against_float64(causal, window, chunk, softcap, with_sinks):
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)).cuda() if with_sinks else None
    local = Local(window[0], window[1], chunk, softcap, sinks)
    for variant in (WS.replace(mask_branch=True, **DYNAMIC), WS.replace(o_store="q_slot")):
        _check(variant, *LENGTHS["self"], 128, causal, local=local)
        _check(variant, *LENGTHS["chunks"], 128, causal, local=local)


@pytest.mark.gpu
@HOPPER
def test_many_sequences():
    """More sequences than the table's kernel reads at once, most of them shorter than a tile."""
    lengths = torch.randint(0, 90, (1300,), generator=torch.Generator().manual_seed(5)).tolist()
    _check(WS.replace(**DYNAMIC), lengths, None, 64, True, hq=2, hkv=1)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", [WS, WS.replace(**DYNAMIC), WS.replace(o_store="registers")], ids=str)
def test_equal_lengths_give_the_dense_calls_bits(variant):
    """Each tile sees the same rows and key blocks in the same order packed as dense."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 8, 700, 128, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(3, 2, 700, 128, generator=gen).cuda().bfloat16() for _ in range(2))
    dense, dense_lse = run_variant(variant, q, k, v, causal=True, scale=0.3)
    flat = [t.transpose(1, 2).flatten(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.arange(0, 4 * 700, 700, dtype=torch.int32, device="cuda")
    out, lse = run_variant(variant, *flat, causal=True, scale=0.3, varlen=Varlen(cu, cu, 700, 700))
    assert torch.equal(out.view(3, 700, 8, 128).transpose(1, 2), dense)
    assert torch.equal(lse.view(8, 3, 700).transpose(0, 1), dense_lse)


@pytest.mark.gpu
@HOPPER
def test_the_public_call_runs_the_hopper_schedule():
    lengths = [1000, 3000, 17, 0, 2048, 700, 1500, 4000, 1, 2500] * 2
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 32, 8, 128, torch.bfloat16, "cuda", seed=4)
    problem = dataclasses.replace(PACKED, batch=32)
    assert prefill.FAMILY.default_variant(problem, INSTALLED).schedule == "ws"
    out, lse = tunegen.attention_varlen(q, k, v, cu_q, cu_k, 4000, 4000, causal=True, return_lse=True)
    ref, ref_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, scale=128**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
    assert_lse(lse, ref_lse, torch.bfloat16)
