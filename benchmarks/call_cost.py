"""A warm public call's host cost, microseconds per call, to compare two checkouts on one machine
(issue 27: bounding the caches of bound calls and sharing decode's split workspace per stream may
cost a warm call at most 1 µs). The cases are small enough that the host, not the GPU, sets the
pace: back-to-back calls on the same inputs, each round closed by one synchronization, the best
round (the host's cost with the least interference from the machine's other work; the median is
kept too). CPUs of machines of one kind differ by half (benchmarks/results/launch_h100.md), and
one machine's runs by a third, so run the two checkouts alternately on one machine, many times:

    python benchmarks/call_cost.py --label new -o new1.json
    python benchmarks/call_cost.py --summarize old1.json new1.json old2.json new2.json

With `--issue`, a round times the host's issue of its calls alone: no synchronization inside the
window, and rounds short enough that the launch queue never fills, so the GPU never sets the pace
(benchmarks/host_cost_ab.py runs two checkouts so, alternately).

Uses only the public functions, so that any release of tunegen can be measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROUNDS, CALLS = 15, 500
# --issue: more, shorter rounds (200 calls of at most two launches stay well inside the launch queue).
ISSUE_ROUNDS, ISSUE_CALLS = 60, 200


def _cases() -> dict[str, Callable[[], object]]:
    import tunegen

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    q, k, v = randn(1, 2, 16, 64), randn(1, 2, 16, 64), randn(1, 2, 16, 64)
    dq = randn(1, 1, 32, 128)
    cache = [randn(1, 256, 8, 128) for _ in range(2)]
    new = [randn(1, 1, 8, 128) for _ in range(2)]
    lengths = torch.tensor([200], device="cuda", dtype=torch.int32)
    long_cache = [randn(1, 4096, 8, 128) for _ in range(2)]
    long_lengths = torch.tensor([4096], device="cuda", dtype=torch.int32)
    pages = [randn(16, 16, 8, 128) for _ in range(2)]
    table = torch.arange(16, device="cuda", dtype=torch.int32).view(1, 16)
    e4m3 = [t.to(torch.float8_e4m3fn) for t in cache]
    return {
        "prefill 1x2x16x64": lambda: tunegen.attention(q, k, v),
        "prefill 1x2x16x64 causal, lse": lambda: tunegen.attention(q, k, v, causal=True, return_lse=True),
        "decode B=1, cache 256 (split)": lambda: tunegen.decode_attention(dq, *cache, lengths),
        "decode B=1, cache 4096 (32 splits)": lambda: tunegen.decode_attention(dq, *long_cache, long_lengths),
        "decode appending a token": lambda: tunegen.decode_attention(dq, *cache, lengths, k=new[0], v=new[1]),
        "decode paged, 16-token pages": lambda: tunegen.decode_attention(
            dq, *pages, lengths, block_table=table
        ),
        "decode, e4m3 cache": lambda: tunegen.decode_attention(dq, *e4m3, lengths),
    }


def measure(issue: bool = False) -> dict[str, dict[str, float]]:
    """Microseconds per warm call of each case: the best round and the median one; with `issue`,
    of the host's issue alone (rounds not closed by a synchronization)."""
    rounds_n, calls = (ISSUE_ROUNDS, ISSUE_CALLS) if issue else (ROUNDS, CALLS)
    results = {}
    for name, call in _cases().items():
        for _ in range(200):
            call()
        rounds = []
        for _ in range(rounds_n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            if not issue:
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / calls * 1e6)
        results[name] = {"best": min(rounds), "median": statistics.median(rounds)}
    return results


def summarize(paths: list[str]) -> str:
    """A markdown table: per case, each label's median over its runs of their best rounds, and
    the difference of the second label from the first."""
    runs: dict[str, list[dict[str, float]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.setdefault(data["label"], []).append(data["us"])
    labels = list(runs)
    cases = list(next(iter(runs.values()))[0])
    medians = {lab: {c: statistics.median(r[c]["best"] for r in runs[lab]) for c in cases} for lab in labels}
    head = "| case | " + " | ".join(f"{lab} (µs, {len(runs[lab])} runs)" for lab in labels)
    lines = [head + (f" | {labels[1]} − {labels[0]} |" if len(labels) == 2 else " |")]
    lines.append("| --- " * (len(labels) + 1 + (len(labels) == 2)) + "|")
    for c in cases:
        row = f"| {c} | " + " | ".join(f"{medians[lab][c]:.1f}" for lab in labels)
        if len(labels) == 2:
            row += f" | {medians[labels[1]][c] - medians[labels[0]][c]:+.1f}"
        lines.append(row + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="this")
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the table of earlier runs")
    ap.add_argument("--issue", action="store_true", help="time the host's issue of the calls alone")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    results = {"label": args.label, "gpu": torch.cuda.get_device_name(), "us": measure(args.issue)}
    print(json.dumps(results, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
