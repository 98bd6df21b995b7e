"""The Hopper forward's techniques on and off at the suite's lengths: per (head dim, mask, length),
the family's default Variant rendered from this tree's templates and, with `--old-templates`, from
other copies of them (an older commit: `git archive REV templates | tar -x -C old`; with
`--old-defaults`, each shape's Variant as that commit chose it), beside the
default made persistent with the dynamic scheduler (and the other tiles a dynamic scheduler
might want), each with one and with two query slots per consumer, and cuDNN. `--candidates
default` keeps the default alone; each `--also` adds the default with some knobs changed.

Each Variant is built and checked against float64 at a ragged size (GQA, poisoned output) in
worker processes first (prefill_defaults.py's check), then on sampled rows of each shape, and the
shape's candidates and cuDNN are timed together in rounds, each in its own order (sweep.py).

    python benchmarks/prefill_ab.py --old-templates old/templates --seqlens 512,1024,4096 -o ab.json
    python benchmarks/prefill_ab.py --candidates default --old-templates recip=recip/templates \
        --old-templates slot=slot/templates -o ab.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
from backward_ab import _templates
from prefill_defaults import (
    PEERS,
    _check_peers,
    _compile_and_check,
    _inputs,
    check_in_workers,
    checked_launch,
)
from sweep import ROUNDS, time_in_rounds

from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.measure.suites import Shape, prefill_suite
from tunegen.tuning.rounds import balanced_rounds

OLD = "default (old templates)"


def candidates(problem, gpu) -> dict[str, prefill.PrefillVariant]:
    """Named Variants for one Problem: its default, and the dynamic scheduler over the default's
    tiles and over the tiles the defaults use elsewhere (causal: heaviest tiles first within
    L2-sized groups of heads), with one query slot per consumer and with two."""
    default = prefill.FAMILY.default_variant(problem, gpu)
    two = prefill.PrefillVariant(
        schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True, pingpong=True
    )
    tiles = {
        "two": two,
        "pair": two.replace(block_n=64, consumers=1, pingpong=False, ctas_per_sm=2),
    }
    if problem.head_dim == 64:
        tiles["three"] = two.replace(consumers=3, overlap=False)
        tiles["pair128"] = tiles["pair"].replace(block_m=128)
    if problem.causal and problem.seqlen_q <= 2048:  # short causal tiles: fewer keys a step, or more
        tiles["two bn64"] = two.replace(block_n=64)
        tiles["pair bn128"] = tiles["pair"].replace(block_n=128)
    if default.schedule == "ws":
        tiles = {"default": default, **tiles}
    order, rev = ("grouped", True) if problem.causal else ("m_inner", False)
    out = {"default": default}
    for name, tile in tiles.items():
        for q_stages in (1, 2):
            label = f"dynamic {name}" + (" q2" if q_stages == 2 else "")
            scheduled = {"persistent": True, "dynamic": True, "order": order, "reverse_m": rev}
            out[label] = tile.replace(q_stages=q_stages, **scheduled)
    unique = {}
    for name, variant in out.items():  # a Variant under its first name only
        if variant not in unique.values() and prefill.FAMILY.constraint(variant, problem, gpu) is None:
            unique[name] = variant
    return unique


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: as many as query heads)")
    ap.add_argument(
        "--old-templates",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="a folder of templates to render the defaults from too (repeatable; LABEL names its column)",
    )
    ap.add_argument(
        "--old-defaults",
        metavar="JSON_FILE",
        help="the Variants the old templates' copies render, per shape, where the old tree's defaults "
        'differed ([{"shape": Shape fields, "variant": Variant fields}], from that tree\'s '
        "default_variant); shapes not listed render this tree's default",
    )
    ap.add_argument(
        "--candidates",
        default="all",
        choices=["all", "default"],
        help="'default': time the default alone (beside its old-templates copy and the peers)",
    )
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="JSON",
        help="the default with these knobs changed, as another candidate (e.g. '{\"mask_branch\": true}')",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help="timing rounds per shape (default: with --candidates default, `balanced_rounds` of the calls "
        "timed, each call as often early as late and behind each other; else sweep.py's)",
    )
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--hang-s", type=float, default=120.0)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    seqlens, dims = [int(n) for n in args.seqlens.split(",")], [int(d) for d in args.head_dims.split(",")]
    shapes = prefill_suite(seqlens, dims, causal, kv_heads=args.kv_heads)
    gpu = cuda_gpu(0)
    old_defaults = _old_defaults(args.old_defaults)
    named = {shape: candidates(shape.problem("bfloat16"), gpu) for shape in shapes}
    if args.candidates == "default":
        named = {shape: {"default": variants["default"]} for shape, variants in named.items()}
    for changes in map(json.loads, args.also):
        label = "default " + " ".join(f"{k}={v}" for k, v in changes.items())
        for shape, variants in named.items():
            if variants["default"].schedule != "ws":
                continue
            try:
                variant = variants["default"].replace(**changes)
            except ValueError:  # knobs this default's form cannot take (pingpong with one consumer)
                continue
            admitted = prefill.FAMILY.constraint(variant, shape.problem("bfloat16"), gpu) is None
            if admitted and variant not in variants.values():
                variants[label] = variant
    jobs = sorted({(_bucket(shape), v.to_json()) for shape in shapes for v in named[shape].values()}, key=str)
    print(f"{len(jobs)} kernels to build and check", flush=True)
    checked = check_in_workers(_compile_and_check, jobs, args.workers, args.hang_s)
    notes = dict(zip(jobs, checked, strict=True))
    results: list[dict] = []
    provenance = {
        "gpu": gpu.name,
        "triton": gpu.triton_version,
        "torch": gpu.torch_version,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for shape in shapes:
        problem = shape.problem("bfloat16")
        q, k, v, gen = _inputs(shape)
        out = torch.empty_like(q)
        timed = _check_peers(shape, q, k, v, gen, results)
        kernels = {}
        for name, variant in named[shape].items():
            note = notes[(_bucket(shape), variant.to_json())]
            rec = _record(shape, name, variant, note)
            results.append(rec)
            if note is None:
                kernels[name] = (rec, base.build(prefill.FAMILY, variant, problem, gpu))
        for label, folder in map(_labelled, args.old_templates):
            default = old_defaults.get(shape, named[shape]["default"])
            with _templates(pathlib.Path(folder)):
                old = base.build(prefill.FAMILY, default, problem, gpu)
            rec = _record(shape, label, default, None)
            results.append(rec)
            kernels[label] = (rec, old)
        for rec, kernel in kernels.values():
            try:
                checked_launch(kernel, rec, shape, (q, k, v, out, gen), timed)
            except Exception as exc:  # a candidate that fails at this shape is a result, not the run's end
                rec["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rounds = max(1, balanced_rounds(len(timed))) if args.candidates == "default" else ROUNDS
        time_in_rounds(timed, rounds=args.rounds if args.rounds is not None else rounds)
        for rec, _ in timed:
            rec["tflops"] = shape.flops() / rec["ms"] / 1e9
        _print_shape(shape, [rec for rec, _ in timed])
        if args.output:
            pathlib.Path(args.output).write_text(json.dumps({**provenance, "results": results}, indent=1))
        del q, k, v, out, timed, kernels
        torch.cuda.empty_cache()


def _old_defaults(path: str | None) -> dict[Shape, prefill.PrefillVariant]:
    """--old-defaults' file as {shape: Variant}."""
    if path is None:
        return {}
    entries = json.loads(pathlib.Path(path).read_text())
    return {Shape(**e["shape"]): prefill.PrefillVariant.from_json(e["variant"]) for e in entries}


