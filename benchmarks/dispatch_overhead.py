"""Per-call CPU overhead of `tunegen.attention` over a raw launch of the same compiled kernel
(issue #5's target: at most 10 microseconds), on a tiny problem where launches dominate.

Timings, each the median over several rounds of many back-to-back calls synchronized at the
end of each round: the public call, and the dispatched kernel's own launch function (the raw
launch of the same compiled kernel); their difference is dispatch's overhead. Also the public
call replayed through a CUDA graph.

    python benchmarks/dispatch_overhead.py [-o results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tunegen
from tunegen import dispatch
from tunegen.gpu import cuda_gpu


def per_call_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    tunegen.attention(q, k, v)
    (choice,) = dispatch._CHOICES.values()
    launch = choice.kernel.launch
    results = {
        "gpu": cuda_gpu(0).name,
        "public_call_us": per_call_us(lambda: tunegen.attention(q, k, v)),
        "kernel_launch_fn_us": per_call_us(lambda: launch(q, k, v, out, None, 0.125)),
    }
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tunegen.attention(q, k, v)
    results["graph_replay_us"] = per_call_us(graph.replay)
    results["overhead_us"] = results["public_call_us"] - results["kernel_launch_fn_us"]
    for name, value in results.items():
        print(f"{name:22} {value if isinstance(value, str) else f'{value:8.2f}'}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
