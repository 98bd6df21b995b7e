"""The Hopper schedule's head-dim tiles and where its query rows live, on the CPU: head dims 144 to
192 in three parts of 64 columns (`ws_block_d`), the query rows in registers (`q_regs`); their GPU
checks are in test_prefill_ws_head_dims.py and test_prefill_ws.py, their defaults in
test_prefill_ws_defaults.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_prefill_ws import PROBLEM, WS

from helpers import H100
from tunegen.kernels.families import prefill
from tunegen.kernels.families.operands import block_d, ws_block_d
from tunegen.kernels.families.prefill_ws import ws_tile_registers
from tunegen.kernels.render import render


def test_query_rows_in_registers_are_a_16_bit_knob_that_counts_their_registers():
    problem = dataclasses.replace(PROBLEM, fp8=True)
    with pytest.raises(ValueError, match="q_regs: fp8's scores' products take the query rows from shared"):
        prefill.FAMILY.check_variant(dataclasses.replace(WS, q_regs=True), problem, H100)
    assert prefill.FAMILY.search_space(problem, H100)["q_regs"] == [False]
    assert prefill.FAMILY.search_space(PROBLEM, H100)["q_regs"] == [False, True]
    # 64 rows of 128 16-bit values: 32 more registers a thread; with overlap at 128-key blocks, too many.
    plain = dataclasses.replace(WS, pingpong=False, overlap=False)
    assert (
        ws_tile_registers(dataclasses.replace(plain, q_regs=True), 128) == ws_tile_registers(plain, 128) + 32
    )
    assert "registers" in prefill.FAMILY.constraint(dataclasses.replace(WS, q_regs=True), PROBLEM, H100)


@pytest.mark.parametrize(
    ("head_dim", "tile"),
    [
        (64, (64, 64)),
        (96, (128, 128)),
        (144, (192, 64)),
        (176, (192, 64)),
        (192, (192, 64)),
        (208, (256, 256)),
    ],
)
def test_head_dims_past_128_up_to_192_run_in_three_parts(head_dim, tile):
    assert ws_block_d(head_dim) == tile
    assert ws_block_d(head_dim, fp8=True) == (block_d(head_dim, fp8=True),) * 2
    problem = dataclasses.replace(PROBLEM, head_dim=head_dim, causal=False)
    tail = dataclasses.replace(WS, block_n=64, pingpong=False, persistent=True, dynamic=True, stream_k=True)
    if tile[1] < tile[0]:
        with pytest.raises(ValueError, match="stream_k: the tail's merge holds one output tile"):
            prefill.FAMILY.check_variant(tail, problem, H100)
    else:
        prefill.FAMILY.check_variant(tail, problem, H100)
    paired = dataclasses.replace(WS, block_n=64, pingpong=False, pv_pair=True)
    assert prefill.FAMILY.search_space(problem, H100)["pv_pair"] == (
        [False, True] if tile[1] < tile[0] else [False]
    )
    if tile[1] < tile[0]:
        prefill.FAMILY.check_variant(paired, problem, H100)
    else:
        with pytest.raises(ValueError, match="pv_pair: pairs the parts of a head-dim tile"):
            prefill.FAMILY.check_variant(paired, problem, H100)


def test_query_rows_in_registers_free_their_slot_unless_read_again():
    """Each consumer frees its query slot once a tile, by one arrive: right after reading its
    rows into registers, but after the tile's last product where the output leaves through the
    slot or a stream-K segment reads its tile slot after the loop."""
    problem = dataclasses.replace(PROBLEM, causal=False)
    base = dataclasses.replace(WS, block_n=64, pingpong=False, q_regs=True, persistent=True, dynamic=True)
    for variant, early in [
        (base, True),
        (base.replace(persistent=False, dynamic=False), True),
        (base.replace(q_stages=2, o_store="registers"), True),
        (base.replace(o_store="q_slot"), False),
        (base.replace(stream_k=True), False),
    ]:
        assert prefill.FAMILY.constraint(variant, problem, H100) is None
        source = render(
            prefill.FAMILY.template, "prefill", variant, prefill.FAMILY.features(problem, H100)
        ).source
        consume = source[source.index("def _consume(") : source.index("def _consume0(")]
        arrives = [m.start() for m in re.finditer(r"mbarrier\.arrive\(q_empty", consume)]
        assert len(arrives) == 1, variant
        loaded = consume.index("q_op = q_tile.load(Q_LAYOUT)")
        last = consume.index("# The last block's PV.")
        assert (loaded < arrives[0] < last) == early and (arrives[0] > last) == (not early), variant


def test_triton_3_9_keeps_the_query_rows_in_shared_memory():
    """3.9 spills the query rows that `q_regs` holds: the constraint refuses it there, and head dim
    192's defaults take the same tiles with the rows in shared memory."""
    newest = dataclasses.replace(H100, triton_version="3.9.0")
    problem = dataclasses.replace(PROBLEM, head_dim=192)
    plain = dataclasses.replace(WS, block_n=64, pingpong=False, overlap=False, q_regs=True)
    assert "spills the query rows" in prefill.FAMILY.constraint(plain, problem, newest)
    assert prefill.FAMILY.constraint(plain, problem, H100) is None
    default = prefill.FAMILY.default_variant(problem, H100)
    assert default.q_regs
    assert prefill.FAMILY.default_variant(problem, newest) == default.replace(q_regs=False)
