"""Where a backward call's GPU time goes, kernel by kernel: torch.profiler's CUDA time per call of
each kernel that autograd's backward through `tunegen.attention` (and through SDPA's cuDNN
backend) launches, on the prefill suite's shapes. A fresh forward graph feeds each call.

    python backward_kernels.py --head-dim 128 --seqlens 4096,16384 -o results/<file>.txt
"""

from __future__ import annotations

import argparse
import collections
import functools

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import tunegen
from tunegen.kernels import peers
from tunegen.measure.suites import prefill_suite


def breakdown(shape, impl: str, calls: int, warmup: int) -> dict[str, float]:
    """µs per call of each CUDA kernel of `impl`'s backward on `shape`."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(
            shape.batch, h, shape.seqlen, shape.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if impl == "tunegen":
        call = functools.partial(tunegen.attention, causal=shape.causal)
    else:
        call = peers.sdpa(impl, shape.causal)
    with peers.pinned(impl):
        outs = [call(q, k, v) for _ in range(calls + warmup)]
    for out in outs[calls:]:
        torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for out in outs[:calls]:
            torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:70]] += event.device_time / calls
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impls", default="tunegen,sdpa-cudnn", help="tunegen, SDPA backends")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    seqlens = tuple(int(n) for n in args.seqlens.split(","))
    impls = args.impls.split(",")
    unknown = [impl for impl in impls if impl != "tunegen" and impl not in peers.SDPA_BACKENDS]
    if unknown:
        ap.error(f"--impls: expected tunegen or SDPA backends {sorted(peers.SDPA_BACKENDS)}, got {unknown}")
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"]
    for shape in prefill_suite(seqlens, (args.head_dim,), (args.causal,)):
        flops = (
            2.5
            * 4
            * shape.batch
            * shape.heads
            * shape.seqlen**2
            * shape.head_dim
            / (2 if shape.causal else 1)
        )
        for impl in impls:
            times = breakdown(shape, impl, args.calls, args.warmup)
            total = sum(times.values())
            lines.append(
                f"{impl} D={shape.head_dim} N={shape.seqlen} causal={shape.causal}: "
                f"{total:.0f} us a call, {flops / total / 1e6:.0f} TFLOP/s"
            )
            lines += [f"  {t:9.1f} us  {name}" for name, t in sorted(times.items(), key=lambda x: -x[1])]
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
