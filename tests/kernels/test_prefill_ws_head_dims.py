"""The Hopper schedule ("ws") of the prefill family at head dims 256 and 192 (in parts) and at head
dims between powers of two, on an sm_90 GPU: each form it runs there against float64 at ragged lengths, GQA,
batch 2, into poisoned outputs (the CPU rules, constraint and defaults are in test_prefill_ws.py
and test_prefill_ws_defaults.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_prefill_ws import INSTALLED, PROBLEM, WS, _check, _inputs

from helpers import HOPPER
from tunegen.kernels.families import prefill

# Head dim 256's forms: two consumers of 64 rows over 64-key blocks, the output through the query
# slot or from registers (apart, in turns with overlap, heaviest first as the causal defaults,
# persistent on the dynamic scheduler with the mask in a branch); 32-key blocks through the
# output's own slot; one consumer with two query slots and the output's own slot, or over a ring
# of three.
D256 = [
    dataclasses.replace(WS, block_n=64, pingpong=False, overlap=False, o_store="registers"),
    dataclasses.replace(WS, block_n=64, o_store="registers"),
    dataclasses.replace(WS, block_n=64, pingpong=False, o_store="q_slot"),
    dataclasses.replace(
        WS, block_n=64, pingpong=False, overlap=False, o_store="q_slot", order="grouped", reverse_m=True
    ),
    dataclasses.replace(
        WS,
        block_n=64,
        pingpong=False,
        o_store="q_slot",
        persistent=True,
        dynamic=True,
        order="grouped",
        reverse_m=True,
        mask_branch=True,
    ),
    dataclasses.replace(WS, block_n=32, num_stages=3, persistent=True, dynamic=True),
    dataclasses.replace(
        WS,
        consumers=1,
        pingpong=False,
        block_n=64,
        persistent=True,
        dynamic=True,
        q_stages=2,
        order="grouped",
    ),
    dataclasses.replace(
        WS, consumers=1, pingpong=False, block_n=64, num_stages=3, o_store="registers", persistent=True
    ),
]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", D256, ids=lambda v: v.to_json())
@pytest.mark.parametrize(("nq", "nk"), [(333, 333), (200, 517), (517, 190)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_against_float64(variant, nq, nk, causal):
    """Ragged lengths, GQA, batch 2 at head dim 256, where the output's rows past seqlen_q are
    masked stores rather than a clipped TMA box; causal rows that see no key give zeros."""
    problem = dataclasses.replace(PROBLEM, head_dim=256)
    assert prefill.FAMILY.constraint(variant, problem, INSTALLED) is None
    q, k, v = _inputs(2, 4, 2, nq, nk, 256, torch.bfloat16, seed=nq * 5 + nk)
    out = _check(variant, q, k, v, causal)
    if causal and nq > nk:
        assert torch.all(out[:, :, : nq - nk] == 0)


# Head dim 192's forms, in three parts of 64 columns: two consumers over 64-key blocks, the output
# through the query slot, its own slot or registers; a ring of three; heaviest first; the dynamic
# scheduler with two query slots and the mask in a branch; in turns without overlap; the query rows
# from registers; P·V's first two parts paired.
TWO = dataclasses.replace(WS, block_n=64, pingpong=False)
D192 = [
    TWO.replace(o_store="q_slot"),
    TWO,
    TWO.replace(o_store="q_slot", num_stages=3),
    TWO.replace(o_store="registers", order="grouped", reverse_m=True),
    TWO.replace(o_store="q_slot", persistent=True, dynamic=True, q_stages=2, mask_branch=True),
    TWO.replace(pingpong=True, overlap=False, o_store="q_slot", persistent=True),
    # The query rows from registers, their slot freed once read or kept for the output.
    TWO.replace(overlap=False, q_regs=True, persistent=True, dynamic=True),
    TWO.replace(q_regs=True, o_store="q_slot", order="grouped", reverse_m=True),
    # P·V's first two parts as one product: the output through the query slot, its own slot, or
    # from registers.
    TWO.replace(q_regs=True, pv_pair=True, o_store="q_slot", num_stages=3),
    TWO.replace(pv_pair=True, overlap=False, persistent=True, dynamic=True),
    TWO.replace(q_regs=True, pv_pair=True, o_store="registers", order="grouped", reverse_m=True),
]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", D192, ids=lambda v: v.to_json())
@pytest.mark.parametrize("d", [144, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_192_in_parts_against_float64(variant, d, causal):
    """Head dims 144 to 192 in three 64-column parts of each tile: the scores sum the parts'
    products and each part of the output leaves on its own; 144's padding, past the first two parts,
    reads as zeros and is never stored."""
    problem = dataclasses.replace(PROBLEM, head_dim=d)
    assert prefill.FAMILY.constraint(variant, problem, INSTALLED) is None
    for nq, nk in [(333, 333), (200, 517), (517, 190)]:
        q, k, v = _inputs(2, 4, 2, nq, nk, d, torch.bfloat16, seed=nq * 7 + nk + d)
        out = _check(variant, q, k, v, causal)
        if causal and nq > nk:
            assert torch.all(out[:, :, : nq - nk] == 0)


# Head dims between powers of two, in tiles of the next one (or of 192): the padding columns read as
# zeros and are never stored, by TMA (clipped at the head dim) or from registers (masked).
PADDED = [
    dataclasses.replace(WS, pingpong=False),
    dataclasses.replace(WS, block_n=64, pingpong=False, o_store="q_slot"),
    dataclasses.replace(WS, block_n=64, o_store="registers", persistent=True, dynamic=True, order="grouped"),
]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("variant", PADDED, ids=lambda v: v.to_json())
@pytest.mark.parametrize("d", [80, 96, 160, 176, 192, 208])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_head_dims_against_float64(variant, d, causal):
    problem = dataclasses.replace(PROBLEM, head_dim=d)
    if prefill.FAMILY.constraint(variant, problem, INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    for nq, nk in [(333, 333), (200, 517), (517, 190)]:
        q, k, v = _inputs(2, 4, 2, nq, nk, d, torch.bfloat16, seed=nq * 3 + nk + d)
        out = _check(variant, q, k, v, causal)
        if causal and nq > nk:
            assert torch.all(out[:, :, : nq - nk] == 0)
