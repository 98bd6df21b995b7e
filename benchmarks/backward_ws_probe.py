"""Where the backward's Hopper schedule spends its time: the default Variant's rendered module with
dQ added by the writer warp's TMA reduce-add (the path whose pieces the dQ patches take out; the
default adds dQ from registers), and copies of it with one piece of each step taken out, timed
back to back (CUDA events, median of 30 after 3 warm-ups) beside cuDNN's backward through
autograd.

The patched copies compute wrong gradients: their times bound what removing (or hiding) that
piece could gain, nothing more (but for no_causal_split, which keeps them right). A patch whose
text is not in the rendered source (the template moved on, or the Problem has no such piece) is
reported and skipped.

    python benchmarks/backward_ws_probe.py --patches base,no_dq_store,no_dq_write,no_dq
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tunegen.kernels.families import backward
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import BackwardArgs
from tunegen.kernels.render import render
from tunegen.measure.suites import backward_suite

# The consumers' hand-over of dQ's tile and the writer warp's reduce-add, as rendered.
_STORE = "            dq_smem.store(dq)\n            fence_async_shared()\n"
_REDUCE = (
    "            _tma_reduce_add(desc_dqa, [off_b, off_h, i * BLOCK_M, 0], "
    "dq_smem.reshape([1, 1, BLOCK_M, HEAD_DIM]))\n"
    "            tma.store_wait(0)\n"
)
_HAND_OVER = (
    "            mbarrier.wait(dq_bars.index(1), (ring & 1) ^ 1)\n"
    + _STORE
    + "            mbarrier.arrive(dq_bars.index(0), count=1)\n"
)
_TAKE_OVER = "            mbarrier.wait(dq_bars.index(0), ring & 1)\n"
_GIVE_BACK = "            mbarrier.arrive(dq_bars.index(1), count=1)\n"
# dQ's tile stored under a condition never true at run time: the product that computes it stays (a
# tile nothing reads would let the compiler drop the product with it).
_KEEP = "            if seqlen_q < 0:\n                dq_smem.store(dq)\n"
# Name: the (rendered text, its replacement) pairs that make the copy; every text must be there.
PATCHES = {
    "base": [],
    # The writer adds whatever the tile holds; the hand-over's barriers stay.
    "no_dq_store": [(_STORE, _KEEP + "            fence_async_shared()\n")],
    # dQ's product, neither stored nor added; consumers and writer still hand the tile over.
    "no_dq_write": [(_STORE, _KEEP + "            fence_async_shared()\n"), (_REDUCE, "")],
    # No dQ at all, its product, hand-over and writer's adds included.
    "no_dq": [(_HAND_OVER, ""), (_TAKE_OVER + _REDUCE + _GIVE_BACK, "")],
    # Causal: every step masked, none apart (the gradients stay right; only the split is gone).
    "no_causal_split": [
        (
            "    mid = gl.minimum(gl.maximum(full, lo), n_m_blocks)\n",
            "    mid = n_m_blocks + 0 * full\n",
        )
    ],
}


def _module(source: str, name: str):
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median_ms(fn, rounds: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[rounds // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--patches", default=",".join(PATCHES))
    args = ap.parse_args()
    gpu = cuda_gpu(0)
    seqlens = [int(n) for n in args.seqlens.split(",")]
    dims = [int(d) for d in args.head_dims.split(",")]
    print(f"{gpu.name}, Triton {gpu.triton_version}, torch {gpu.torch_version}")
    for problem in backward_suite(seqlens, dims, (False, True), 16384, 2048, None, "bfloat16"):
        b, h, n, d = problem.batch, problem.num_heads_q, problem.seqlen_q, problem.head_dim
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout, out = (torch.randn(b, h, n, d, generator=gen).cuda().bfloat16() for _ in range(5))
        lse = torch.randn(b, h, n, device="cuda") + 10
        flops = 2.5 * problem.flops()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            peer_out = F.scaled_dot_product_attention(*leaves, is_causal=problem.causal)
        ms = _median_ms(lambda o=peer_out, x=leaves, g=dout: torch.autograd.grad(o, x, g, retain_graph=True))
        line = [f"cudnn {flops / ms / 1e9:4.0f}"]
        variant = backward.FAMILY.default_variant(problem, gpu).replace(dq_write="tma")
        features = backward.FAMILY.features(problem, gpu)
        source = render(backward.FAMILY.template, "backward", variant, features).source
        for name in args.patches.split(","):
            patch = PATCHES[name]
            if any(text not in source for text, _ in patch):
                line.append(f"{name} (not in this module)")
                continue
            patched = source
            for text, replacement in patch:
                patched = patched.replace(text, replacement)
            module = _module(patched, f"probe_{name}")
            grads = [torch.empty_like(t) for t in (q, k, v)]
            launch_args = BackwardArgs(q, k, v, out, dout, lse, None, *grads, d**-0.5)
            ms = _median_ms(lambda m=module, a=launch_args: m.launch(a))
            line.append(f"{name} {flops / ms / 1e9:4.0f}")
        print(f"D={d} causal={problem.causal!s:5} N={n:5d}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
