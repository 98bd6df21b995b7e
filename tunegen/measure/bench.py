"""Benchmarks: tunegen against its peers on the same GPU in the same run.

Every implementation's output is checked against float64 on sampled rows before it is timed,
so a row never reports the speed of a wrong answer.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

import tunegen
from tunegen.kernels import fp8, peers
from tunegen.kernels.gpu import cuda_gpu, gpu_of
from tunegen.kernels.problem import DTYPE_NAMES, Problem
from tunegen.kernels.reference import FP8_TOLERANCE, TOLERANCE, sampled_error, tolerance
from tunegen.tuning.timing import interleaved_ms, per_call_us, rate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The public call each family's Case gives the arguments of (see Case.public).
PUBLIC_CALLS = {"decode": tunegen.decode_attention}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark case in SDPA's (batch, heads, seqlen, head_dim) terms."""

    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def problem(self, dtype: str) -> Problem:
        return Problem(
            family="prefill",
            dtype=dtype,
            head_dim=self.head_dim,
            causal=self.causal,
            num_heads_q=self.heads,
            num_heads_kv=self.kv_heads,
            batch=self.batch,
            seqlen_q=self.seqlen,
            seqlen_k=self.seqlen,
        )


@dataclasses.dataclass
class Row:
    """One (shape, implementation) measurement."""

    impl: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    ms: float | None
    tflops: float | None
    rel_err: float | None
    note: str
    gpu: str
    triton: str
    torch: str
    date: str


def _row(
    impl: str,
    dtype: str,
    shape: Shape,
    ms: float | None,
    tflops: float | None,
    err: float | None,
    note: str,
    gpu: str,
    date: str,
) -> Row:
    return Row(
        impl,
        dtype,
        shape.batch,
        shape.heads,
        shape.kv_heads,
        shape.seqlen,
        shape.head_dim,
        shape.causal,
        ms,
        tflops,
        err,
        note,
        gpu,
        triton.__version__,
        torch.__version__,
        date,
    )


