"""Where the Hopper backward's consumers meet at CTA-wide barriers, for the installed Triton.

Compiles the backward family's "ws" default Variants (head dim 64 and 128, no causal mask,
whole-wave kernel) offline for sm_90, with no GPU, and lists every `bar.sync` of the PTX with the
source line it precedes and how many threads it waits for. Triton's shared-memory hazard analysis
puts some of them there, and which ones changes between releases; on an H100 they hold the
consumers 5.0 of their 13.7 stall cycles per instruction (benchmarks/results/issue30_h100.md).

    python benchmarks/ws_barriers.py > benchmarks/results/issue30_ws_barriers_triton3.6.txt
"""

from __future__ import annotations

import argparse
import json
import re

import triton

from tunegen.kernels.compiler import CompileJob, compile_kernel
from tunegen.kernels.families import backward
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import Rendered, render

HOPPER = Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda")
BARRIER = re.compile(r"\bbar\.sync\s+(\d+),\s*(\d+);")


def barriers(rendered: Rendered) -> list[tuple[int, str, str]]:
    """(source line, its text, the barrier's id and thread count) of each bar.sync in the PTX of
    the module's main kernel."""
    compiled = compile_kernel(CompileJob(rendered, "bfloat16", (9, 0), "main"))
    lines, text = compiled.asm["ptx"].splitlines(), rendered.source.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = BARRIER.search(line)
        if not match:
            continue
        locs = [x for x in lines[max(0, i - 16) : i] if x.strip().startswith(".loc")]
        number = int(locs[-1].split()[2]) if locs else 0
        found.append((number, text[number - 1].strip() if number else "", f"{match[1]}, {match[2]}"))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", default="{}", help="knobs changed from the default Variant, as JSON")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90, backward ws whole-wave kernel, changes {args.changes}")
    for d in (64, 128):
        problem = Problem("backward", "bfloat16", d, False, 16, 8, 2, 4096, 4096)
        variant = backward.FAMILY.default_variant(problem, HOPPER).replace(**json.loads(args.changes))
        features = backward.FAMILY.features(problem, HOPPER)
        rendered = render(backward.FAMILY.template, "backward", variant, features)
        found = barriers(rendered)
        print(f"\nhead dim {d}: {len(found)} bar.sync ({variant.num_warps} consumer warps)")
        for number, line, barrier in found:
            print(f"  bar.sync {barrier:8s} before line {number:4d}: {line[:90]}")


if __name__ == "__main__":
    main()
