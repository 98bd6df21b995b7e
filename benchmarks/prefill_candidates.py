"""The hand-chosen Variants that benchmarks/prefill_defaults.py (and fp8_defaults.py) verify and
time per head dim and mask: FlashAttention-2's loop's tiles, the Hopper schedule's forms, and
the program orders each is tried in."""

from __future__ import annotations

import itertools

from tunegen.kernels.families import prefill
from tunegen.kernels.families.operands import block_d, ws_block_d

TILES = {  # schedule "fa2": block_m, block_n, num_warps, num_stages
    64: [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (256, 64, 8, 3),
    ],
    128: [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 8, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (128, 128, 4, 2),
    ],
    256: [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 8, 2),
        (64, 64, 4, 2),
        (128, 32, 4, 2),
        (64, 32, 4, 3),
        (128, 128, 8, 2),
    ],
}
WS = {  # schedule "ws": block_m, block_n, num_stages, consumers, pingpong, overlap, ctas_per_sm[, knobs]
    64: [
        (64, 128, 2, 3, True, False, 1),
        (64, 64, 2, 3, True, True, 1),
        (64, 128, 2, 2, True, True, 1),
        (64, 128, 3, 2, True, True, 1),
        (128, 64, 2, 2, True, True, 1),
        (64, 128, 2, 3, False, False, 1),
        (128, 64, 2, 1, False, True, 1),
        (128, 64, 2, 1, False, True, 2),
        (128, 64, 3, 1, False, True, 2),
        (64, 128, 2, 1, False, True, 2),
        (64, 64, 3, 1, False, True, 2),
    ],
    128: [
        (64, 128, 2, 2, True, True, 1),
        (64, 128, 2, 2, True, False, 1),
        (64, 128, 2, 2, False, True, 1),
        (64, 128, 2, 2, False, False, 1),
        (64, 64, 3, 2, True, True, 1),
        (64, 64, 2, 3, True, True, 1),
        (64, 128, 2, 1, False, True, 1),
        (128, 64, 2, 1, False, False, 1),
        (64, 64, 2, 1, False, True, 2),
        (64, 64, 2, 1, False, False, 2),
        # The query rows from registers (at 128-key blocks only without overlap: registers).
        (64, 64, 2, 2, True, True, 1, {"q_regs": True}),
        (64, 64, 2, 2, False, True, 1, {"q_regs": True}),
        (64, 128, 2, 2, True, False, 1, {"q_regs": True}),
        (64, 128, 2, 2, False, False, 1, {"q_regs": True}),
    ],
    # Head dim 256: a ring of two 64-key blocks beside two consumers' query rows leaves no room for
    # the output's own slot, so it leaves through the query slot or from registers; one consumer
    # keeps its slot, and has room for a second query slot (persistent programs only).
    256: [
        (64, 64, 2, 2, False, True, 1, {"o_store": "registers"}),
        (64, 64, 2, 2, False, True, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, False, False, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, True, True, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, False, False, 1, {"o_store": "q_slot", "mask_branch": True}),
        (64, 64, 2, 1, False, True, 1, {}),
        (64, 64, 2, 1, False, True, 1, {"q_stages": 2}),
    ],
    # Head dim 192, in three parts of 64 columns: a quarter less shared memory than 256's tiles
    # leaves room for the output's own slot, a ring of three, or a second query slot.
    192: [
        # The defaults' forms first (the rows a head dim padded to 192 tries): the query rows from
        # registers, P·V's first two parts as one product.
        (64, 64, 3, 2, False, True, 1, {"q_regs": True, "pv_pair": True, "o_store": "q_slot"}),
        (64, 64, 2, 2, False, True, 1, {"q_regs": True, "pv_pair": True, "o_store": "q_slot"}),
        (64, 64, 2, 2, False, False, 1, {"q_regs": True, "pv_pair": True}),
        (64, 64, 2, 2, True, False, 1, {"q_regs": True, "pv_pair": True}),
        (64, 64, 2, 2, False, True, 1, {"q_regs": True, "pv_pair": True}),
        (64, 64, 2, 2, False, True, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, False, True, 1, {}),
        (64, 64, 3, 2, False, True, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, False, False, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, True, True, 1, {"o_store": "q_slot"}),
        (64, 64, 2, 2, True, False, 1, {}),
        (64, 64, 2, 2, False, True, 1, {"o_store": "q_slot", "q_stages": 2}),
        (64, 64, 2, 2, False, False, 1, {"o_store": "q_slot", "mask_branch": True}),
        # The query rows from registers: half the shared memory the scores' products read.
        (64, 64, 2, 2, False, False, 1, {"q_regs": True}),
        (64, 64, 2, 2, False, True, 1, {"q_regs": True}),
        (64, 64, 2, 2, False, True, 1, {"q_regs": True, "o_store": "q_slot"}),
        (64, 64, 3, 2, False, True, 1, {"q_regs": True, "o_store": "q_slot"}),
        (64, 64, 2, 2, True, False, 1, {"q_regs": True}),
        (64, 64, 2, 2, False, False, 1, {"q_regs": True, "o_store": "q_slot"}),
    ],
}
# A head dim between powers of two runs in tiles of the next one (or of 192): a few of its rows.
PADDED_ROWS = {128: slice(0, 4), 192: slice(0, 4), 256: slice(1, 5)}


