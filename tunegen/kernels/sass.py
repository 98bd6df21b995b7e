"""Checks on a cubin's machine code (SASS) that no Triton pass sees: whether an instruction writes
a register that an asynchronous wgmma still reads.

A wgmma whose left operand comes from registers (P·V with P in registers, the scores with the
query rows in registers) reads them until a `WARPGROUP.DEPBAR` retires its group. Triton passes
the registers to wait for as dependencies of `warpgroup_mma_wait`, but they reach the PTX only
as a comment, so ptxas may reuse them meanwhile: a packing of FP8 P placed before the wait had
ptxas write the next P into the registers the running product read (offline sm_90 compile,
Triton 3.6). Nothing fails at compile time; the product reads wrong values.
"""

from __future__ import annotations

import re
import subprocess
import tempfile

# `HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR20], R24, gsb0 ;` (QGMMA for FP8): the left
# operand from registers (four, from the second), or with `gdesc` there from shared memory.
_GMMA = re.compile(r"\b[HQ]GMMA\.\S+\s+R\d+,\s+(?:R(\d+)|gdesc)")
_RETIRE = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s+0x([0-9a-f]+)")
# An instruction's first operand, where it is a register it writes: `MOV R152, R3`, `@P0 F2FP...`.
_WRITE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b")
OPERAND_REGISTERS = 4  # a warpgroup's m64 x k left operand: 8 16-bit or 16 8-bit values a thread


def cubin_tool(tool: str, flag: str, cubin: bytes) -> str | None:
    """What one of the tools Triton ships beside ptxas ("nvdisasm", "cuobjdump") prints for
    `cubin` with `flag`, or None where it does not run."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        try:
            return subprocess.run(
                [getattr(triton.knobs.nvidia, tool).path, flag, handle.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return None


def operand_clobbers(sass: str) -> list[str]:
    """The instructions that write a register a wgmma reads from registers before its group is
    retired, in program order from each such wgmma (branches not followed: a loop's products
    are waited for within the iteration that issues them). A group ends at a wgmma marked `gsb0`;
    `WARPGROUP.DEPBAR.LE gsb0, K` retires all but the newest K groups."""
    lines = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", line)]
    found: list[str] = []
    for start, line in enumerate(lines):
        gmma = _GMMA.search(line)
        if gmma is None or gmma.group(1) is None:
            continue
        first = int(gmma.group(1))
        read = set(range(first, first + OPERAND_REGISTERS))
        newer = 0 if "gsb0" in line else -1  # groups closed after this one's (-1: still open)
        for later in lines[start + 1 :]:
            retire = _RETIRE.search(later)
            if retire is not None and newer >= int(retire.group(1), 16):
                break
            if _GMMA.search(later) and "gsb0" in later:
                newer += 1
                continue
            write = _WRITE.match(later)
            if write is not None and _written(write.group(1), int(write.group(2))) & read:
                found.append(later.strip())
                break
    return found


def _written(opcode: str, first: int) -> set[int]:
    """The registers an instruction writes from `first`: two for 64-bit results, four for 128."""
    width = 4 if ".128" in opcode else 2 if ".64" in opcode or ".WIDE" in opcode else 1
    return set(range(first, first + width))
