"""Shared test helpers: fresh random inputs (packed sequences, KV caches), poisoned outputs, float64
comparisons, Winners recorded for dispatch to find."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from conftest import HAS_CUDA, INTERPRETING, NEEDS_GPU, NEEDS_INTERPRETER

import tunegen
from tunegen.backends import backend_for
from tunegen.calls.backward import BackwardCall
from tunegen.calls.decode import DecodeCall
from tunegen.calls.local import NONE, Local
from tunegen.calls.prefill import PrefillCall, Varlen
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families import backward, base, decode, prefill
from tunegen.kernels.gpu import Gpu, gpu_of, interpreter_gpu
from tunegen.kernels.reference import attention_reference, attention_varlen_reference
from tunegen.tuning_db import Store, WinnerRecord

# Relative error bounds ‖out − ref‖/‖ref‖ against float64, as tight as each dtype allows: the
# probabilities are rounded to the input dtype before the second product, and so is the output.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


# bfloat16 runs on the interpreter too, through the rendering that upcasts tl.dot's operands.
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# The Hopper schedules' tests: an H100 as Triton 3.6 sees it, the same with the installed release
# (what the GPU tests admit), and the mark of tests that run compiled kernels on an sm_90 GPU.
H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, "3.6.0", "2.11", "cuda")
HOPPER = pytest.mark.skipif(
    not (HAS_CUDA and not INTERPRETING and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU, compiled kernels",
)


def ws_shapes(test):
    """The Hopper schedule's float64 grid, on the GPU: head dims 64 and 128, ragged lengths (no
    multiple of any tile; nq < nk and nq > nk, where causal rows may see no key), causal both."""
    for mark in (
        pytest.mark.parametrize("d", [64, 128]),
        pytest.mark.parametrize(("nq", "nk"), [(333, 333), (200, 517), (517, 190)], ids=str),
        pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
        HOPPER,
        pytest.mark.gpu,
    ):
        test = mark(test)
    return test


def randn(*shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output holds NaN: some element was never written"
    return float((out.double() - ref).norm() / ref.norm())


def assert_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(lse).any(), "log-sum-exp holds NaN: some row was never written"
    infinite = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), infinite), "rows with no visible key must give an infinity"
    assert torch.equal(lse[infinite].double(), ref[infinite]), "with the reference's sign"
    finite = torch.isfinite(ref)
    if finite.any():
        assert float((lse.double()[finite] - ref[finite]).abs().max()) < LSE_TOL[dtype]


def run_variant(
    variant: prefill.PrefillVariant,
    q,
    k,
    v,
    *,
    causal,
    scale,
    return_lse=True,
    varlen: Varlen | None = None,
    local: Local = NONE,
):
    """Launch one Variant directly, into outputs poisoned with NaN, under the Problem the public
    call would dispatch it, with `local`'s features as given (unchecked and not normalized: a test
    may hand the kernel what the checks refuse or drop)."""
    call = PrefillCall(q, k, v, causal, scale, return_lse, varlen=varlen, local=local)
    out, lse = call.outputs()
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))
    kernel = base.build(prefill.FAMILY, variant, call.problem(out), gpu_of(q.device))
    kernel.launch(call.args(out, lse))
    return out, lse


def run_backward_variant(
    variant,
    q,
    k,
    v,
    dout,
    *,
    causal,
    scale,
    varlen: Varlen | None = None,
    dlse=None,
    local: Local = NONE,
    forward_outputs=None,
):
    """Run one backward Variant's kernels directly on the float64 reference's output and
    log-sum-exp (or `forward_outputs`, taken before a test poisoned inputs no row may read), into
    gradients poisoned with NaN: dq, dk, dv (and the sinks' with `local`'s)."""
    forward = PrefillCall(q, k, v, causal, scale, True, varlen=varlen, local=local)
    out, lse = forward_outputs or forward.reference()
    call = BackwardCall(forward, out.to(q.dtype), lse.float(), dout, dlse)
    kernel = base.build(backward.FAMILY, variant, call.problem(), gpu_of(q.device))
    grads = [torch.full_like(t, float("nan")) for t in call.outputs()]
    kernel.launch(call.args(*grads))
    return grads


def run_decode_variant(
    variant, q, k_cache, v_cache, seqlens, table, k=None, v=None, causal=True, descales=None
):
    """Launch one decode Variant directly (unchecked), into outputs poisoned with NaN; `descales`
    (k_descale, v_descale) for an e4m3 cache."""
    scale = q.shape[-1] ** -0.5
    call = DecodeCall(q, k_cache, v_cache, seqlens, k, v, table, causal, scale, True, descales=descales)
    out, lse = call.outputs()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    kernel = base.build(decode.FAMILY, variant, call.problem(), gpu_of(q.device))
    kernel.launch(call.args(out, lse))
    return out, lse


def packed(lengths_q, lengths_k, hq, hkv, d, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype, device=device, gen=gen)
    k = randn(int(cu_k[-1]), hkv, d, dtype=dtype, device=device, gen=gen)
    v = randn(int(cu_k[-1]), hkv, d, dtype=dtype, device=device, gen=gen)
    return q, k, v, cu_q, cu_k


class Paged(NamedTuple):
    """A paged call's inputs, and the packed keys and values the pages hold."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_k: torch.Tensor

    def call(self, **kwargs):
        """tunegen.attention_varlen over the pages."""
        sizes = (self.cu_seqlens_q, None, self.max_seqlen_q, self.max_seqlen_k)
        pages = {"seqused_k": self.seqused_k, "block_table": self.block_table}
        return tunegen.attention_varlen(self.q, self.k_cache, self.v_cache, *sizes, **pages, **kwargs)

    def reference(self, causal: bool):
        """Float64 attention over the packed keys and values."""
        cu = (self.cu_seqlens_q, self.cu_seqlens_k)
        return attention_varlen_reference(
            self.q, self.k, self.v, *cu, causal=causal, scale=self.q.shape[-1] ** -0.5
        )


