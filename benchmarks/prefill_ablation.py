"""What each technique of the Hopper schedule gains on its own: the prefill kernel at a few suite
shapes as FlashAttention-2's loop, then warp-specialized with two consumers, then with ping-pong,
with the softmax overlapped, with both, persistent, beside cuDNN; all checked against float64 on
sampled rows, then timed together in interleaved rounds (`tunegen.measure.rows.check_then_time`).

    python benchmarks/prefill_ablation.py --head-dim 128 --seqlens 4096,16384 -o ablation.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import torch

from tunegen.kernels import peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.reference import TOLERANCE, sampled_error
from tunegen.measure.rows import check_then_time
from tunegen.measure.suites import prefill_suite

WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2)
STEPS = {  # name: Variant, in the order the techniques add up
    "ws, 2 consumers": WS,
    "+ ping-pong": WS.replace(pingpong=True),
    "+ overlap (no ping-pong)": WS.replace(overlap=True),
    "+ ping-pong + overlap": WS.replace(pingpong=True, overlap=True),
    "+ overlap + persistent": WS.replace(overlap=True, persistent=True),
}


def measure(shape, gpu) -> list[dict]:
    """One suite shape: FA2's default loop, each step of STEPS and cuDNN, checked then timed together."""
    problem = shape.problem("bfloat16")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
        for h in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    scale, out = shape.head_dim**-0.5, torch.empty_like(q)
    check = functools.partial(sampled_error, q=q, k=k, v=v, causal=shape.causal, scale=scale, generator=gen)

    def launcher(variant):
        kernel = base.build(prefill.FAMILY, variant, problem, gpu)
        return lambda: kernel.launch(PrefillArgs(q, k, v, out, None, scale)) or out

    variants = {"fa2 (default loop)": prefill.fa2_default(problem, gpu), **STEPS}
    calls = {name: (launcher(variant), check, TOLERANCE["bfloat16"]) for name, variant in variants.items()}
    cudnn = peers.sdpa("sdpa-cudnn", shape.causal)
    calls["sdpa-cudnn"] = (lambda: cudnn(q, k, v), check, TOLERANCE["bfloat16"])
    rows = []
    for name, (ms, err, note) in check_then_time(calls).items():
        tflops = shape.flops() / ms / 1e9 if ms else None
        rows.append(
            {"shape": shape.__dict__, "impl": name, "ms": ms, "tflops": tflops, "rel_err": err, "note": note}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    gpu = cuda_gpu(0)
    shapes = prefill_suite([int(n) for n in args.seqlens.split(",")], (args.head_dim,))
    rows = [row for shape in shapes for row in measure(shape, gpu)]
    if args.output:
        with open(args.output, "w") as fh:
            provenance = {"gpu": gpu.name, "triton": gpu.triton_version, "torch": gpu.torch_version}
            provenance["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            )
            json.dump({**provenance, "rows": rows}, fh, indent=1)
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape.__dict__]
        cudnn = next(r["tflops"] for r in mine if r["impl"] == "sdpa-cudnn")
        print(f"\nD={shape.head_dim} N={shape.seqlen} causal={shape.causal} (TFLOP/s, ratio to cuDNN)")
        for r in mine:
            text = f"{r['tflops']:5.0f} ({r['tflops'] / cudnn:.2f})" if r["tflops"] else r["note"]
            print(f"  {r['impl']:28s} {text}")


if __name__ == "__main__":
    main()