def ws_variant(
    tiles: tuple, order: str, reverse_m: bool, persistent: bool, dynamic: bool = False
) -> prefill.PrefillVariant:
    """A "ws" Variant from a WS row (block_m, block_n, num_stages, consumers, pingpong, overlap,
    ctas_per_sm, and a dict of other knobs where given) and a program order."""
    bm, bn, s, c, pp, ov, ctas, *knobs = tiles
    return prefill.PrefillVariant(
        schedule="ws",
        block_m=bm,
        block_n=bn,
        num_stages=s,
        consumers=c,
        pingpong=pp,
        overlap=ov,
        ctas_per_sm=ctas,
        persistent=persistent,
        dynamic=dynamic,
        order=order,
        reverse_m=reverse_m,
        **(knobs[0] if knobs else {}),
    )


def candidates(head_dim: int, causal: bool, schedules: list[str]) -> list[prefill.PrefillVariant]:
    """The Variants tried per (head dim, causal): for "ws" each tile shape also persistent and, for
    causal, heaviest query blocks first within L2-sized groups of heads (at head dims 192 and 256
    and those padded to 128, 192 or 256, each tile shape launched per tile or persistent on the
    dynamic scheduler, causal only so)."""
    orders = [("head_inner", True), ("m_inner", False)] if causal else [("m_inner", False)]
    out = []
    if "fa2" in schedules:
        tiles = TILES.get(head_dim) or TILES[block_d(head_dim)]
        for (bm, bn, w, s), load, (order, rev) in itertools.product(tiles, ("desc", "ptr"), orders):
            out.append(
                prefill.PrefillVariant(
                    block_m=bm, block_n=bn, num_warps=w, num_stages=s, load=load, order=order, reverse_m=rev
                )
            )
    tile = ws_block_d(head_dim)[0]
    padded = head_dim not in WS and tile in WS
    if "ws" in schedules and (head_dim in WS or padded):
        ws_orders = [("grouped", True), ("m_inner", False)] if causal else [("m_inner", False)]
        walks = [(False, False), (True, False)]
        rows = WS[head_dim] if head_dim in WS else WS[tile][PADDED_ROWS[tile]]
        if head_dim in (192, 256) or padded:
            walks = [(False, False), (True, True)]
            ws_orders = ws_orders[:1]
        for tiles, (order, rev), walk in itertools.product(rows, ws_orders, walks):
            try:
                out.append(ws_variant(tiles, order, rev, *walk))
            except ValueError:  # a second query slot serves persistent programs only
                continue
    return out