def paged(lq, lk, hq, hkv, d, page, dtype, device, seed, spare=3, stale=False) -> Paged:
    """Packed queries over keys and values written into a cache of shuffled pages, with `spare`
    pages that no sequence uses; every row outside the sequences' keys holds NaN, and so does every
    page the block table names past a sequence's last (each row has one entry more than the longest
    sequence needs). With `stale`, the rows of a sequence's last page past its keys hold finite
    values instead, as a serving engine's reused pages do: the Hopper schedule reads a key block
    whole and masks the keys past a sequence's end, which stops stale keys but not NaN values (as in
    FlashAttention-3)."""
    q, k, v, cu_q, cu_k = packed(lq, lk, hq, hkv, d, dtype, torch.device("cpu"), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    need = [-(-n // page) for n in lk]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    unused = order[sum(need) :]
    table = torch.empty(len(lk), max(need) + 1, dtype=torch.int32)
    k_cache, v_cache = (torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype) for _ in "kv")
    at = 0
    for b, (n, m) in enumerate(zip(lk, need, strict=True)):
        table[b, :m] = order[at : at + m]
        table[b, m:] = unused[torch.randint(spare, (table.shape[1] - m,), generator=gen)]
        at += m
        if stale and m:
            k_cache[table[b, :m].long()] = torch.randn(m, page, hkv, d, generator=gen).to(dtype)
            v_cache[table[b, :m].long()] = torch.randn(m, page, hkv, d, generator=gen).to(dtype)
        idx = torch.arange(n)
        pages, rows = table[b, idx // page].long(), idx % page
        k_cache[pages, rows] = k[cu_k[b] : cu_k[b + 1]]
        v_cache[pages, rows] = v[cu_k[b] : cu_k[b + 1]]
    seqused = torch.tensor(lk, dtype=torch.int32)
    tensors = [t.to(device) for t in (q, k_cache, v_cache, cu_q, seqused, table, k, v, cu_k)]
    q, k_cache, v_cache, cu_q, seqused, table, k, v, cu_k = tensors
    return Paged(q, k_cache, v_cache, cu_q, max(lq), max(max(lk), 1), seqused, table, k, v, cu_k)


def make_cache(batch, hkv, d, lengths, capacity, page, dtype, device, gen):
    """A cache holding `lengths` tokens per sequence, contiguous (page 0) or paged in shuffled pages."""
    if page:
        pages = -(-capacity // page)
        k_cache = torch.randn(batch * pages + 3, page, hkv, d, generator=gen).to(device, dtype)
        table = torch.randperm(batch * pages + 3, generator=gen)[: batch * pages].view(batch, pages)
        table = table.to(device=device, dtype=torch.int32)
    else:
        k_cache = torch.randn(batch, capacity, hkv, d, generator=gen).to(device, dtype)
        table = None
    return k_cache, torch.randn(k_cache.shape, generator=gen).to(device, dtype), table


def gathered(cache, table, b, n):
    """Sequence b's first n cached tokens as (kv_heads, n, head_dim)."""
    if table is None:
        return cache[b, :n].transpose(0, 1)
    page = cache.shape[1]
    idx = torch.arange(n, device=cache.device)
    return cache[table[b, idx // page].long(), idx % page].transpose(0, 1)


def reference(q, k_cache, v_cache, table, lengths, causal, scale):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64, device=q.device
    )
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        o, s = attention_reference(
            q[b].transpose(0, 1)[None],
            gathered(k_cache, table, b, n)[None],
            gathered(v_cache, table, b, n)[None],
            causal=causal,
            scale=scale,
        )
        out[b], lse[b] = o[0].transpose(0, 1), s[0]
    return out, lse


# ‖grad − ref‖/‖ref‖ of dq, dk and dv against float64: the products' inputs (P, dS) are rounded to
# the input dtype, and so are the gradients.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def reference_grads(forward, inputs, dout, dlse=None):
    """Float64 autograd of `forward` (a reference taking q, k, v) at `inputs`."""
    q, k, v = leaves(*(t.double() for t in inputs))
    out, lse = forward(q, k, v)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    return torch.autograd.grad(loss, (q, k, v))


def local_reference_grads(q, k, v, dout, *, causal, scale, local: Local, cu=None, dlse=None):
    """Float64 autograd of the reference with `local`'s features at q, k, v (and the sinks): their
    gradients; `cu` (cu_seqlens_q, cu_seqlens_k) for packed batches."""
    inputs = list(leaves(*(t.double() for t in (q, k, v))))
    args = local.reference_args()
    if local.sinks is not None:
        args["sinks"] = local.sinks.detach().double().requires_grad_()
        inputs.append(args["sinks"])
    if cu is None:
        out, lse = attention_reference(*inputs[:3], causal=causal, scale=scale, **args)
    else:
        out, lse = attention_varlen_reference(*inputs[:3], *cu, causal=causal, scale=scale, **args)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    return torch.autograd.grad(loss, inputs)


def assert_grads(got, ref, dtype):
    """dq, dk, dv (in `dtype`) and the sinks' gradient if any, each within the dtype's bound of
    float64, none left unwritten."""
    assert len(got) == len(ref)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, ref, strict=False):
        assert g is not None and not torch.isnan(g).any(), f"{name} holds NaN: some element was never written"
        assert g.dtype == (torch.float32 if name == "dsinks" else dtype) and g.shape == r.shape
        err = float((g.double() - r).norm() / r.norm().clamp_min(1e-300))
        assert err < GRAD_TOL[dtype], f"{name}: relative error {err:.2e}"


def qkv_dout(batch, hq, hkv, nq, nk, d, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, d), (batch, hq, nq, d))
    return [randn(*s, dtype=dtype, device=device, gen=gen) for s in shapes]


def tiny_problems():
    """Two prefill Problems shrunk for the interpreter (the tuning tests' usual pair)."""
    from tunegen.tuning.presets import dry_run, parse_shape, problems

    shapes = [parse_shape("4,2,32"), parse_shape("8,2,64")]
    return [dry_run(p) for p in problems(shapes, causal=(False,), seqlens=(1024,))]


def assert_each_variant_evaluated_once(url: str, gpu: Gpu, problem, count: int) -> None:
    """The study of `problem` on `gpu` evaluated `count` Variants, none twice, and left no trial
    running: what a search that moves work ahead (or splits it) must not lose or repeat."""
    import optuna

    from tunegen.tuning.claims import evaluated
    from tunegen.tuning.study import study_name

    trials = optuna.load_study(study_name=study_name(gpu, problem, "tpe"), storage=url).trials
    done = [t.user_attrs["variant"] for t in trials if evaluated(t)]
    assert len(done) == len(set(done)) == count
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


def dispatch_interprets() -> bool:
    """Whether CPU tensors run the kernels (under the interpreter) rather than the PyTorch fallback."""
    return backend_for(torch.device("cpu")) == "interpreter"


def qkv(n=40, seed=0):
    """Small GQA float16 inputs on the CPU: batch 2, 4 query and 2 KV heads, head dim 32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, n, 32, generator=gen).half()
    k = torch.randn(2, 2, n, 32, generator=gen).half()
    v = torch.randn(2, 2, n, 32, generator=gen).half()
    return q, k, v


def record_winner(url, problem, variant, triton_version=None, ms=1.0, family="prefill"):
    """Record a Winner of `family` (prefill by default) for the interpreter's Gpu in the database at `url`."""
    gpu = interpreter_gpu()
    with Store(url) as store:
        store.record_winner(
            WinnerRecord(
                gpu=gpu_record(gpu),
                family=family,
                problem=problem,
                variant=variant,
                median_ms=ms,
                rel_err=1e-3,
                triton_version=triton_version or gpu.triton_version,
                torch_version="2.13",
                template_hash="h",
            )
        )


# The three places a decode call runs: the kernel under Triton's interpreter (CPU tensors), the
# PyTorch path (CPU tensors without the interpreter) and the compiled kernel (CUDA).
DECODE_PATHS = [
    pytest.param("interpreter", marks=NEEDS_INTERPRETER),
    pytest.param("torch"),
    pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_GPU]),
]


def on_path(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.device, bool | None]:
    """The device a call on `path` (one of DECODE_PATHS) takes, and the `strict` that makes sure
    it ran there (the PyTorch path is a fallback: None)."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
        return torch.device("cpu"), None
    return torch.device("cpu" if path == "interpreter" else path), True
