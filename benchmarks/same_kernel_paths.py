"""One Problem's kernel timed through every path that serves it, in the same rounds.

`tunegen bench` once put the llama3 16k Winner 10% above `tunegen-default`, the same Variant: this
times `tunegen.attention` (twice), the dispatched kernel, and two separate builds of the default
Variant (and any `--peer`), `--rounds` rounds each in a balanced order, and prints each path's
median and its rate per round, so that a gap between the paths can be told from the spread
between the rounds.

    python3 same_kernel_paths.py [--heads 32 --kv-heads 8 --seqlen 16384 --rounds 12 --batch 1 --causal yes]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import tunegen
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch, peers
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import gpu_of
from tunegen.tuning.rounds import round_order
from tunegen.tuning.timing import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", default="yes", choices=["yes", "no"])
    ap.add_argument(
        "--peer", action="append", default=[], help="an SDPA backend timed beside, e.g. sdpa-cudnn"
    )
    args = ap.parse_args()
    n, d, causal = args.seqlen, args.head_dim, args.causal == "yes"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(args.batch, heads, n, d, generator=gen).cuda().bfloat16()
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    call = PrefillCall(q, k, v, causal, d**-0.5, return_lse=False)
    problem = call.problem(torch.empty_like(q))
    family, gpu = get("prefill"), gpu_of(q.device)
    served = dispatch.kernel_for(problem, gpu)
    built = [base.build(family, family.default_variant(problem, gpu), problem, gpu) for _ in range(2)]
    same = served.rendered.digest == built[0].rendered.digest, served.variant == built[0].variant
    print("same source:", *same)

    def direct(kernel: base.Kernel):
        return lambda: kernel.launch(call.args(torch.empty_like(q), None))

    calls = {
        "attention": lambda: tunegen.attention(q, k, v, causal=causal),
        "built0": direct(built[0]),
        "built1": direct(built[1]),
        "served": direct(served),
        "attention2": lambda: tunegen.attention(q, k, v, causal=causal),
    }
    for name in args.peer:
        attend = peers.sdpa(name, causal)
        calls[name] = lambda attend=attend: attend(q, k, v)
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    flops = 4 * args.batch * args.heads * d * (n * (n + 1) / 2 if causal else n * n)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for i in round_order(len(names), r, args.rounds):
            impl = names[i] if names[i] in args.peer else None
            times[names[i]].append(median_ms(calls[names[i]], warmup_ms=25.0, rep_ms=200.0, impl=impl))
    for name in names:
        rates = " ".join(f"{flops / t / 1e9:.0f}" for t in times[name])
        median = flops / statistics.median(times[name]) / 1e9
        print(f"{name:11s} median {median:6.0f} TFLOP/s  per round: {rates}")


if __name__ == "__main__":
    main()
