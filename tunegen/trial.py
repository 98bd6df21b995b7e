"""What a tuning trial does inside a worker process: build one Variant for one Problem, check
it against float64 on fresh random inputs with its output poisoned, and time it; and the
peers' time on the same Problem. Payloads and results are plain dicts (they cross processes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tunegen.families import base, get
from tunegen.gpu import gpu_of
from tunegen.problem import Problem
from tunegen.reference import TOLERANCE, attention_reference, sampled_error

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FULL_REFERENCE_LIMIT = 2**22  # score elements: above this, check sampled rows


def _device(payload: dict[str, Any]) -> torch.device:
    return torch.device("cuda" if payload["backend"] == "cuda" else "cpu")


def _problem(payload: dict[str, Any]) -> Problem:
    return Problem(**payload["problem"])


def _inputs(problem: Problem, device: torch.device, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[problem.dtype]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, nq, nk, d = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.head_dim
    q = randn(b, problem.num_heads_q, nq, d)
    k = randn(b, problem.num_heads_kv, nk, d)
    v = randn(b, problem.num_heads_kv, nk, d)
    return {"q": q, "k": k, "v": v, "gen": gen}


def _launcher(
    payload: dict[str, Any], tensors: dict[str, Any]
) -> tuple[Callable[[], None], torch.Tensor, Any]:
    """A no-argument launch of the payload's Variant on `tensors`, its output and log-sum-exp."""
    problem = _problem(payload)
    family = get(problem.family)
    gpu = gpu_of(_device(payload))
    variant = family.variant_type.from_json(payload["variant"])
    kernel = base.build(family, variant, problem, gpu)
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    scale = problem.head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device) if problem.return_lse else None
    if problem.varlen:
        b, nq, nk = problem.batch, problem.seqlen_q, problem.seqlen_k
        pq, pk, pv, po = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v, out))
        cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (b + 1) * nk, nk, dtype=torch.int32, device=q.device)
        lse_v = (
            torch.full((q.shape[1], b * nq), float("nan"), device=q.device) if problem.return_lse else None
        )
        out = po
        return (lambda: kernel.launch(pq, pk, pv, po, lse_v, scale, cu_q, cu_k, nq)), out, lse_v
    return (lambda: kernel.launch(q, k, v, out, lse, scale)), out, lse


def compile_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Render, compile and launch once (so the binary is in Triton's cache for the timing worker)."""
    tensors = _inputs(_problem(payload), _device(payload), payload["seed"])
    launch, _, _ = _launcher(payload, tensors)
    launch()
    if payload["backend"] == "cuda":
        torch.cuda.synchronize()
    return {"status": "ok"}


def _error(out: torch.Tensor, payload: dict[str, Any], tensors: dict[str, Any]) -> float:
    problem = _problem(payload)
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if problem.varlen:
        out = out.reshape(problem.batch, problem.seqlen_q, problem.num_heads_q, -1).transpose(1, 2)
    if torch.isnan(out).any():
        return float("nan")
    scale = problem.head_dim**-0.5
    if problem.batch * problem.num_heads_q * problem.seqlen_q * problem.seqlen_k <= FULL_REFERENCE_LIMIT:
        ref, _ = attention_reference(q, k, v, causal=problem.causal, scale=scale)
        return float((out.double() - ref).norm() / ref.norm())
    return sampled_error(out, q, k, v, causal=problem.causal, scale=scale, rows=128, generator=tensors["gen"])


def _median_ms(fn: Callable[[], object], backend: str, rep_ms: float = 100.0) -> float:
    if backend == "cuda":
        from tunegen.timing import median_ms

        return median_ms(fn, warmup_ms=25, rep_ms=rep_ms)
    times = []
    for _ in range(3):  # the interpreter's wall clock: a functional stand-in, never a GPU number
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def evaluate_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Verify then time one Variant: {"status": "ok", "ms", "rel_err"} or a failure with its reason."""
    problem = _problem(payload)
    tensors = _inputs(problem, _device(payload), payload["seed"])
    launch, out, lse = _launcher(payload, tensors)
    launch()
    err = _error(out, payload, tensors)
    if lse is not None and torch.isnan(lse).any():
        return {"status": "wrong", "reason": "log-sum-exp not written", "rel_err": err}
    if not err <= TOLERANCE[problem.dtype]:
        return {"status": "wrong", "reason": f"relative error {err:.3g} against float64", "rel_err": err}
    return {
        "status": "ok",
        "ms": _median_ms(launch, payload["backend"], payload.get("rep_ms", 100.0)),
        "rel_err": err,
    }


def peers_task(payload: dict[str, Any]) -> dict[str, Any]:
    """The best SDPA backend's time on the Problem (CUDA only): {"name", "ms"} or none."""
    from tunegen import peers

    problem = _problem(payload)
    if payload["backend"] != "cuda" or problem.varlen:
        return {"status": "ok", "name": None, "ms": None}
    tensors = _inputs(problem, _device(payload), payload["seed"])
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    best: tuple[float, str] | None = None
    for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
        fn = peers.sdpa(name, problem.causal)
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
        except Exception:  # this backend refuses the shape
            continue
        if (
            not sampled_error(out, q, k, v, causal=problem.causal, scale=problem.head_dim**-0.5)
            <= TOLERANCE[problem.dtype]
        ):
            continue
        ms = _median_ms(lambda fn=fn: fn(q, k, v), "cuda")
        if best is None or ms < best[0]:
            best = (ms, name)
    return {"status": "ok", "name": best[1] if best else None, "ms": best[0] if best else None}
