"""The FP8 bench: FP8 prefill against bf16 on the same inputs (e4m3 inputs, and bf16 inputs with
the Hadamard rotation and quantize step timed in, and that step alone), the speedups of FP8 over
bf16 for prefill and for decode over an FP8 cache, and the one JSON file they are written to."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import tunegen
from tunegen.kernels import fp8, peers
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.reference import FP8_TOLERANCE, TOLERANCE, sampled_error
from tunegen.measure.rows import Row, check_then_time
from tunegen.measure.suites import Shape
from tunegen.tuning.timing import rate

# FP8 prefill against the inputs it was quantized from: e4m3 keeps 3 mantissa bits, so on N(0,1)
# inputs the error against float64 on the 16-bit values is about 5% (see benchmarks/fp8_accuracy.py).
FP8_INPUT_TOLERANCE = 0.1
# The quantized tensors themselves against the (rotated) inputs: half an e4m3 step is 2^-4 at most.
QUANTIZE_TOLERANCE = 0.04


def quantized_error(x: fp8.Fp8Inputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """The largest relative error (Frobenius) of the dequantized q, k, v against the inputs, q and k
    rotated as `tunegen.quantize_fp8` rotates them."""
    wanted = (fp8.rotate(q), fp8.rotate(k), v.float())
    errors = []
    for got, descale, want in zip(x[:3], x[3:], wanted, strict=True):
        back = fp8.dequantize(got, descale, torch.float32)
        errors.append(float((back - want).norm() / want.norm()))
    return max(errors)


def bench_fp8_prefill(
    shapes: Sequence[Shape],
    peer_names: Sequence[str] = ("sdpa-flash", "sdpa-cudnn"),
    *,
    seed: int = 0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """FP8 prefill against bf16, each checked then timed on the same inputs: tunegen bf16,
    "tunegen-fp8" (e4m3 inputs quantized beforehand, FA3-style: checked against float64 on the
    dequantized values), "tunegen-fp8-hadamard" (bf16 in, rotation and quantization included:
    checked against the bf16 inputs within FP8's bounds), "quantize-fp8" (that rotation and
    quantization alone, `tunegen.quantize_fp8`: milliseconds, no FLOPs) and the bf16 peers."""
    device = torch.device("cuda")
    gpu = cuda_gpu(torch.cuda.current_device())
    today = datetime.date.today().isoformat()
    rows: list[Row] = []
    for shape in shapes:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        q, k, v = (
            torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).to(
                device, torch.bfloat16
            )
            for h in (shape.heads, shape.kv_heads, shape.kv_heads)
        )
        x = tunegen.quantize_fp8(q, k, v)
        values = [fp8.dequantize(t, s, torch.float32) for t, s in zip(x[:3], x[3:], strict=True)]
        c, scale = shape.causal, shape.head_dim**-0.5
        check_bf16 = functools.partial(sampled_error, q=q, k=k, v=v, causal=c, scale=scale, generator=gen)
        check_fp8 = functools.partial(
            sampled_error, q=values[0], k=values[1], v=values[2], causal=c, scale=scale, generator=gen
        )
        attend = functools.partial(tunegen.attention, causal=c, strict=True)
        calls = {
            "tunegen-bf16": ("bf16", functools.partial(attend, q, k, v), check_bf16, TOLERANCE["bfloat16"]),
            "tunegen-fp8": ("fp8", functools.partial(attend, **x._asdict()), check_fp8, FP8_TOLERANCE),
            "tunegen-fp8-hadamard": (
                "fp8",
                functools.partial(attend, q, k, v, precision="fp8"),
                check_bf16,
                FP8_INPUT_TOLERANCE,
            ),
            "quantize-fp8": (
                "fp8",
                functools.partial(tunegen.quantize_fp8, q, k, v),
                functools.partial(quantized_error, q=q, k=k, v=v),
                QUANTIZE_TOLERANCE,
            ),
        }
        for name in peer_names:
            fn = peers.sdpa(name, c)
            calls[name] = ("bf16", functools.partial(fn, q, k, v), check_bf16, TOLERANCE["bfloat16"])
        results = check_then_time({name: spec[1:] for name, spec in calls.items()})
        for name, (dtype, *_) in calls.items():
            ms, err, note = results[name]
            counted = ms and name != "quantize-fp8"
            tflops = rate("TFLOP/s", shape.problem("bfloat16").flops(), ms) if counted else None
            row = Row.of(name, dtype, shape, ms, tflops, err, note, gpu.name, today)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        torch.cuda.empty_cache()
    return rows


def fp8_speedups(prefill_rows: Sequence[Row], decode_rows: Sequence[dict]) -> list[dict]:
    """FP8 against bf16, per shape: prefill "tunegen-fp8" over "tunegen-bf16" TFLOP/s, with the end
    to end ratio from bf16 inputs ("tunegen-fp8-hadamard" over "tunegen-bf16") and the quantize
    step's time as a share of the FP8 kernel's; and decode over an FP8 cache against a bf16 cache
    (the same Problem but fp8), tunegen's time over time."""
    out = []
    prefill: dict[tuple, dict[str, Row]] = {}
    for r in prefill_rows:
        prefill.setdefault((r.batch, r.heads, r.seqlen, r.head_dim, r.causal), {})[r.impl] = r
    for (batch, heads, seqlen, head_dim, causal), impls in prefill.items():
        fast, base = impls.get("tunegen-fp8"), impls.get("tunegen-bf16")
        whole, step = impls.get("tunegen-fp8-hadamard"), impls.get("quantize-fp8")
        out.append(
            {
                "family": "prefill",
                "shape": f"B{batch} H{heads} N{seqlen} D{head_dim}" + (" causal" if causal else ""),
                "fp8": fast.tflops if fast else None,
                "bf16": base.tflops if base else None,
                "unit": "TFLOP/s",
                "speedup": fast.tflops / base.tflops
                if fast and base and fast.tflops and base.tflops
                else None,
                "end_to_end": whole.tflops / base.tflops
                if whole and base and whole.tflops and base.tflops
                else None,
                "quantize_share": step.ms / fast.ms if step and fast and step.ms and fast.ms else None,
            }
        )
    decode: dict[tuple, dict[bool, dict]] = {}
    for r in decode_rows:
        if r["impl"] == "tunegen":
            decode.setdefault((r["batch"], r["seqlen_k"], r["page_size"]), {})[r["fp8"]] = r
    for (batch, length, page), by_fp8 in decode.items():
        fast, base = by_fp8.get(True), by_fp8.get(False)
        out.append(
            {
                "family": "decode",
                "shape": f"B{batch} cache {length}" + (f" paged {page}" if page else ""),
                "fp8": fast["ms"] if fast else None,
                "bf16": base["ms"] if base else None,
                "unit": "ms",
                "speedup": base["ms"] / fast["ms"] if fast and base and fast["ms"] and base["ms"] else None,
                "end_to_end": None,
                "quantize_share": None,
            }
        )
    return out


def write_fp8_results(
    prefill_rows: Sequence[Row], decode_rows: Sequence[dict], speedups: Sequence[dict], path: Path
) -> None:
    """Write the FP8 bench as one JSON document: {"prefill": rows, "decode": rows, "speedups": ...}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "prefill": [dataclasses.asdict(r) for r in prefill_rows],
        "decode": decode_rows,
        "speedups": speedups,
    }
    path.write_text(json.dumps(document, indent=1) + "\n")