def _labelled(value: str) -> tuple[str, str]:
    """An --old-templates value: (its label, default OLD; its folder)."""
    label, _, folder = value.rpartition("=")
    return (f"default ({label} templates)" if label else OLD), folder


def _record(shape: Shape, impl: str, variant: prefill.PrefillVariant, note: str | None) -> dict:
    return {"shape": shape.__dict__, "impl": impl, "variant": variant.as_dict(), "ms": None, "note": note}


def _bucket(shape: Shape) -> Shape:
    """The shape the worker checks a Variant at: its features only (the check's sizes are its own)."""
    return Shape(1, shape.heads, shape.kv_heads, 4096, shape.head_dim, shape.causal)


def _print_shape(shape: Shape, recs: list[dict]) -> None:
    cudnn = next((r["tflops"] for r in recs if r["impl"] == "sdpa-cudnn"), None)
    mine = sorted((r for r in recs if r["impl"] not in PEERS), key=lambda r: -r["tflops"])
    mask = "causal" if shape.causal else "full  "
    line = f"D={shape.head_dim} {mask} N={shape.seqlen:5d} cudnn {cudnn or 0:4.0f}"
    for r in mine[:4]:
        line += f" | {r['impl']} {r['tflops']:4.0f} ({r['tflops'] / cudnn if cudnn else 0:.2f})"
    old = next((r["tflops"] for r in recs if r["impl"] == OLD), None)
    new = next((r["tflops"] for r in recs if r["impl"] == "default"), None)
    if old and new:
        line += f" || default new/old {new / old:.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
