"""Benchmarks: tunegen against its peers on the same GPU in the same run, prefill on the suite's
Shapes (`bench_prefill`) and any family on its Problems through the family's case (`bench_cases`:
decode, backward). Every output is checked against float64 before it is timed (`rows`)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import triton

import tunegen
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import peers
from tunegen.kernels.gpu import cuda_gpu, gpu_of
from tunegen.kernels.problem import DTYPE_NAMES, Problem
from tunegen.kernels.reference import TOLERANCE, sampled_error, tolerance
from tunegen.measure.rows import Row, check_then_time
from tunegen.measure.suites import Shape
from tunegen.tuning.timing import per_call_us, rate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The public call each family's Case gives the arguments of (see Case.public).
PUBLIC_CALLS = {"decode": tunegen.decode_attention}


def _implementations(
    names: Iterable[str], shape: Shape, device: torch.device, sinks: torch.Tensor | None = None
) -> dict[str, Callable]:
    """Each implementation as a call of (q, k, v), with `shape`'s features (`sinks`: its sink
    logits, or None); an SDPA backend, which takes none of them, refuses a shape that has any."""
    local = shape.call_args(sinks)
    impls: dict[str, Callable] = {}
    for name in names:
        if name == "tunegen":
            impls[name] = functools.partial(tunegen.attention, causal=shape.causal, strict=True, **local)
        elif name == "tunegen-default":
            impls[name] = _default_variant(shape.causal, local)
        elif name == "flex":
            impls[name] = peers.flex(
                shape.causal, (shape.batch, shape.heads, shape.seqlen, shape.head_dim), device, **local
            )
        elif name in peers.SDPA_BACKENDS and shape.features:
            impls[name] = _refuses(f"scaled_dot_product_attention takes none of {', '.join(shape.features)}")
        elif name in peers.SDPA_BACKENDS:
            impls[name] = peers.sdpa(name, shape.causal)
        else:
            raise ValueError(
                f"impl: expected tunegen, tunegen-default or one of {peers.available()}, got {name!r}"
            )
    return impls


def _refuses(reason: str) -> Callable:
    """A call that cannot run any inputs, for `reason` (its row says n/a and why)."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise ValueError(reason)

    return call


def _default_variant(causal: bool, local: dict[str, Any]) -> Callable:
    """The prefill family's default Variant for the inputs' Problem, winners ignored: beside
    `tunegen`, it shows what tuning gained. Built on the first call, which is the untimed check."""
    from tunegen.kernels.families import base, get

    built: list[base.Kernel] = []

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        prefill_call = PrefillCall.dense(q, k, v, causal=causal, **local)
        out = torch.empty_like(q)
        if not built:
            family, gpu = get("prefill"), gpu_of(q.device)
            problem = prefill_call.problem(out)
            built.append(base.build(family, family.default_variant(problem, gpu), problem, gpu))
        built[0].launch(prefill_call.args(out, None))
        return out

    return call


def _fits_math(shape: Shape, budget_bytes: float) -> bool:
    return shape.batch * shape.heads * shape.seqlen**2 * 6 < budget_bytes


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator]