def prefill_suite(
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    tokens: int = 16384,
    hidden: int = 2048,
    kv_heads: int | None = None,
) -> list[Shape]:
    """The FlashAttention papers' suite: `tokens` per batch (B = tokens / N), `hidden` = H · D."""
    shapes = []
    for d in head_dims:
        for c in causal:
            for n in seqlens:
                heads = hidden // d
                shapes.append(Shape(max(1, tokens // n), heads, kv_heads or heads, n, d, c))
    return shapes


def _implementations(names: Iterable[str], shape: Shape, device: torch.device) -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    for name in names:
        if name == "tunegen":
            impls[name] = lambda q, k, v, c=shape.causal: tunegen.attention(q, k, v, causal=c, strict=True)
        elif name == "tunegen-default":
            impls[name] = _default_variant(shape.causal)
        elif name == "flex":
            impls[name] = peers.flex(
                shape.causal, (shape.batch, shape.heads, shape.seqlen, shape.head_dim), device
            )
        elif name in peers.SDPA_BACKENDS:
            impls[name] = peers.sdpa(name, shape.causal)
        else:
            raise ValueError(
                f"impl: expected tunegen, tunegen-default or one of {peers.available()}, got {name!r}"
            )
    return impls


def _default_variant(causal: bool) -> Callable:
    """The prefill family's default Variant for the inputs' Problem, winners ignored: beside
    `tunegen`, it shows what tuning gained. Built on the first call, which is the untimed check."""
    from tunegen.kernels.families import base, get

    built: list[base.Kernel] = []

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not built:
            family, gpu = get("prefill"), gpu_of(q.device)
            problem = Problem(**tunegen.explain(q, k, v, causal=causal)["problem"])
            built.append(base.build(family, family.default_variant(problem, gpu), problem, gpu))
        out = torch.empty_like(q)
        built[0].launch(q, k, v, out, None, q.shape[-1] ** -0.5)
        return out

    return call


def check_then_time(
    calls: dict[str, tuple[Callable[[], Any], Callable[[Any], float], float]],
) -> dict[str, tuple[float | None, float | None, str]]:
    """Run each call once and check its error against float64 within its bound; then time the
    calls that passed together, in rotated rounds (`interleaved_ms`). Returns, per name, (median
    ms, relative error, note); a refusal or a wrong answer is the note."""
    results: dict[str, tuple[float | None, float | None, str]] = {}
    passed = {}
    for name, (call, error_of, bound) in calls.items():
        try:
            out = call()
            torch.cuda.synchronize()
            err = error_of(out)
        except Exception as exc:  # a peer refusing a shape is a result, not a crash
            first = str(exc).splitlines()[0][:120] if str(exc) else ""
            results[name] = (None, None, f"unsupported: {type(exc).__name__}: {first}")
            continue
        if not err <= bound:
            results[name] = (None, err, f"wrong: relative error {err:.2e}")
            continue
        results[name] = (None, err, "")
        passed[name] = call
    for name, ms in interleaved_ms(passed).items():
        results[name] = (ms, results[name][1], "")
    return {name: results[name] for name in calls}


def _fits_math(shape: Shape, budget_bytes: float) -> bool:
    return shape.batch * shape.heads * shape.seqlen**2 * 6 < budget_bytes


def bench_prefill(
    shapes: Sequence[Shape],
    impls: Sequence[str],
    *,
    dtype: str = "bf16",
    seed: int = 0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Check then time each implementation on each shape; failures become rows with a note."""
    device = torch.device("cuda")
    torch_dtype = DTYPES[dtype]
    gpu = cuda_gpu(torch.cuda.current_device())
    today = datetime.date.today().isoformat()
    free, _ = torch.cuda.mem_get_info()
    rows: list[Row] = []
    for shape in shapes:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        q = torch.randn(shape.batch, shape.heads, shape.seqlen, shape.head_dim, generator=gen).to(
            device, torch_dtype
        )
        k = torch.randn(shape.batch, shape.kv_heads, shape.seqlen, shape.head_dim, generator=gen).to(
            device, torch_dtype
        )
        v = torch.randn(shape.batch, shape.kv_heads, shape.seqlen, shape.head_dim, generator=gen).to(
            device, torch_dtype
        )
        scale = shape.head_dim**-0.5
        flops = shape.problem(dtype).flops()
        check = functools.partial(
            sampled_error, q=q, k=k, v=v, causal=shape.causal, scale=scale, generator=gen
        )
        calls, results = {}, {}
        for name, fn in _implementations(impls, shape, device).items():
            if name == "sdpa-math" and not _fits_math(shape, free * 0.5):
                results[name] = (None, None, "skipped: the N x N matrix does not fit")
            else:
                calls[name] = (functools.partial(fn, q, k, v), check, TOLERANCE[DTYPE_NAMES[torch_dtype]])
        results.update(check_then_time(calls))
        for name in impls:
            ms, err, note = results[name]
            tflops = rate("TFLOP/s", flops, ms) if ms else None
            row = _row(name, dtype, shape, ms, tflops, err, note, gpu.name, today)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def write_rows(rows: Sequence[Row | dict], path: Path) -> None:
    """Write rows as CSV or JSON, by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in rows]
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]) if records else [])
        writer.writeheader()
        writer.writerows(records)


def decode_suite(
    batches: Sequence[int] = (1, 16, 64),
    cache_lengths: Sequence[int] = (4096, 32768),
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_sizes: Sequence[int] = (0, 64),
    dtype: str = "bfloat16",
) -> list[Problem]:
    """One-token decode Problems: each batch, cache length and layout (page size 0: contiguous)."""
    return [
        Problem(
            family="decode",
            dtype=dtype,
            head_dim=head_dim,
            causal=True,
            num_heads_q=heads,
            num_heads_kv=kv_heads,
            batch=b,
            seqlen_q=1,
            seqlen_k=n,
            paged=page > 0,
            page_size=page,
        )
        for b in batches
        for n in cache_lengths
        for page in page_sizes
    ]


