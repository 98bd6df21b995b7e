"""The warm call's host cost of two trees of tunegen, A/B: `call_cost.py --issue`'s cases (the
CPU time a public call takes to issue its launches), for each tree, in alternating fresh processes.

    python benchmarks/host_cost_ab.py OLD_TREE NEW_TREE [-r ROUNDS] [--cpu N] [-o results.json]

Each tree is first installed on its own (pip, no dependencies, into a temporary folder: the
repository's top-level rooms become subpackages of `tunegen` only once installed). Each round then
runs each tree in a fresh process, the order alternating between rounds, with that installation
first on sys.path (optionally pinned to core `--cpu`); both run this folder's call_cost.py, which
uses only the public functions. A process's figure for a case is its least round.

dispatch_overhead.py's `public_us` (calls closed by a synchronization) counts the GPU where it is
slower than the host, and moved by several µs from one process to the next on the H100 machine:
too coarse for an A/B of a few hundred nanoseconds. The table gives the median and the least over
rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import json, sys
sys.path[:0] = [{site!r}, {here!r}]
import call_cost
print(json.dumps({{name: r["best"] for name, r in call_cost.measure(issue=True).items()}}))
"""


def install(tree: str, site: str) -> None:
    """Install `tree` alone (no dependencies, no network) into the folder `site`."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", site, tree], check=True, capture_output=True)


def run(site: str, cpu: int | None) -> dict[str, float]:
    """One process of one tree: the least host µs per call of each case."""
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(site=site, here=HERE)],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=pin,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-r", "--rounds", type=int, default=6)
    ap.add_argument("--cpu", type=int, default=None, help="pin every process to this core")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        sites = {side: os.path.join(scratch, side) for side in rounds}
        for side, site in sites.items():
            install(getattr(args, side), site)
        for i in range(args.rounds):
            for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                rounds[side].append(run(sites[side], args.cpu))
    columns = ("old", "new", "new-old", "least", "least", "new-old")
    print(f"{'host µs per call: median of rounds, then least':50}" + "".join(f"{c:>9}" for c in columns))
    summary = {}
    for case in rounds["old"][0]:
        old, new = ([r[case] for r in rounds[side]] for side in ("old", "new"))
        row = {"old": statistics.median(old), "new": statistics.median(new), "old_least": min(old)}
        row["new_least"] = min(new)
        summary[case] = row
        cells = (row["old"], row["new"], row["new"] - row["old"], min(old), min(new), min(new) - min(old))
        print(f"{case:50}" + "".join(f"{x:9.2f}" for x in cells))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"rounds": rounds, "summary": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
