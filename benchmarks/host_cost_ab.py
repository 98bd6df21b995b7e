"""The warm call's host cost of two trees of tunegen, A/B in one process series: each tree's own
`benchmarks/dispatch_overhead.py` cases (public call, bound call, bare launch; see there), run in
alternation, several rounds each, so that drift on the machine falls on both.

    python benchmarks/host_cost_ab.py OLD_TREE NEW_TREE [-r ROUNDS] [-o results.json]

Each tree is first installed on its own (pip, no dependencies, into a temporary folder: the
repository's top-level rooms become subpackages of `tunegen` only once installed); each round then
runs, in a fresh process with that installation first on sys.path, the tree's own
dispatch_overhead prefill and decode cases (not its suite rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CASES = {
    "prefill tiny (1x2x16x64), default": "prefill_case(1, 2, 16, 64, False)",
    "prefill 1x16x512x128, default": "prefill_case(1, 16, 512, 128, False)",
    "decode B=1 cache 4096": "decode_case(1, 4096, append=False)",
    "decode B=1 cache 4096, appending a token": "decode_case(1, 4096, append=True)",
}
CHILD = """
import json, sys
sys.path[:0] = [{site!r}, {tree!r} + "/benchmarks"]
import dispatch_overhead as d
out = {{}}
for name, expr in {cases!r}.items():
    r = eval("d." + expr)
    out[name] = {{k: r[k] for k in ("public_us", "bound_us", "bare_us")}}
print(json.dumps(out))
"""


def install(tree: str, site: str) -> None:
    """Install `tree` alone (no dependencies, no network) into the folder `site`."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", site, tree], check=True, capture_output=True)


def run(tree: str, site: str) -> dict:
    code = CHILD.format(tree=os.path.abspath(tree), site=site, cases=CASES)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    rounds = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        sites = {side: os.path.join(scratch, side) for side in rounds}
        for side, site in sites.items():
            install(getattr(args, side), site)
        for _ in range(args.rounds):
            for side, site in sites.items():
                rounds[side].append(run(getattr(args, side), site))
    print(f"{'case (µs per call, median of rounds)':48}{'old':>8}{'new':>8}{'new-old':>9}   part")
    summary = {}
    for case in CASES:
        for part in ("public_us", "bound_us", "bare_us"):
            old = statistics.median(r[case][part] for r in rounds["old"])
            new = statistics.median(r[case][part] for r in rounds["new"])
            summary[f"{case} {part}"] = {"old": old, "new": new}
            print(f"{case:48}{old:8.2f}{new:8.2f}{new - old:+9.2f}   {part.removesuffix('_us')}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"rounds": rounds, "median": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
