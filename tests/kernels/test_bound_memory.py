"""Nothing a call receives outlives it: a kernel's bound call (what the launch caches keep, one per
launch key) holds no tensor of the call that bound it, in every family and schedule, and the
caches of bound calls keep the most recently used within their bound.

The modules are rendered for an H100 and bound on CPU tensors, which builds every launch's
arguments (descriptors included) without launching: no GPU is needed to see what a bound call
keeps. Gluon (the Hopper schedule) cannot be imported where Triton interprets, so those cases
bind in a child process that does not. The GPU side (memory back to its baseline after hundreds
of shapes through every public path) is tests/public/test_memory_gpu.py."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tunegen.kernels import dispatch, fp8, launcher
from tunegen.kernels.families import backward, decode, prefill
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.launch_args import BackwardArgs, DecodeArgs, PrefillArgs
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import load, render

HOPPER = Gpu("H100", (9, 0), 132, 232448, "3.6.0", "", "cuda")
LaunchArgs = PrefillArgs | BackwardArgs | DecodeArgs
WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, pingpong=True)


def _module(family, variant, problem):
    rendered = render(family.template, family.name, variant, family.features(problem, HOPPER))
    return load(rendered, interpret=False)


def _prefill_args(problem: Problem) -> PrefillArgs:
    b, hq, hkv, d = 2, problem.num_heads_q, problem.num_heads_kv, problem.head_dim
    n, m = 100, 130
    dtype = torch.bfloat16
    q = torch.randn(b, hq, n, d).to(dtype)
    k, v = (torch.randn(b, hkv, m, d).to(dtype) for _ in range(2))
    out = torch.empty(b, hq, n, d, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, n) if problem.return_lse else None
    if problem.fp8:
        x = fp8.quantize_reference(q, k, v, hadamard=False, per_block=True)
        return PrefillArgs(x.q, x.k, x.v, out, lse, 0.1, q_descale=x[3], k_descale=x[4], v_descale=x[5])
    if problem.varlen:
        packed = [t.transpose(1, 2).reshape(-1, t.shape[1], d).contiguous() for t in (q, k, v, out)]
        cu_q = torch.tensor([0, n, 2 * n], dtype=torch.int32)
        cu_k = torch.tensor([0, m, 2 * m], dtype=torch.int32)
        lse = torch.empty(hq, 2 * n) if problem.return_lse else None
        return PrefillArgs(*packed, lse, 0.1, cu_q, cu_k, n)
    return PrefillArgs(q, k, v, out, lse, 0.1)


def _problem(family: str, **features) -> Problem:
    base = {"dtype": "bfloat16", "head_dim": 128, "causal": True, "num_heads_q": 8, "num_heads_kv": 2}
    sizes = {"batch": 2, "seqlen_q": 128, "seqlen_k": 128}
    return Problem(family, **{**base, **sizes, **features})


PREFILL = [
    ("fa2", prefill.PrefillVariant(), {}),
    ("fa2-lse-desc", prefill.PrefillVariant(load="desc"), {"return_lse": True}),
    ("fa2-varlen", prefill.PrefillVariant(), {"varlen": True, "return_lse": True}),
    ("fa2-fp8", prefill.PrefillVariant(v_trans=True), {"fp8": True}),
    ("ws", WS, {"return_lse": True}),
    ("ws-fp8", WS.replace(pingpong=False), {"fp8": True}),
]


def _assert_held_by_nothing(args: LaunchArgs, bind) -> None:
    """Bind on `args` (which nothing else may hold), drop them, and check every tensor among them
    is gone while the bound call lives on (views count: a kept view keeps its base)."""
    fields = [getattr(args, f.name) for f in dataclasses.fields(args)]
    refs = [weakref.ref(a) for a in fields if isinstance(a, torch.Tensor)]
    del fields
    call = bind(args)
    del args
    gc.collect()
    kept = [r() for r in refs if r() is not None]
    assert not kept, f"the bound call keeps {[tuple(t.shape) for t in kept]}"
    assert callable(call)


def check_prefill(name: str) -> None:
    """Bind PREFILL's case `name` and check it keeps nothing (in this process, or in the child)."""
    _, variant, features = next(p for p in PREFILL if p[0] == name)
    problem = _problem("prefill", **features)
    module = _module(prefill.FAMILY, variant, problem)
    _assert_held_by_nothing(_prefill_args(problem), module.bind)


@pytest.mark.parametrize("name", [p[0] for p in PREFILL])
def test_a_bound_prefill_call_keeps_no_tensor(name):
    if not name.startswith("ws") or os.environ.get("TRITON_INTERPRET", "0") == "0":
        check_prefill(name)
        return
    here = Path(__file__).parent
    child = f"import sys; sys.path[:0] = {[str(here), str(here.parent)]!r}; "
    child += f"import test_bound_memory as t; t.check_prefill({name!r})"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


