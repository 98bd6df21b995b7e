"""Where the time of `stream_k` goes: per suite row (no mask), the default Variant without
`stream_k`, with it (the tail's tiles cut by key blocks where the kernel's rule cuts them), and the
same `stream_k` kernel with its tail left whole (the launch bound with `_tail` cutting nothing),
timed together in rotated rounds (`interleaved_ms`) after a check against SDPA. The third column
tells the cost of carrying the cut in the kernel from what cutting gains.

    python3 stream_k_tail.py --rows 128:16384,128:1024,64:1024,64:4096 -o stream_k_tail.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import torch

from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.render import load
from tunegen.measure.suites import prefill_suite
from tunegen.tuning.timing import interleaved_ms


def _bound(kernel, args, cut: bool):
    """The kernel's launch for `args`, with its tail cut as its rule says or (cut=False) left whole."""
    module = load(kernel.rendered, interpret=False)
    if cut:
        run = module.bind(args)
    else:
        rule = module._tail
        module._tail = lambda tiles, programs, n_kb: (tiles, 0)
        try:
            run = module.bind(args)
        finally:
            module._tail = rule
    return lambda: run(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="128:16384,128:1024,64:1024,64:4096", help="head_dim:seqlen,...")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    gpu = cuda_gpu(0)
    results = []
    for row in args.rows.split(","):
        d, n = (int(x) for x in row.split(":"))
        (shape,) = prefill_suite((n,), (d,), (False,), kv_heads=args.kv_heads)
        gen = torch.Generator().manual_seed(n + d)
        q, k, v = (
            torch.randn(shape.batch, h, n, d, generator=gen).cuda().bfloat16()
            for h in (shape.heads, shape.kv_heads, shape.kv_heads)
        )
        call = PrefillCall(q, k, v, False, d**-0.5, False)
        out, lse = call.outputs()
        problem = call.problem(out)
        default = prefill.FAMILY.default_variant(problem, gpu)
        cut = default.replace(stream_k=True)
        launch_args = call.args(out, lse)
        kernels = {
            "stream_k off": _bound(
                base.build(prefill.FAMILY, default.replace(stream_k=False), problem, gpu), launch_args, True
            ),
            "stream_k": _bound(base.build(prefill.FAMILY, cut, problem, gpu), launch_args, True),
            "stream_k uncut": _bound(base.build(prefill.FAMILY, cut, problem, gpu), launch_args, False),
        }
        group = shape.heads // shape.kv_heads
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        )
        for name, run in kernels.items():
            out.fill_(float("nan"))
            run()
            err = (out.float() - ref.float()).abs().max().item()
            if not err < 2e-2:
                raise SystemExit(f"{name} at D={d} N={n}: max error {err} against SDPA")
        times = interleaved_ms(kernels, rounds=args.rounds)
        rates = {name: shape.flops() / ms / 1e9 for name, ms in times.items()}
        results.append({"head_dim": d, "seqlen": n, "variant": cut.as_dict(), "ms": times, "tflops": rates})
        print(
            f"D={d} N={n:>5} " + " | ".join(f"{name} {rate:.0f}" for name, rate in rates.items()), flush=True
        )
    if args.output:
        provenance = {
            "gpu": gpu.name,
            "triton": gpu.triton_version,
            "torch": gpu.torch_version,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        pathlib.Path(args.output).write_text(json.dumps({**provenance, "results": results}, indent=1))


if __name__ == "__main__":
    main()
