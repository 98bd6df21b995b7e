"""What dQ's reductions cost the backward's Hopper schedule: copies of a version's rendered modules
(`backward_ab.py render`) with the consumers' float32 adds into dQ's accumulator (dq_write
"atomic") thinned, to time beside the version with `backward_ab.py time`. No GPU needed here.

The copies compute a wrong dQ (dK and dV stay right); their times bound what fewer reductions
could gain, nothing more. Each keeps dQ's product and its wait, so that only the adds go:

- no_reductions: none (the adds sit behind a branch never taken).
- half_steps: every other query tile's, all of its tile.
- half_columns: every query tile's, half of each thread's 16-byte vectors (the first of each two
  consecutive), the share a program would still add if a cluster of two summed dQ over its shared
  memory first and each added half the columns.

    python benchmarks/backward_ab.py render base templates/_attention_bwd_ws.j2
    python benchmarks/backward_dq_probes.py base no_reductions,half_steps,half_columns
    python benchmarks/backward_ab.py time base,base-no_reductions,base-half_columns --sustain 3
"""

from __future__ import annotations

import argparse
import pathlib
import re

from backward_ab import MODULES

# The first of each two vectors: eight registers a call, four added (the outputs are unused).
_FIRST_OF_TWO = '''def _reduce_add(ptrs, values):
    """Probe: of each two consecutive vectors of a thread, add the first only."""
    gl.inline_asm_elementwise("red.global.add.v4.f32 [$8], {$16, $17, $18, $19};\\n"
                              "mov.b32 $0, 0;\\nmov.b32 $1, 0;\\nmov.b32 $2, 0;\\nmov.b32 $3, 0;\\n"
                              "mov.b32 $4, 0;\\nmov.b32 $5, 0;\\nmov.b32 $6, 0;\\nmov.b32 $7, 0;",
                              "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,f,f,f,f,f,f,f,f",
                              [ptrs.to(gl.int64), values],
                              dtype=gl.int32, is_pure=False, pack=8)'''


def _guarded(source: str, condition: str) -> str:
    """Every call of `_reduce_add` behind `if condition:`."""
    call = re.compile(r"^( *)(_reduce_add\(.*)$", re.M)
    return call.sub(lambda m: f"{m[1]}if {condition}:\n{m[1]}    {m[2]}", source)


def _first_of_two(source: str) -> str:
    start = source.index("def _reduce_add(ptrs, values):")
    end = source.index("\n\n\n", start)
    return source[:start] + _FIRST_OF_TWO + source[end:]


PROBES = {
    "no_reductions": lambda s: _guarded(s, "seqlen_q < 0"),
    "half_steps": lambda s: _guarded(s, "(start_m // BLOCK_M) % 2 == 0"),
    "half_columns": _first_of_two,
}


def make_probes(tag: str, names: list[str], folder: pathlib.Path = MODULES) -> list[pathlib.Path]:
    """Write probe `name`'s copy of each of `tag`'s modules in `folder` as TAG-NAME_<problem>.py;
    modules that add dQ otherwise (dq_write "tma") have no copy. Returns the copies' paths."""
    sources = sorted(folder.glob(f"{tag}_d*.py"))
    if not sources:
        raise SystemExit(f"tag: no modules {folder}/{tag}_d*.py; render the version first")
    unknown = [name for name in names if name not in PROBES]
    if unknown:
        raise SystemExit(f"probes: expected names of {', '.join(PROBES)}, got {unknown[0]!r}")
    written = []
    for path in sources:
        source = path.read_text()
        if "def _reduce_add(ptrs, values):" not in source:
            print(f"{path.name}: dQ not added from registers (dq_write 'tma'), no probe")
            continue
        for name in names:
            written.append(folder / f"{tag}-{name}_{path.name[len(tag) + 1 :]}")
            written[-1].write_text(PROBES[name](source))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag", help="a rendered version in benchmarks/ab_modules")
    ap.add_argument("probes", help=f"comma-separated, of {', '.join(PROBES)}")
    args = ap.parse_args()
    make_probes(args.tag, args.probes.split(","))


if __name__ == "__main__":
    main()
