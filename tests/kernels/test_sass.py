"""The SASS check for registers an asynchronous wgmma still reads (tunegen.kernels.sass), on
machine code as nvdisasm prints it: the hazard an offline sm_90 compile showed (FP8 P packed
before the wait for the product reading the previous P), and the orders that retire the product
first. The kernels' own compiles are checked in test_compile.py."""

from __future__ import annotations

from tunegen.kernels import sass


def _code(*instructions: str) -> str:
    return "\n".join(
        f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(instructions)
    )


SCORES = "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0"
PV = (
    "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R152, gdesc[UR12], R88",
    "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R156, gdesc[UR14], R88, gsb0",
)


def test_a_write_to_the_operand_before_the_wait_is_found():
    code = _code(
        SCORES,
        *PV,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FMNMX R153, R24, R25, !PT",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    )
    assert sass.operand_clobbers(code) == ["/*0040*/                   FMNMX R153, R24, R25, !PT ;"]


def test_writes_after_the_product_retires_are_fine():
    # The products' group retired by the wait for all but the newest group, the scores' issued after.
    later = _code(
        *PV,
        SCORES,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R157, R27, R26, RZ",
    )
    assert sass.operand_clobbers(later) == []
    waited = _code(*PV, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R152, R3")
    assert sass.operand_clobbers(waited) == []


def test_wide_writes_stores_and_shared_memory_operands():
    below = _code(*PV, "LDS.128 R148, [R2]", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert sass.operand_clobbers(below) == []  # R148 to R151, below the operands' R152 to R159
    wide = _code(*PV, "LDS.128 R150, [R2]", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert len(sass.operand_clobbers(wide)) == 1  # R150 to R153
    assert sass.operand_clobbers(_code(*PV, "IMAD.WIDE R158, R3, R4, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    stores = _code(*PV, "STL.64 [R152+0x10], R20", "STS [R153], R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert sass.operand_clobbers(stores) == []
    shared = _code(SCORES, "MOV R24, R3", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert sass.operand_clobbers(shared) == []  # no operand from registers (the accumulator is ptxas's)