BACKWARD = [
    backward.BackwardVariant(32, 16, 16, 32),
    backward.BackwardVariant(32, 16, dq_mode="atomic", persistent=True, order="heaviest_first"),
    backward.BackwardVariant(16, 32, dq_mode="partial", load="desc"),
    backward.BackwardVariant(32, 16, 16, 32, dq_mode="concurrent", persistent=True, fuse_delta=False),
]


def _backward_args(with_dlse: bool) -> BackwardArgs:
    forward = _prefill_args(_problem("backward"))
    q, k, v, out = (t.half() for t in (forward.q, forward.k, forward.v, forward.out))
    del forward
    dlse = torch.randn(q.shape[:3]).half() if with_dlse else None
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return BackwardArgs(q, k, v, out, torch.randn_like(out), torch.randn(q.shape[:3]), dlse, *grads, 0.1)


@pytest.mark.parametrize("variant", BACKWARD, ids=lambda v: v.to_json())
@pytest.mark.parametrize("with_dlse", [False, True])
def test_a_bound_backward_call_keeps_no_tensor(variant, with_dlse):
    module = _module(backward.FAMILY, variant, _problem("backward", dtype="float16"))
    _assert_held_by_nothing(_backward_args(with_dlse), module.bind)


DECODE = [
    ("contiguous-split", {}, decode.DecodeVariant(num_splits=4)),
    ("paged-append", {"paged": True, "page_size": 64}, decode.DecodeVariant(num_splits=2)),
    ("fp8-paged-append", {"paged": True, "page_size": 64, "fp8": True}, decode.DecodeVariant(num_splits=2)),
]


def _decode_args(problem: Problem) -> DecodeArgs:
    b, hq, hkv, d = 2, problem.num_heads_q, problem.num_heads_kv, problem.head_dim
    cache_dtype = fp8.E4M3 if problem.fp8 else torch.bfloat16
    shape = (16, 64, hkv, d) if problem.paged else (b, 512, hkv, d)
    q = torch.randn(b, 1, hq, d).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(shape).to(cache_dtype) for _ in range(2))
    lengths = torch.tensor([100, 200], dtype=torch.int32)
    table = torch.arange(16, dtype=torch.int32).view(b, 8) if problem.paged else None
    new = [torch.randn(b, 1, hkv, d).to(torch.bfloat16) for _ in range(2)]
    descales = [torch.rand(b, hkv) for _ in range(2)] if problem.fp8 else []
    return DecodeArgs(q, k_cache, v_cache, lengths, torch.empty_like(q), None, 0.1, table, *new, *descales)


@pytest.mark.parametrize("name, features, variant", DECODE, ids=[d[0] for d in DECODE])
def test_a_bound_decode_call_keeps_no_tensor(name, features, variant):
    problem = _problem("decode", seqlen_q=1, seqlen_k=512, **features)
    module = _module(decode.FAMILY, variant, problem)
    _assert_held_by_nothing(_decode_args(problem), module.bind)


def test_the_caches_of_bound_calls_keep_the_most_recently_used():
    calls = launcher.Calls(size=3)
    for key in "abc":
        calls[key] = print
    assert calls.get("a") is print  # now the most recent: "b" goes first
    calls["d"] = print
    assert calls.get("b") is None and len(calls) == 3
    assert all(calls.get(key) is print for key in "acd")
    big = launcher.Calls(size=16)
    for key in range(17):
        big[key] = print
    assert len(big) == 14, "past the bound, the least recently used eighth goes at once"
    assert big.get(2) is None and big.get(3) is print
    assert isinstance(dispatch.fast_calls, launcher.Calls)
    assert dispatch.fast_calls.size == launcher.CALL_CACHE_SIZE


def test_the_bound_on_bound_calls_is_a_setting():
    assert launcher._call_cache_size(None) == 1024
    assert launcher._call_cache_size("64") == 64
    for bad in ("0", "-3", "many"):
        with pytest.warns(UserWarning, match="TUNEGEN_CALL_CACHE: expected a positive number"):
            assert launcher._call_cache_size(bad) == 1024


def test_a_module_launch_binds_again_only_past_its_bound(monkeypatch):
    monkeypatch.setattr(launcher, "CALL_CACHE_SIZE", 4)
    bound = []

    def bind(x):
        bound.append(x.shape[0])
        return lambda x: None

    launch = launcher.memoized(bind, lambda x: launcher.key_of(x))
    for n in (1, 2, 3, 4, 1, 5, 1, 2):
        launch(torch.empty(n))
    # 1 stays in use and is kept; 2 was the least recently used when 5 came, so it binds again
    assert bound == [1, 2, 3, 4, 5, 2]
