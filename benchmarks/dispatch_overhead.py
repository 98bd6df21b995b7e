"""Host cost per call, part by part (issue #14's targets: the public call at most 10 µs above a
bare launch of the same compiled kernel, the bare launch at most 10 µs, eager prefill at N=512
within 5% of its CUDA-graph time, eager decode at least as fast as cuDNN's eager call).

Per case, microseconds per call, each the median of rounds of back-to-back calls closed by one
synchronization (tunegen.tuning.timing.per_call_us):
- public: the public function (`tunegen.attention`, `tunegen.decode_attention`), outputs
  allocated, as a model calls it;
- bound: the kernel's bound call (tunegen.kernels.launcher) on preallocated outputs;
- bare: the compiled kernels' own launchers (`CompiledKernel.run`) with every argument, grid and
  stream precomputed: the floor for a Python caller;
- triton: Triton's generic `kernel[grid](...)` with the same arguments (the path before binding);
- graph: the public call replayed from a CUDA graph (the GPU's time);
- empty_like: one output allocation, part of every public call.
Host-bound cases are tiny; the suite's N=512 prefill rows and Llama-3 8B decode rows compare
eager with graph where the GPU's time matters, over rotating input sets larger than L2. SDPA's
peers there are timed as tunegen is: their backend chosen once around the timing
(`tunegen.kernels.peers.pinned`), not by each call.

    python benchmarks/dispatch_overhead.py [-o results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math

import torch
import triton

import tunegen
from tunegen.kernels import dispatch, launcher, peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import DecodeArgs, PrefillArgs
from tunegen.tuning.timing import per_call_us

# The Hopper schedule's defaults for these head dims (tunegen/kernels/families/prefill_ws.py, ws_default),
# which the defaults leave to FA2 below one wave of tiles.
TINY_WS = prefill.PrefillVariant(
    schedule="ws",
    block_m=128,
    block_n=64,
    consumers=1,
    overlap=True,
    ctas_per_sm=2,
    num_stages=3,
    persistent=True,
)
WIDE_WS = prefill.PrefillVariant(
    schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True, persistent=True
)


@contextlib.contextmanager
def recording():
    """The kernels, grids, arguments and options that binds inside the block pass to the launcher."""
    seen = []
    real = launcher.bound

    def record(kernel, grid, args, *, device, **options):
        seen.append((kernel, tuple(grid), args, options))
        return real(kernel, grid, args, device=device, **options)

    launcher.bound = record
    try:
        yield seen
    finally:
        launcher.bound = real


def bare_and_triton(launches):
    """Two functions running `launches`: straight through each compiled kernel's launcher, and
    through Triton's generic `kernel[grid](...)`."""
    stream = torch.cuda.current_stream().cuda_stream
    raw = []
    for kernel, grid, args, options in launches:
        compiled = kernel.warmup(*args, grid=grid, **options)
        grid3 = (*grid, 1, 1, 1)[:3]
        compiled[grid3]  # loads the binary
        raw.append((compiled.run, grid3, compiled.function, compiled.packed_metadata, args))

    def bare():
        for run, grid3, function, metadata, args in raw:
            run(*grid3, stream, function, metadata, None, None, None, *args)

    def generic():
        for kernel, grid, args, options in launches:
            kernel[grid](*args, **options)

    return bare, generic


def parts(public, args, kernel, reference_output):
    """The per-call parts of one case; `args` are the bound call's launch arguments."""
    public()
    with recording() as launches:
        call = kernel.bind(args)
    bare, generic = bare_and_triton(launches)
    result = {
        "public_us": per_call_us([public], graph=False),
        "bound_us": per_call_us([lambda: call(args)], graph=False),
        "bare_us": per_call_us([bare], graph=False),
        "triton_us": per_call_us([generic], graph=False),
        "graph_us": per_call_us([public], graph=True),
        "empty_like_us": per_call_us([lambda: torch.empty_like(reference_output)], graph=False),
        "kernels": len(launches),
        "variant": kernel.variant.as_dict(),
    }
    result["overhead_us"] = result["public_us"] - result["bare_us"]
    return result


