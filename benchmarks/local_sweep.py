"""Sweep Hopper-schedule Variants of one of `local_features.py`'s forward cases (a window, chunk,
cap or sinks): each candidate is the case's default with some knobs changed, built and checked
against float64 at a ragged size with the same features in worker processes, then checked on the
case's own inputs (sampled rows, float64) and timed together with the default and FlexAttention
in interleaved rounds (sweep.py), as `tunegen bench` times.

    python3 benchmarks/local_sweep.py --case "window 4096" -o OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import torch
from local_features import prefill_cases
from prefill_defaults import check_in_workers
from sweep import time_in_rounds

from tunegen.calls.local import Local
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.reference import TOLERANCE, attention_reference
from tunegen.measure.bench import prefill_calls, prefill_inputs
from tunegen.measure.suites import Shape

# Knob changes from the default, one candidate each (those outside the constraint are skipped).
CHANGES = [
    {},
    {"mask_branch": False},
    {"mask_branch": True},
    {"mask_branch": False, "order": "head_inner", "reverse_m": False, "l2_share": 2},
    {"mask_branch": False, "q_stages": 1},
    {"l2_share": 4},
    {"l2_share": 8},
    {"reverse_m": False},
    {"order": "m_inner", "reverse_m": False, "l2_share": 2},
    {"order": "head_inner", "reverse_m": False, "l2_share": 2},
    {"q_stages": 1},
    {"num_stages": 3},
    {"num_stages": 3, "q_stages": 1},
    {"block_n": 64},
    {"block_n": 64, "num_stages": 3},
    {"overlap": False},
    {"overlap": False, "pingpong": True},
    {"overlap": False, "pingpong": True, "block_n": 64, "num_stages": 3},
    {"dynamic": False},
    {"persistent": False, "dynamic": False, "q_stages": 1},
    {"consumers": 3, "overlap": False, "pingpong": True, "block_n": 64},
    {"consumers": 3, "overlap": False, "pingpong": True, "block_n": 64, "q_stages": 1},
    {"consumers": 1, "block_n": 64, "ctas_per_sm": 2, "block_m": 128, "num_stages": 3},
    {"consumers": 1, "block_n": 64, "ctas_per_sm": 2, "overlap": False},
    {"producer_regs": 40},
]


def _local(shape: Shape, sinks: torch.Tensor | None) -> Local:
    return Local(shape.window_left, shape.window_right, shape.attention_chunk, shape.softcap, sinks)


def _launch(variant: prefill.PrefillVariant, shape: Shape, q, k, v, sinks):
    """A launch of `variant` on q, k, v with the shape's features, into a fresh output."""
    call = PrefillCall(q, k, v, shape.causal, shape.head_dim**-0.5, False, local=_local(shape, sinks))
    out, lse = call.outputs()
    kernel = base.build(prefill.FAMILY, variant, call.problem(out), cuda_gpu(q.device.index or 0))
    args = call.args(out, lse)
    return out, functools.partial(kernel.launch, args)


def _compile_and_check(job: tuple[Shape, str]) -> str | None:
    """Build the Variant, then check it against float64 at 2 x 333 rows with the case's features and
    head ratio; None when right, else why not."""
    shape, variant_json = job
    try:
        gen = torch.Generator().manual_seed(1)
        group = shape.heads // shape.kv_heads
        mk = lambda h: torch.randn(2, h, 333, shape.head_dim, generator=gen).cuda().bfloat16()
        q, k, v = mk(2 * group), mk(2), mk(2)
        sinks = torch.randn(2 * group, generator=gen).cuda() if shape.sinks else None
        out, launch = _launch(prefill.PrefillVariant.from_json(variant_json), shape, q, k, v, sinks)
        out.fill_(float("nan"))
        launch()
        local = _local(shape, sinks).reference_args()
        ref, _ = attention_reference(q, k, v, causal=shape.causal, scale=shape.head_dim**-0.5, **local)
        err = float((out.double() - ref).norm() / ref.norm())
        return None if err < TOLERANCE["bfloat16"] else f"wrong at 2x333: relative error {err:.2e}"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--case", default="window 4096", help="a substring of one of local_features.py's forward cases"
    )
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    case = next(c for c in prefill_cases() if args.case in c.name)
    shape = case.shape
    gpu = cuda_gpu(0)
    default = prefill.FAMILY.default_variant(shape.problem("bfloat16"), gpu)
    candidates = []
    for change in CHANGES:
        try:
            variant = default.replace(**change)
        except ValueError:
            continue
        problem = shape.problem("bfloat16")
        if variant not in candidates and prefill.FAMILY.constraint(variant, problem, gpu) is None:
            candidates.append(variant)
    checks = check_in_workers(
        _compile_and_check, [(shape, c.to_json()) for c in candidates], args.workers, 120.0
    )
    inputs = prefill_inputs(shape, torch.bfloat16, torch.device("cuda"))
    q, k, v, sinks, _ = inputs
    flex_call, flex_check, bound = prefill_calls(shape, ["flex"], inputs)["flex"]
    records, timed = [], []
    for variant, why in zip(candidates, checks, strict=True):
        rec = {"variant": variant.to_json(), "default": variant == default, "ms": None, "note": why}
        records.append(rec)
        if why is None:
            out, launch = _launch(variant, shape, q, k, v, sinks)
            launch()
            rec["err"] = flex_check(out)
            if rec["err"] < bound:
                timed.append((rec, launch))
            else:
                rec["note"] = f"wrong on the case's inputs: {rec['err']:.2e}"
    flex = {"impl": "flex", "ms": None}
    records.append(flex)
    timed.append((flex, flex_call))
    time_in_rounds(timed)
    base_ms = next(r["ms"] for r in records if r.get("default"))
    for r in records:
        if r.get("ms"):
            r["us"] = r["ms"] * 1e3
            r["vs_default"] = r["ms"] / base_ms
    provenance = {
        "case": case.name,
        "gpu": gpu.name,
        "triton": gpu.triton_version,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    with open(args.output, "w") as f:
        json.dump({"provenance": provenance, "records": records}, f, indent=1)
    print(provenance)
    for r in sorted(records, key=lambda r: r.get("ms") or 1e9):
        us = f"{r['us']:.0f}" if r.get("us") else "-"
        print(f"{us:>7} {r.get('vs_default', 0):.3f} {r.get('impl') or r['variant']} {r.get('note') or ''}")


if __name__ == "__main__":
    main()
