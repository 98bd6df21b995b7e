"""Pick the default FP8 prefill Variants for Hopper: verify and time the warp-specialized schedule's
FP8 Variants and FlashAttention-2's FP8 loop on e4m3 inputs from `tunegen.quantize_fp8` (rotated,
per-block scales, V K-major), beside tunegen's bf16 default and cuDNN bf16 on the same inputs, and
the quantize step alone, in one run.

Each Variant is built and checked against float64 on the dequantized inputs at a ragged size (GQA,
lengths no tile divides, outputs poisoned) in parallel worker processes first; then each is checked
again on sampled rows of each shape, and the shape's Variants, the bf16 implementations and the
quantize step are timed together in interleaved rounds (sweep.py). Results are written after every
shape. `--candidates default` times each shape's default Variant alone; `--old-templates` adds
that default rendered from other copies of the templates (an older commit: `git archive REV
templates | tar -x -C old`), checked on the shape's sampled rows like the rest.

    python benchmarks/fp8_defaults.py --seqlens 2048,16384 -o fp8_defaults_h100.json
    python benchmarks/fp8_defaults.py --candidates default --old-templates head=old/templates
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import pathlib

import torch
from backward_ab import _templates
from prefill_ab import _labelled
from prefill_candidates import WS, ws_variant
from prefill_defaults import _label, _sized, check_in_workers
from sweep import time_in_rounds

import tunegen
from tunegen.kernels import fp8, peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.reference import TOLERANCE, attention_reference, sampled_error
from tunegen.measure.suites import prefill_suite

FP8_TOLERANCE = 3e-2  # P rounded to e4m3 before the second product (tests/test_fp8.py)


def candidates(head_dim: int, causal: bool) -> list[prefill.PrefillVariant]:
    """The "ws" tile shapes of prefill_defaults.py that fit FP8's budget, each persistent or not (and
    for causal, heaviest blocks first in L2-sized groups of heads), deeper rings for FP8's half-size
    K and V tiles, and FlashAttention-2's FP8 loop as the family's default has it."""
    # (order, reverse_m, persistent): causal tries heaviest-first groups either way, and FA2's order.
    orders = [("grouped", True, False), ("grouped", True, True), ("m_inner", False, False)]
    if not causal:
        orders = [("m_inner", False, False), ("m_inner", False, True)]
    shapes = [*WS[head_dim], (64, 128, 3, 2, False, True, 1), (64, 128, 4, 2, False, True, 1)]
    out = [
        prefill.PrefillVariant(block_m=128, block_n=128, num_warps=8, num_stages=3, load="desc", v_trans=True)
    ]
    for tiles, (order, rev, persistent) in itertools.product(shapes, orders):
        out.append(ws_variant(tiles, order, rev, persistent))
    return out


def _problem(shape):
    return dataclasses.replace(shape.problem("bfloat16"), fp8=True)


def _args(x: fp8.Fp8Inputs, out: torch.Tensor, scale: float) -> PrefillArgs:
    """The prefill kernel's launch on quantized inputs `x`, writing `out` and no log-sum-exp."""
    descales = {"q_descale": x.q_descale, "k_descale": x.k_descale, "v_descale": x.v_descale}
    return PrefillArgs(x.q, x.k, x.v, out, None, scale, **descales)