def prefill_case(batch, heads, seqlen, head_dim, causal, variant=None):
    """A prefill case on the default kernel, or on `variant` in its place."""
    q, k, v = (
        torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    out = torch.empty_like(q)
    tunegen.attention(q, k, v, causal=causal)
    (problem, gpu), *_ = [key for key in dispatch._CHOICES if key[0].family == "prefill"]
    if variant is not None:
        kernel = base.build(prefill.FAMILY, variant, problem, gpu)
        dispatch._CHOICES[(problem, gpu)] = dispatch.Choice(kernel, "default", "benchmark: a given Variant")
        dispatch.fast_calls.clear()
    kernel = dispatch.kernel_for(problem, gpu)
    result = parts(
        lambda: tunegen.attention(q, k, v, causal=causal),
        PrefillArgs(q, k, v, out, None, head_dim**-0.5),
        kernel,
        q,
    )
    dispatch.forget()
    return result


def decode_inputs(batch, cache, heads=32, kv_heads=8, head_dim=128, sets=1, room=0):
    """`sets` independent (q, k_cache, v_cache, cache_seqlens), the caches full but for `room`."""
    return [
        (
            torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, cache, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, cache, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
            torch.full((batch,), cache - room, dtype=torch.int32, device="cuda"),
        )
        for _ in range(sets)
    ]


def decode_case(batch, cache, append):
    ((q, kc, vc, lengths),) = decode_inputs(batch, cache, room=1)
    new = (
        tuple(torch.randn(batch, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        if append
        else (None, None)
    )
    public = lambda: tunegen.decode_attention(q, kc, vc, lengths, k=new[0], v=new[1])
    public()
    choice, *_ = [c for key, c in dispatch._CHOICES.items() if key[0].family == "decode"]
    out = torch.empty_like(q)
    result = parts(public, DecodeArgs(q, kc, vc, lengths, out, None, 128**-0.5, None, *new), choice.kernel, q)
    dispatch.forget()
    return result


def eager_against_graph(calls, impl="tunegen"):
    """Per-call µs of `calls` back to back and replayed from a CUDA graph; a peer (`impl`) inside
    its setting, entered once around each timing, as tunegen's calls pay none."""
    return {
        "eager_us": per_call_us(calls, graph=False, impl=impl),
        "graph_us": per_call_us(calls, graph=True, impl=impl),
    }


def suite_rows():
    """Eager against graph where the GPU's time matters: the prefill suite's N=512 rows (16k tokens,
    hidden 2048) and Llama-3 8B decode at B=1, cache 4096, beside cuDNN's and FA2's eager calls."""
    rows = {}
    for head_dim in (64, 128):
        heads = 2048 // head_dim
        q, k, v = (
            torch.randn(32, heads, 512, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        for causal in (False, True):
            rows[f"prefill N=512 D={head_dim} causal={causal}"] = eager_against_graph(
                [lambda c=causal, t=(q, k, v): tunegen.attention(*t, causal=c)]
            )
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for batch, cache in ((1, 4096), (1, 32768), (16, 8192), (64, 4096)):
        bytes_read = 2 * batch * cache * 8 * 128 * 2
        sets = decode_inputs(batch, cache, sets=max(1, min(8, math.ceil(2 * l2 / bytes_read))))
        impls = {"tunegen": [lambda s=s: tunegen.decode_attention(*s) for s in sets]}
        for name in ("sdpa-cudnn", "sdpa-flash"):
            sdpa = peers.sdpa(name, False)
            views = [tuple(t.transpose(1, 2) for t in s[:3]) for s in sets]
            impls[name] = [lambda v=v, f=sdpa: f(*v) for v in views]
        for name, calls in impls.items():
            row = eager_against_graph(calls, name)
            row.update({k.replace("_us", "_tbps"): bytes_read / v / 1e6 for k, v in list(row.items()) if v})
            rows[f"decode B={batch} cache={cache} {name}"] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    results = {
        "gpu": cuda_gpu(0).name,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "cases": {
            "prefill tiny (1x2x16x64), default": prefill_case(1, 2, 16, 64, False),
            "prefill tiny (1x2x16x64), ws": prefill_case(1, 2, 16, 64, False, TINY_WS),
            "prefill 1x16x512x128, default": prefill_case(1, 16, 512, 128, False),
            "prefill 1x16x512x128, ws": prefill_case(1, 16, 512, 128, False, WIDE_WS),
            "decode B=1 cache 4096": decode_case(1, 4096, append=False),
            "decode B=1 cache 4096, appending a token": decode_case(1, 4096, append=True),
        },
        "eager_vs_graph": suite_rows(),
    }
    names = ("public_us", "bound_us", "bare_us", "triton_us", "graph_us", "empty_like_us", "overhead_us")
    print(f"{'case':44}" + "".join(f"{n.removesuffix('_us'):>11}" for n in names) + "   kernels")
    for case, r in results["cases"].items():
        print(f"{case:44}" + "".join(f"{r[n]:11.1f}" for n in names) + f"{r['kernels']:>10}")
    print(
        f"\n{'eager against graph (µs per call; TB/s for decode)':60}"
        f"{'eager':>9}{'graph':>9}{'eager/graph':>13}"
    )
    for name, r in results["eager_vs_graph"].items():
        tbps = (
            f"   {r.get('eager_tbps', 0):.2f} / {r.get('graph_tbps', 0):.2f} TB/s"
            if "eager_tbps" in r
            else ""
        )
        ratio = r["eager_us"] / r["graph_us"] if r["graph_us"] else float("nan")
        print(f"{name:60}{r['eager_us']:9.1f}{r['graph_us'] or float('nan'):9.1f}{ratio:13.3f}{tbps}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