def bench_cases(
    problems: Sequence[Problem], *, seed: int = 0, on_row: Callable[[dict], None] | None = None
) -> list[dict]:
    """Check then time tunegen's dispatched kernel and every peer the family's case offers, per
    Problem, in the family's unit (GB/s for decode)."""
    from tunegen.kernels import dispatch
    from tunegen.kernels.families import get

    device = torch.device("cuda")
    gpu = cuda_gpu(torch.cuda.current_device())
    rows = []
    for problem in problems:
        family = get(problem.family)
        unit, work = family.measure(problem)
        kernel = dispatch.kernel_for(problem, gpu)
        case = family.case(problem, kernel, device, seed)
        bound = tolerance(problem)
        calls = {"tunegen": (case.launch, lambda _, case=case: case.error(), bound)}
        calls.update({name: (call, case.peer_error, bound) for name, call in case.peers.items()})
        checked = check_then_time(calls)
        calls_per_call = {}
        if case.public is not None:
            passed = [name for name, (ms, _, _) in checked.items() if ms is not None]
            calls_per_call = eager_and_graph(problem, kernel, case, passed, device, seed)
        for name, (ms, err, note) in checked.items():
            row = {
                "impl": name,
                **problem.as_dict(),
                "unit": unit,
                "ms": None,
                "rate": None,
                "rel_err": None,
                "note": "",
                "gpu": gpu.name,
                "triton": triton.__version__,
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
            }
            row["ms"], row["rel_err"], row["note"] = ms, err, note
            row["rate"] = rate(unit, work, ms) if ms else None
            if case.public is not None:
                eager_us, graph_us = calls_per_call.get(name, (None, None))
                row["eager_us"], row["graph_us"] = eager_us, graph_us
                row["eager_rate"] = rate(unit, work, eager_us / 1e3) if eager_us else None
                row["graph_rate"] = rate(unit, work, graph_us / 1e3) if graph_us else None
            rows.append(row)
            if on_row is not None:
                on_row(row)
        torch.cuda.empty_cache()
    return rows


def eager_and_graph(
    problem: Problem, kernel: Any, case: Any, names: Sequence[str], device: torch.device, seed: int
) -> dict[str, tuple[float | None, float | None]]:
    """Per-call microseconds of each implementation called as a model calls it: "tunegen" is the
    public call, the others the peers `names`; eager (back to back, the host's cost included) and
    replayed from a CUDA graph. Calls rotate over enough input sets to hold twice the L2 cache,
    so that no call reads its inputs from the one before's cache lines."""
    from tunegen.kernels.families import get

    family = get(problem.family)
    _, work = family.measure(problem)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    sets = max(1, min(8, math.ceil(2 * l2 / work)))
    cases = [case] + [family.case(problem, kernel, device, seed + i) for i in range(1, sets)]
    public = PUBLIC_CALLS[problem.family]
    impls = {"tunegen": [functools.partial(public, *c.public[0], **c.public[1]) for c in cases]}
    impls.update({name: [c.peers[name] for c in cases] for name in names if name != "tunegen"})
    return {name: (per_call_us(c, graph=False), per_call_us(c, graph=True)) for name, c in impls.items()}


def backward_suite(
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    tokens: int = 16384,
    hidden: int = 2048,
    kv_heads: int | None = None,
    dtype: str = "bfloat16",
) -> list[Problem]:
    """The prefill suite's shapes as backward Problems, for `bench_cases` (TFLOP/s counted as 2.5
    times the forward's FLOPs; peers: the SDPA backends' backward and FlexAttention's)."""
    shapes = prefill_suite(seqlens, head_dims, causal, tokens, hidden, kv_heads)
    return [dataclasses.replace(s.problem(dtype), family="backward") for s in shapes]


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
            row = _row(name, dtype, shape, ms, tflops, err, note, gpu.name, today)
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


def fp8_decode_suite(
    batches: Sequence[int] = (1, 16, 64),
    cache_lengths: Sequence[int] = (4096, 32768),
    page_sizes: Sequence[int] = (0, 64),
) -> list[Problem]:
    """`decode_suite`'s Problems (Llama-3 8B's heads) over a bf16 cache, each followed by the same
    over an FP8 cache."""
    return [
        p
        for base in decode_suite(batches, cache_lengths, page_sizes=page_sizes)
        for p in (base, dataclasses.replace(base, fp8=True))
    ]
