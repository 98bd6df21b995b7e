"""Run one prefill kernel of the suite a few times, for a profiler (`ncu`) to catch: the Variant
dispatch serves for the suite's shape at that head dim, length and mask, one given as JSON, or a
peer's (`--impl sdpa-cudnn`, SDPA's backend chosen once, outside the calls).

    ncu --kernel-name attn_fwd --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_prefill.py --head-dim 128 --seqlen 1024 --causal
"""

from __future__ import annotations

import argparse
import json

import torch

from tunegen.kernels import dispatch, peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.measure.suites import prefill_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", help="a PrefillVariant as JSON (default: what dispatch serves)")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--impl", default="tunegen", help="tunegen, or an SDPA backend (peers.SDPA_BACKENDS)")
    args = ap.parse_args()
    (shape,) = prefill_suite((args.seqlen,), (args.head_dim,), (args.causal,))
    problem, gpu = shape.problem("bfloat16"), cuda_gpu(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
        for h in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    if args.impl != "tunegen":
        call = peers.sdpa(args.impl, shape.causal)
        print(json.dumps({"shape": shape.__dict__, "impl": args.impl}))
        with peers.pinned(args.impl):
            for _ in range(args.launches):
                call(q, k, v)
        torch.cuda.synchronize()
        return
    if args.variant:
        kernel = base.build(prefill.FAMILY, prefill.PrefillVariant.from_json(args.variant), problem, gpu)
    else:
        kernel = dispatch.kernel_for(problem, gpu)
    print(json.dumps({"shape": shape.__dict__, "variant": kernel.variant.as_dict()}))
    out = torch.empty_like(q)
    for _ in range(args.launches):
        kernel.launch(PrefillArgs(q, k, v, out, None, shape.head_dim**-0.5))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
