"""Pick the backward's default Variants for this GPU class: verify and time hand-chosen Variants
per (head dim, causal) on the bf16 suite (16k tokens per batch, hidden 2048), beside SDPA's cuDNN and
FlashAttention-2 backends' backward (and FlexAttention's with --peers) in the same run.

Each knob of the backward is tried against one base per head dim: the passes' tiles, warps and
stages, the four dQ modes, tensor descriptors, the fused delta, the causal program order and the
persistent grid. Every Variant is compiled in parallel worker processes first and checked there
against float64 at a ragged GQA size with gradients poisoned; Triton's cache is shared on disk, so
the timing process reuses those builds. Then each is checked again on every suite shape (float64
gradients of the same inputs), and the shape's Variants and peers that passed are timed together
in interleaved rounds (sweep.py). A kernel that hangs in its check stops the run after --hang-s
seconds with what was measured so far written out.

    python benchmarks/backward_defaults.py --head-dims 128 --seqlens 1024,4096,16384 -o bwd.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import functools
import json
import sys

import torch
from prefill_defaults import _sized, check_in_workers
from sweep import time_in_rounds

from tunegen.kernels import peers
from tunegen.kernels.families import backward, base
from tunegen.kernels.families.backward_case import backward_peer, grads_error, reference_backward
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import BackwardArgs
from tunegen.kernels.reference import TOLERANCE
from tunegen.measure.suites import Shape, prefill_suite

Variant = backward.BackwardVariant
# Per head dim: the base every other candidate changes one or two knobs of, then the tiles tried
# (dK/dV walked x resident, warps, stages; dQ resident x walked, warps, stages).
FLEX_TILES = dict(  # FlexAttention's H100 tiles for head dims 64 and 128
    dkdv_block_m=64,
    dkdv_block_n=128,
    num_warps=8,
    num_stages=3,
    dq_block_m=128,
    dq_block_n=64,
    dq_num_warps=8,
    dq_num_stages=3,
    load="desc",
)
BASES = {
    64: FLEX_TILES,
    128: FLEX_TILES,
    256: dict(
        dkdv_block_m=32,
        dkdv_block_n=64,
        num_warps=8,
        num_stages=2,
        dq_block_m=64,
        dq_block_n=64,
        dq_num_warps=8,
        dq_num_stages=2,
        load="desc",
    ),
}
TILES = {
    64: [
        (64, 128, 4, 3, 128, 64, 4, 3),
        (64, 64, 4, 3, 64, 64, 4, 3),
        (64, 128, 8, 2, 128, 64, 8, 2),
        (32, 128, 4, 4, 128, 32, 4, 4),
        (64, 128, 8, 4, 128, 64, 8, 4),
        (128, 128, 8, 2, 128, 128, 8, 2),
    ],
    128: [
        (64, 128, 8, 2, 128, 64, 8, 2),
        (64, 128, 8, 4, 128, 64, 8, 4),
        (32, 128, 8, 3, 128, 32, 8, 3),
        (64, 64, 4, 3, 64, 64, 4, 3),
        (64, 128, 8, 1, 128, 64, 8, 1),
        (64, 128, 8, 3, 128, 128, 8, 2),
        (64, 128, 8, 3, 64, 64, 4, 3),
        (64, 128, 8, 3, 128, 32, 8, 3),
    ],
    256: [
        (64, 64, 8, 2, 128, 32, 8, 2),
        (32, 64, 8, 2, 64, 32, 8, 2),
        (32, 64, 8, 3, 64, 64, 8, 2),
        (32, 64, 8, 1, 64, 64, 8, 1),
    ],
}
PEERS = ("sdpa-cudnn", "sdpa-flash")


def candidates(head_dim: int, causal: bool) -> list[Variant]:
    """The base, its tiles, each knob of the base changed, and for causal the program orders."""
    base_kw = BASES[head_dim]
    out = [Variant(**base_kw), Variant(**{**base_kw, "load": "ptr"})]
    names = (
        "dkdv_block_m",
        "dkdv_block_n",
        "num_warps",
        "num_stages",
        "dq_block_m",
        "dq_block_n",
        "dq_num_warps",
        "dq_num_stages",
    )
    out += [Variant(**{**base_kw, **dict(zip(names, tiles, strict=True))}) for tiles in TILES[head_dim]]
    knobs = [
        dict(fuse_delta=True),
        dict(dq_mode="concurrent"),
        dict(dq_mode="concurrent", load="ptr"),
        dict(dq_mode="atomic"),
        dict(dq_mode="partial"),
        dict(persistent=True),
        dict(dq_mode="concurrent", persistent=True),
    ]
    if causal:
        knobs += [
            dict(order="heaviest_first"),
            dict(order="heaviest_first", persistent=True),
            dict(order="heaviest_first", dq_mode="concurrent"),
            dict(order="heaviest_first", dq_mode="concurrent", persistent=True),
            dict(order="heaviest_first", fuse_delta=True),
        ]
    for knob in knobs:
        kw = {**base_kw, **knob}
        kw.setdefault("dq_mode", "separate")
        if kw["dq_mode"] != "separate":  # the dQ pass's own knobs keep their defaults
            unused = ("dq_num_warps", "dq_num_stages")
            if kw["dq_mode"] != "concurrent":
                unused += ("dq_block_m", "dq_block_n")
            for name in unused:
                kw[name] = getattr(Variant, name)
        out.append(Variant(**kw))
    return list(dict.fromkeys(out))


WS_BASE = dict(dkdv_block_m=64, dkdv_block_n=128, num_warps=8, num_stages=2, schedule="ws")
WS_KNOBS = [
    {},
    dict(num_stages=3),
    dict(dq_write="atomic"),
    dict(deterministic=True),
    dict(dq_write="atomic", deterministic=True),
    dict(dq_write="atomic", num_stages=3),
    dict(dq_write="atomic", kv_regs=True),
    dict(producer_regs=40),
    dict(num_warps=4, dkdv_block_n=64),
    dict(dkdv_block_m=128),
    dict(kv_regs=True),
    dict(kv_regs=True, num_stages=3),
    dict(dq_write="atomic", split_tail=True),
    dict(dq_write="atomic", split_warpgroups=True),
    dict(dq_write="atomic", paired_walk=True),
    dict(dq_write="atomic", kv_regs=True, paired_walk=True),
]


def ws_candidates(causal: bool) -> list[Variant]:
    """The Hopper schedule's base (FlashAttention-3's head dim 128 tiles) and each knob changed,
    for causal Problems the longest-first order too. The constraint drops those that do not fit a
    head dim."""
    out = [Variant(**{**WS_BASE, **knob}) for knob in WS_KNOBS]
    if causal:
        out.append(Variant(**{**WS_BASE, "order": "heaviest_first"}))
    return out


def _problem(shape: Shape):
    return dataclasses.replace(shape.problem("bfloat16"), family="backward")


def _inputs(shape: Shape, batch: int, seqlen: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(batch, h, seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
    q, k, v, dout = mk(shape.heads), mk(shape.kv_heads), mk(shape.kv_heads), mk(shape.heads)
    out, lse, *ref = reference_backward(q, k, v, dout, causal=shape.causal, scale=shape.head_dim**-0.5)
    return q, k, v, dout, out.bfloat16(), lse.float(), tuple(ref)


def _run(kernel, q, k, v, dout, out, lse, grads=None):
    """Launch once into the gradients `grads` (new ones if None), poisoned first; returns them and
    the launch."""
    grads = grads or [torch.empty_like(t) for t in (q, k, v)]
    for g in grads:
        g.fill_(float("nan"))
    args = BackwardArgs(q, k, v, out, dout, lse, None, *grads, q.shape[-1] ** -0.5)
    call = lambda: kernel.launch(args)
    call()
    return grads, call


def _compile_and_check(args: tuple[Shape, str]) -> str | None:
    """Build the Variant for the shape's Problem and check it against float64 at a ragged GQA size
    with the same features; None when right, else why not."""
    shape, variant_json = args
    try:
        gpu = cuda_gpu(0)
        kernel = base.build(backward.FAMILY, Variant.from_json(variant_json), _problem(shape), gpu)
        group = shape.heads // shape.kv_heads
        small = Shape(2, 2 * group, 2, 333, shape.head_dim, shape.causal)
        q, k, v, dout, out, lse, ref = _inputs(small, 2, 333, seed=1)
        grads, _ = _run(kernel, q, k, v, dout, out, lse)
        err = grads_error(grads, ref)
        if err < TOLERANCE["bfloat16"]:
            return None
        return f"wrong at 2x{2 * group}x333: relative error {err:.2e}"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def label(v: dict) -> str:
    """A Variant in a few words."""
    if v["schedule"] == "ws":
        text = f"ws {v['dkdv_block_m']}x{v['dkdv_block_n']} w{v['num_warps']} s{v['num_stages']}"
        text += f" dq-{v['dq_write']}"
        extras = [
            name
            for name, on in (
                ("deterministic", v["deterministic"]),
                (f"producer{v['producer_regs']}", v["producer_regs"] != 24),
                ("kv-regs", v["kv_regs"]),
                ("heaviest", v["order"] == "heaviest_first"),
                ("split-tail", v["split_tail"]),
                ("split-warpgroups", v["split_warpgroups"]),
                ("paired", v["paired_walk"]),
            )
            if on
        ]
        return text + "".join(" " + e for e in extras)
    text = f"{v['load']} dkdv {v['dkdv_block_m']}x{v['dkdv_block_n']} w{v['num_warps']} s{v['num_stages']}"
    if v["dq_mode"] in ("separate", "concurrent"):
        text += f" dq {v['dq_block_m']}x{v['dq_block_n']}"
    if v["dq_mode"] == "separate":
        text += f" w{v['dq_num_warps']} s{v['dq_num_stages']}"
    else:
        text += f" {v['dq_mode']}"
    extras = [
        name
        for name, on in (
            ("fused-delta", v["fuse_delta"]),
            ("persistent", v["persistent"]),
            ("heaviest", v["order"] == "heaviest_first"),
        )
        if on
    ]
    return text + "".join(" " + e for e in extras)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ap.add_argument("--peers", default=",".join(PEERS), help="of sdpa-cudnn, -flash, -efficient, flex")
    ap.add_argument("--schedules", default="loops,ws", help="whose candidates to time: loops, ws or both")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--hang-s", type=float, default=120.0, help="give up on a kernel that runs this long")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    seqlens = [int(x) for x in args.seqlens.split(",")]
    dims = [int(x) for x in args.head_dims.split(",")]
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    gpu = cuda_gpu(0)
    provenance = {
        "family": "backward",
        "gpu": gpu.name,
        "triton": gpu.triton_version,
        "torch": gpu.torch_version,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    groups = prefill_suite(seqlens[:1], dims, causal)
    jobs = []
    for shape in groups:
        problem = _problem(shape)
        defaults = [backward.FAMILY.default_variant(_problem(_sized(shape, n)), gpu) for n in seqlens]
        schedules = args.schedules.split(",")
        tried = candidates(shape.head_dim, shape.causal) if "loops" in schedules else []
        tried += ws_candidates(shape.causal) if "ws" in schedules else []
        loops = [backward.loops_default(_problem(_sized(shape, n)), gpu) for n in seqlens]
        for v in dict.fromkeys(defaults + loops + tried):
            if backward.FAMILY.constraint(v, problem, gpu) is None:
                jobs.append((shape, v.to_json()))
    print(f"{len(jobs)} kernels to build and check", flush=True)
    checked = check_in_workers(_compile_and_check, jobs, args.workers, args.hang_s)
    results: list[dict] = []

    def write() -> None:
        if args.output:
            with open(args.output, "w") as fh:
                json.dump({**provenance, "results": results}, fh, indent=1)

    for (shape0, vj), note in zip(jobs, checked, strict=True):
        if note:
            results.append({"shape": shape0.__dict__, "variant": json.loads(vj), "ms": None, "note": note})
            print("FAILED", label(json.loads(vj)), shape0.head_dim, shape0.causal, note, flush=True)
    for shape0 in groups:
        for n in seqlens:
            shape = _sized(shape0, n)
            problem = _problem(shape)
            flops = 2.5 * shape.flops()
            q, k, v, dout, out, lse, ref = _inputs(shape, shape.batch, n, seed=0)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            timed = []
            for name in args.peers.split(","):
                if name == "flex":
                    make = functools.partial(peers.flex, shape.causal, tuple(q.shape), q.device)
                else:
                    make = functools.partial(peers.sdpa, name, shape.causal)
                rec = {"shape": shape.__dict__, "impl": name, "ms": None, "tflops": None}
                try:
                    call = backward_peer(make, q, k, v, dout)
                    rec["err"] = grads_error(call(), ref)
                    if rec["err"] < TOLERANCE["bfloat16"]:
                        timed.append((rec, call))
                except RuntimeError as exc:
                    rec["note"] = str(exc)[:200]
                results.append(rec)
            for (s0, vj), note in zip(jobs, checked, strict=True):
                if s0 != shape0 or note:
                    continue
                variant = Variant.from_json(vj)
                rec = {"shape": shape.__dict__, "variant": variant.as_dict(), "ms": None, "tflops": None}
                rec["note"] = ""
                if backward.FAMILY.constraint(variant, problem, gpu) is not None:
                    continue
                faulthandler.dump_traceback_later(args.hang_s, exit=True)
                try:
                    kernel = base.build(backward.FAMILY, variant, problem, gpu)
                    _, call = _run(kernel, q, k, v, dout, out, lse, grads)
                    rec["err"] = grads_error(grads, ref)
                    if rec["err"] < TOLERANCE["bfloat16"]:
                        timed.append((rec, call))
                    else:
                        rec["note"] = f"wrong: relative error {rec['err']:.2e}"
                except Exception as exc:
                    rec["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                faulthandler.cancel_dump_traceback_later()
                results.append(rec)
            time_in_rounds(timed)
            for rec, _ in timed:
                rec["tflops"] = flops / rec["ms"] / 1e9
            write()
            del q, k, v, dout, out, lse, ref, grads, timed
            torch.cuda.empty_cache()
    write()
    print_table(results, groups, seqlens, gpu)


def print_table(results: list[dict], groups: list[Shape], seqlens: list[int], gpu) -> None:
    """Per (head dim, causal) and length: the peers, the default, and the best Variant."""
    for shape0 in groups:
        print(f"\nD={shape0.head_dim} causal={shape0.causal} (TFLOP/s, 2.5x forward FLOPs; ratio to cuDNN)")
        for n in seqlens:
            key = (shape0.head_dim, shape0.causal, n)
            rows = [
                r
                for r in results
                if (r["shape"]["head_dim"], r["shape"]["causal"], r["shape"]["seqlen"]) == key
                and r.get("tflops")
            ]
            peer = {r["impl"]: r["tflops"] for r in rows if "impl" in r}
            mine = sorted((r for r in rows if "variant" in r), key=lambda r: -r["tflops"])
            default = backward.FAMILY.default_variant(_problem(_sized(shape0, n)), gpu).as_dict()
            dflt = next((r["tflops"] for r in mine if r["variant"] == default), 0)
            line = f"  N={n:5d} " + " ".join(f"{k} {val:4.0f}" for k, val in peer.items())
            loops = backward.loops_default(_problem(_sized(shape0, n)), gpu).as_dict()
            looped = next((r["tflops"] for r in mine if r["variant"] == loops), 0)
            line += f" | default {dflt:4.0f} loops {looped:4.0f}"
            if mine:
                cudnn = peer.get("sdpa-cudnn")
                ratio = mine[0]["tflops"] / cudnn if cudnn else float("nan")
                line += f" | best {mine[0]['tflops']:4.0f} ({ratio:.2f}) {label(mine[0]['variant'])}"
            print(line, flush=True)
            for r in mine[:6]:
                print(f"      {r['tflops']:5.0f}  {label(r['variant'])}")


if __name__ == "__main__":
    sys.exit(main())