def prefill_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Inputs:
    """Random q, k, v for `shape`, its sink logits (float32, one per query head; None without
    sinks) and the generator its checks sample rows with."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (
        torch.randn(shape.batch, heads, shape.seqlen, shape.head_dim, generator=gen).to(device, dtype)
        for heads in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    sinks = torch.randn(shape.heads, generator=gen).to(device) if shape.sinks else None
    return q, k, v, sinks, gen


def prefill_calls(shape: Shape, names: Iterable[str], inputs: Inputs) -> dict[str, tuple]:
    """`check_then_time`'s calls: each implementation on `inputs` (`prefill_inputs`) with `shape`'s
    features, checked on sampled rows against float64 with the same features."""
    q, k, v, sinks, gen = inputs
    local = shape.call_args(sinks)
    check = functools.partial(
        sampled_error, q=q, k=k, v=v, causal=shape.causal, scale=shape.head_dim**-0.5, generator=gen, **local
    )
    bound = TOLERANCE[DTYPE_NAMES[q.dtype]]
    impls = _implementations(names, shape, q.device, sinks)
    return {name: (functools.partial(fn, q, k, v), check, bound) for name, fn in impls.items()}


def bench_prefill(
    shapes: Sequence[Shape],
    impls: Sequence[str],
    *,
    dtype: str = "bf16",
    seed: int = 0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Check then time each implementation on each shape; failures become rows with a note.
    TFLOP/s count the (row, key) pairs each shape attends (`Shape.flops`)."""
    device = torch.device("cuda")
    gpu = cuda_gpu(torch.cuda.current_device())
    today = datetime.date.today().isoformat()
    free, _ = torch.cuda.mem_get_info()
    rows: list[Row] = []
    for shape in shapes:
        inputs = prefill_inputs(shape, DTYPES[dtype], device, seed)
        fits = [name for name in impls if name != "sdpa-math" or _fits_math(shape, free * 0.5)]
        results = {name: (None, None, "skipped: the N x N matrix does not fit") for name in impls}
        results.update(check_then_time(prefill_calls(shape, fits, inputs)))
        for name in impls:
            ms, err, note = results[name]
            tflops = rate("TFLOP/s", shape.flops(), ms) if ms else None
            row = Row.of(name, dtype, shape, ms, tflops, err, note, gpu.name, today)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def bench_cases(
    problems: Sequence[Problem], *, seed: int = 0, on_row: Callable[[dict], None] | None = None
) -> list[dict]:
    """Check then time tunegen's dispatched kernel and every peer the family's case offers, per
    Problem, in the family's unit (GB/s for decode), each credited with the work it does
    (`credited`)."""
    from tunegen.kernels import dispatch
    from tunegen.kernels.families import get

    device = torch.device("cuda")
    gpu = cuda_gpu(torch.cuda.current_device())
    rows = []
    for problem in problems:
        family = get(problem.family)
        unit, _ = family.measure(problem)
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
            work = credited(family, problem, name)
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


def credited(family: Any, problem: Problem, impl: str) -> float:
    """The work (FLOPs or bytes, in `family.measure`'s unit) implementation `impl` is credited
    with on `problem`. tunegen's kernel reads the Problem's own tensors; a peer runs on their
    16-bit values (a family's case hands the peers an FP8 Problem's inputs dequantized), so over
    an FP8 KV cache a peer reads 2 bytes an element, not the kernel's 1. Decode under a window or
    chunk is credited with the keys some query sees, as the family's measure counts them."""
    return family.measure(problem if impl == "tunegen" else dataclasses.replace(problem, fp8=False))[1]


def eager_and_graph(
    problem: Problem, kernel: Any, case: Any, names: Sequence[str], device: torch.device, seed: int
) -> dict[str, tuple[float | None, float | None]]:
    """Per-call microseconds of each implementation called as a model calls it: "tunegen" is the
    public call, the others the peers `names`; eager (back to back, the host's cost included) and
    replayed from a CUDA graph, each peer inside its setting (`peers.pinned`), entered once.
    Calls rotate over enough input sets to hold twice the L2 cache, so that no call reads its
    inputs from the one before's cache lines."""
    from tunegen.kernels.families import get

    family = get(problem.family)
    work = credited(family, problem, "tunegen")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    sets = max(1, min(8, math.ceil(2 * l2 / work)))
    cases = [case] + [family.case(problem, kernel, device, seed + i) for i in range(1, sets)]
    public = PUBLIC_CALLS[problem.family]
    impls = {"tunegen": [functools.partial(public, *c.public[0], **c.public[1]) for c in cases]}
    impls.update({name: [c.peers[name] for c in cases] for name in names if name != "tunegen"})
    return {
        name: (per_call_us(c, graph=False, impl=name), per_call_us(c, graph=True, impl=name))
        for name, c in impls.items()
    }
