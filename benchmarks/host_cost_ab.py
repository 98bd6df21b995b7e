"""The warm call's host cost of two trees of tunegen, A/B in one process series: each tree's own
`benchmarks/dispatch_overhead.py` cases (public call, bound call, bare launch; see there), run in
alternation, several rounds each, so that drift on the machine falls on both.

    python benchmarks/host_cost_ab.py OLD_TREE NEW_TREE [-r ROUNDS] [--cpu N] [-o results.json]

Each tree is first installed on its own (pip, no dependencies, into a temporary folder: the
repository's top-level rooms become subpackages of `tunegen` only once installed); each round then
runs, in a fresh process with that installation first on sys.path, the tree's own
dispatch_overhead prefill and decode cases (not its suite rows), pinned to one core (`--cpu`):
unpinned, the same tree's figures moved by half from one process to the next. The table gives the
median and the least of the rounds.
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


def run(tree: str, site: str, cpu: int) -> dict:
    code = CHILD.format(tree=os.path.abspath(tree), site=site, cases=CASES)
    pin = lambda: os.sched_setaffinity(0, {cpu})
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, preexec_fn=pin
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=1, help="the core every round runs on")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    rounds = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        sites = {side: os.path.join(scratch, side) for side in rounds}
        for side, site in sites.items():
            install(getattr(args, side), site)
        for _ in range(args.rounds):
            for side, site in sites.items():
                rounds[side].append(run(getattr(args, side), site, args.cpu))
    columns = ("part", "old", "new", "new-old", "least", "least", "new-old")
    title = "µs per call: median of rounds, then least"
    print(f"{title:44}" + "".join(f"{c:>9}" for c in columns))
    summary = {}
    for case in CASES:
        for part in ("public_us", "bound_us", "bare_us"):
            old, new = ([r[case][part] for r in rounds[side]] for side in ("old", "new"))
            row = {"old": statistics.median(old), "new": statistics.median(new)}
            row.update({"old_least": min(old), "new_least": min(new)})
            summary[f"{case} {part}"] = row
            medians = (row["old"], row["new"], row["new"] - row["old"])
            least = (row["old_least"], row["new_least"], row["new_least"] - row["old_least"])
            cells = "".join(f"{x:9.2f}" for x in (*medians, *least))
            print(f"{case:44}{part.removesuffix('_us'):>9}{cells}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"rounds": rounds, "median": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