def _bf16(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
    return mk(shape.heads), mk(shape.kv_heads), mk(shape.kv_heads), gen


def _compile_and_check(args) -> str | None:
    """Build the FP8 Variant and check it against float64 at 2 x 333 tokens with the shape's
    features; None when right, else why not."""
    shape, variant_json = args
    variant = prefill.PrefillVariant.from_json(variant_json)
    try:
        kernel = base.build(prefill.FAMILY, variant, _problem(shape), cuda_gpu(0))
        gen = torch.Generator().manual_seed(1)
        group = shape.heads // shape.kv_heads
        mk = lambda h: torch.randn(2, h, 333, shape.head_dim, generator=gen).cuda().bfloat16()
        x = tunegen.quantize_fp8(mk(2 * group), mk(2), mk(2))
        out = torch.full(x.q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel.launch(_args(x, out, 0.3))
        values = [fp8.dequantize(t, s) for t, s in zip(x[:3], x[3:], strict=True)]
        ref, _ = attention_reference(*values, causal=shape.causal, scale=0.3)
        err = float((out.double() - ref).norm() / ref.norm()) if not out.isnan().any() else float("nan")
        return None if err < FP8_TOLERANCE else f"wrong at 2x{2 * group}x333: relative error {err:.2e}"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--hang-s", type=float, default=120.0)
    ap.add_argument("--candidates", default="all", choices=["all", "default"])
    ap.add_argument(
        "--old-templates",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="a folder of templates to render each shape's default from too (repeatable)",
    )
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    seqlens = [int(x) for x in args.seqlens.split(",")]
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    gpu = cuda_gpu(0)
    document = {
        "gpu": gpu.name,
        "triton": gpu.triton_version,
        "torch": gpu.torch_version,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": [],
    }
    groups = prefill_suite(seqlens[:1], (args.head_dim,), causal)
    jobs = [
        (shape, v.to_json())
        for shape in groups
        for v in dict.fromkeys(
            [prefill.FAMILY.default_variant(_problem(_sized(shape, n)), gpu) for n in seqlens]
            + (candidates(shape.head_dim, shape.causal) if args.candidates == "all" else [])
        )
        if prefill.FAMILY.constraint(v, _problem(shape), gpu) is None
    ]
    print(f"{len(jobs)} kernels to build and check", flush=True)
    checked = check_in_workers(_compile_and_check, jobs, args.workers, args.hang_s)
    results = document["results"]

    def write() -> None:
        if args.output:
            with open(args.output, "w") as fh:
                json.dump(document, fh, indent=1)

    for (shape, vj), note in zip(jobs, checked, strict=True):
        if note:
            results.append({"shape": shape.__dict__, "variant": json.loads(vj), "ms": None, "note": note})
            print("FAILED", _label(json.loads(vj)), shape.causal, note, flush=True)
    for shape0 in groups:
        good = [
            json.loads(vj) for (s, vj), note in zip(jobs, checked, strict=True) if s == shape0 and not note
        ]
        for n in seqlens:
            shape = _sized(shape0, n)
            flops = shape.problem("bfloat16").flops()
            q, k, v, gen = _bf16(shape)
            x = tunegen.quantize_fp8(q, k, v)
            values = [fp8.dequantize(t, s, torch.float32) for t, s in zip(x[:3], x[3:], strict=True)]
            scale = shape.head_dim**-0.5
            row = {"shape": shape.__dict__}
            timed = []
            calls = {
                "quantize-fp8": (functools.partial(tunegen.quantize_fp8, q, k, v), None),
                "tunegen-bf16": (
                    functools.partial(tunegen.attention, q, k, v, causal=shape.causal),
                    (q, k, v),
                ),
                "sdpa-cudnn": (functools.partial(peers.sdpa("sdpa-cudnn", shape.causal), q, k, v), (q, k, v)),
            }
            for name, (fn, check) in calls.items():
                out = fn()
                if check is not None:
                    err = sampled_error(out, *check, causal=shape.causal, scale=scale, generator=gen)
                    assert err < TOLERANCE["bfloat16"], (name, err)
                results.append({**row, "impl": name, "ms": None, "tflops": None})
                timed.append((results[-1], fn))
            out = torch.empty(q.shape, device="cuda", dtype=torch.bfloat16)
            problem = _problem(shape)
            default = prefill.FAMILY.default_variant(problem, gpu)
            chosen = [prefill.PrefillVariant(**vd) for vd in good]
            if args.candidates == "default":
                chosen = [v for v in chosen if v == default]
            kernels = [(_label(v.as_dict()), v, base.build(prefill.FAMILY, v, problem, gpu)) for v in chosen]
            for label, folder in map(_labelled, args.old_templates):
                with _templates(pathlib.Path(folder)):
                    kernels.append((label, default, base.build(prefill.FAMILY, default, problem, gpu)))
            for label, variant, kernel in kernels:
                out.fill_(float("nan"))
                fn = functools.partial(kernel.launch, _args(x, out, scale))
                fn()
                err = sampled_error(out, *values, causal=shape.causal, scale=scale, generator=gen)
                vd = variant.as_dict()
                rec = {**row, "variant": vd, "label": label, "ms": None, "tflops": None, "error": err}
                results.append(rec)
                if err < FP8_TOLERANCE:
                    timed.append((rec, fn))
            time_in_rounds(timed)
            for rec, _ in timed:
                if rec.get("impl") != "quantize-fp8":  # the quantize step: no FLOPs of its own
                    rec["tflops"] = flops / rec["ms"] / 1e9
            del out, timed
            torch.cuda.empty_cache()
            write()
            mine = [r for r in results if r.get("shape") == shape.__dict__ and r.get("tflops")]
            base_tf = {r["impl"]: r["tflops"] for r in mine if "impl" in r}
            print(
                f"\nN={n} B={shape.batch} causal={shape.causal}: bf16 {base_tf.get('tunegen-bf16', 0):.0f} "
                f"cuDNN {base_tf.get('sdpa-cudnn', 0):.0f} quantize "
                f"{[r['ms'] for r in results if r.get('impl') == 'quantize-fp8'][-1] * 1e3:.0f} us",
                flush=True,
            )
            for r in sorted((r for r in mine if "label" in r), key=lambda r: -r["tflops"])[:8]:
                print(f"  {r['tflops']:6.0f}  {r['label']}", flush=True)
    write()


if __name__ == "__main__":
    main()
