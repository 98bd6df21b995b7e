"""Gradients of `attention` and `attention_varlen` with the attention of current models (window_size,
attention_chunk, softcap, sinks) through autograd, against float64 autograd of the reference: the
sinks get their gradient in their own dtype, alone or with q, k, v; the log-sum-exp's gradient;
packed batches; a sink of -inf; the PyTorch fallback; torch.compile and the custom ops called
directly; the fixed-order backward; FlashAttention's interfaces."""

from __future__ import annotations

import pytest
import torch

import tunegen
import tunegen.flash_attn as fa2
import tunegen.flash_attn_interface as fa3
from helpers import GRAD_TOL, dispatch_interprets, leaves, qkv_dout, randn
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

pytestmark = pytest.mark.usefixtures("user_db")

CALLS = {
    "gpt-oss": {"causal": True, "window_size": (9, -1), "sinks": True},
    "gemma2": {"causal": True, "window_size": (9, -1), "softcap": 4.0},
    "llama4": {"causal": True, "attention_chunk": 16},
    "every feature": {"window_size": (6, 4), "attention_chunk": 16, "softcap": 4.0, "sinks": True},
}


def _inputs(device, nq, nk, seed, sinks_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = qkv_dout(2, 4, 2, nq, nk, 32, torch.float16, device, seed=seed)
    return q, k, v, dout, randn(4, dtype=sinks_dtype, device=device, gen=gen)


def _split(kwargs, sinks):
    """The call's keyword arguments with the sinks as a tensor, and the reference's."""
    call = {**kwargs, "sinks": sinks if kwargs.get("sinks") else None}
    ref = {k: call[k] for k in ("window_size", "attention_chunk", "softcap") if k in call}
    return call, ref


def float64_grads(forward, inputs, sinks, dout, dlse=None):
    """Float64 autograd of `forward(q, k, v, sinks)` at `inputs` (and the sinks, where not None)."""
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    out, lse = forward(*leaves64, sinks64)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    return torch.autograd.grad(loss, leaves64 + ([] if sinks64 is None else [sinks64]))


def assert_close(got, ref, dtype=torch.float16):
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g is not None and not torch.isnan(g).any()
        err = float((g.double() - r).norm() / r.norm().clamp_min(1e-300))
        assert err < GRAD_TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize(("nq", "nk"), [(45, 45), (30, 70), (70, 30)], ids=str)
def test_attention_gradients_against_float64(device, name, nq, nk):
    q, k, v, dout, sinks = _inputs(device, nq, nk, seed=nq + nk + len(name))
    call, ref_args = _split(CALLS[name], sinks)
    q, k, v = leaves(q, k, v)
    if call["sinks"] is not None:
        call["sinks"] = sinks.clone().requires_grad_()
    out, lse = tunegen.attention(q, k, v, scale=0.3, return_lse=True, strict=True, **call)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(nq)).to(device)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    causal = call.get("causal", False)
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=causal, scale=0.3, sinks=s, **ref_args)
    got = [q.grad, k.grad, v.grad] + ([] if call["sinks"] is None else [call["sinks"].grad])
    assert_close(got, float64_grads(forward, (q, k, v), call["sinks"], dout, dlse))


@pytest.mark.parametrize("name", ["gpt-oss", "every feature", "llama4"])
def test_attention_varlen_gradients_against_float64(device, name):
    """Sequences of 1, 39 and 30 queries over 20, 39 and 31 keys."""
    gen = torch.Generator().manual_seed(5)
    cu_q = torch.tensor([0, 1, 40, 70], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 59, 90], dtype=torch.int32, device=device)
    q, dout = (randn(70, 4, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    k, v = (randn(90, 2, 32, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    call, ref_args = _split(CALLS[name], randn(4, dtype=torch.float32, device=device, gen=gen))
    q, k, v = leaves(q, k, v)
    if call["sinks"] is not None:
        call["sinks"].requires_grad_()
    out = tunegen.attention_varlen(q, k, v, cu_q, cu_k, 39, 39, strict=True, **call)
    out.backward(dout)
    causal = call.get("causal", False)
    forward = lambda q, k, v, s: attention_varlen_reference(
        q, k, v, cu_q, cu_k, causal=causal, scale=32**-0.5, sinks=s, **ref_args
    )
    got = [q.grad, k.grad, v.grad] + ([] if call["sinks"] is None else [call["sinks"].grad])
    assert_close(got, float64_grads(forward, (q, k, v), call["sinks"], dout))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_sinks_alone_get_their_gradient_in_their_dtype(device, dtype):
    """Sinks that require grad take the autograd path though q, k and v do not; their gradient
    comes back in their own dtype."""
    q, k, v, dout, sinks = _inputs(device, 37, 37, seed=3, sinks_dtype=dtype)
    sinks.requires_grad_()
    out = tunegen.attention(q, k, v, causal=True, window_size=(9, -1), sinks=sinks)
    assert out.grad_fn is not None
    out.backward(dout)
    assert sinks.grad.dtype == dtype and q.grad is None
    forward = lambda q, k, v, s: attention_reference(
        q, k, v, causal=True, scale=32**-0.5, window_size=(9, -1), sinks=s
    )
    ref = float64_grads(forward, (q, k, v), sinks.float(), dout)[3]
    err = float((sinks.grad.double() - ref).norm() / ref.norm())
    assert err < max(GRAD_TOL[torch.float16], torch.finfo(dtype).eps)


def test_a_sink_of_minus_infinity_has_no_gradient(device):
    """-inf joins no softmax: its gradient is 0, and the rows that see no key (causal, more queries
    than keys) give no NaN; the other gradients are float64's."""
    q, k, v, dout, sinks = _inputs(device, 30, 20, seed=13)
    sinks[1] = float("-inf")
    q, k, v = leaves(q, k, v)
    sinks.requires_grad_()
    tunegen.attention(q, k, v, causal=True, sinks=sinks).backward(dout)
    assert float(sinks.grad[1]) == 0.0 and not torch.isnan(sinks.grad).any()
    finite = sinks.detach().clone()
    finite[1] = -1e4  # as good as -inf, and differentiable in float64
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=True, scale=32**-0.5, sinks=s)
    ref = float64_grads(forward, (q, k, v), finite, dout)
    assert_close([q.grad, k.grad, v.grad, sinks.grad], ref)


def test_the_fallback_gives_the_sinks_their_gradient(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch path, the features and sinks too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
    q, k, v, dout, sinks = _inputs(torch.device("cpu"), 29, 33, seed=17)
    q, k, v = leaves(q, k, v)
    sinks.requires_grad_()
    local = {"window_size": (5, 3), "attention_chunk": 16, "softcap": 4.0}
    tunegen.attention(q, k, v, sinks=sinks, **local).backward(dout)
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=False, scale=32**-0.5, sinks=s, **local)
    assert_close([q.grad, k.grad, v.grad, sinks.grad], float64_grads(forward, (q, k, v), sinks, dout))


def test_a_window_wider_than_the_keys_is_the_plain_call(device):
    """Normalized away, the window leaves the plain call's gradients (and the cap its own)."""
    q, k, v, dout, _ = _inputs(device, 29, 29, seed=19)
    q, k, v = leaves(q, k, v)
    tunegen.attention(q, k, v, causal=True, window_size=(500, -1), softcap=4.0).backward(dout)
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=True, scale=32**-0.5, softcap=4.0)
    assert_close([q.grad, k.grad, v.grad], float64_grads(forward, (q, k, v), None, dout))


def test_a_deterministic_call_gives_the_same_bits_twice(device):
    """The sinks' gradient is summed in a fixed order, as dq, dk, dv are under `deterministic`."""
    q, k, v, dout, sinks = _inputs(device, 45, 45, seed=23)
    runs = []
    for _ in range(2):
        inputs = leaves(q, k, v, sinks)
        out = tunegen.attention(
            *inputs[:3], causal=True, window_size=(9, -1), sinks=inputs[3], deterministic=True
        )
        out.backward(dout)
        runs.append([t.grad for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.skipif(not dispatch_interprets(), reason="CPU kernels need the interpreter")
def test_fullgraph_compile_gradients():
    """Through the custom ops: the sinks' gradient reaches the caller's tensor (float16 here)."""
    q, k, v, dout, sinks = _inputs("cpu", 37, 37, seed=29, sinks_dtype=torch.float16)
    cu = torch.tensor([0, 13, 37], dtype=torch.int32)
    qp, kp, vp, dout_p = (t[0].transpose(0, 1) for t in (q, k, v, dout))
    local = {"window_size": (6, -1), "softcap": 4.0}

    def block(q, k, v, qp, kp, vp, sinks):
        out = tunegen.attention(q, k, v, causal=True, sinks=sinks, **local)
        packed_out = tunegen.attention_varlen(qp, kp, vp, cu, cu, 24, 24, causal=True, attention_chunk=8)
        return (out.float() * dout.float()).sum() + (packed_out.float() * dout_p.float()).sum()

    inputs = leaves(q, k, v, qp, kp, vp, sinks)
    torch._dynamo.reset()
    torch.compile(block, fullgraph=True)(*inputs).backward()
    assert inputs[6].grad.dtype == torch.float16
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=True, scale=32**-0.5, sinks=s, **local)
    ref = float64_grads(forward, (q, k, v), sinks.float(), dout)
    assert_close([t.grad for t in (*inputs[:3], inputs[6])], ref)
    forward = lambda q, k, v, s: attention_varlen_reference(
        q, k, v, cu, cu, causal=True, scale=32**-0.5, attention_chunk=8
    )
    assert_close([t.grad for t in inputs[3:6]], float64_grads(forward, (qp, kp, vp), None, dout_p))


@pytest.mark.skipif(not dispatch_interprets(), reason="CPU kernels need the interpreter")
@pytest.mark.parametrize("return_lse", [False, True])
def test_the_custom_ops_called_directly_have_gradients(return_lse):
    """torch.ops.tunegen.attention with a window, the cap and sinks, called directly (without the
    log-sum-exp, its backward computes it again with them); its backward op returns the sinks'
    gradient fourth (0 elements without sinks)."""
    q, k, v, dout, sinks = _inputs("cpu", 29, 29, seed=31)
    q, k, v = leaves(q, k, v)
    sinks.requires_grad_()
    out, _ = torch.ops.tunegen.attention(q, k, v, True, 0.25, return_lse, False, 3, -1, 0, 4.0, sinks)
    out.backward(dout)
    local = {"window_size": (3, -1), "softcap": 4.0}
    forward = lambda q, k, v, s: attention_reference(q, k, v, causal=True, scale=0.25, sinks=s, **local)
    assert_close([q.grad, k.grad, v.grad, sinks.grad], float64_grads(forward, (q, k, v), sinks, dout))
    with torch.no_grad():
        out, lse = tunegen.attention(q, k, v, causal=True, scale=0.25, return_lse=True)
        *_, dsinks = torch.ops.tunegen.attention_backward(dout, q, k, v, out, lse, None, True, 0.25)
    assert dsinks.shape == (0,)


def test_backward_ops_with_the_features_pass_opcheck():
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout, sinks = _inputs("cpu", 19, 19, seed=37)
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True, window_size=(4, -1), sinks=sinks)
    torch.library.opcheck(
        torch.ops.tunegen.attention_backward.default,
        (dout, q, k, v, out, lse, None, True, 0.25, False, 4, -1, 0, 0.0, sinks),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.tunegen.attention.default,
        (*leaves(q, k, v), True, 0.25, False, False, 4, -1, 0, 4.0, sinks.clone().requires_grad_()),
        test_utils=("test_autograd_registration",),
    )


@pytest.mark.parametrize(
    ("interface", "kwargs"),
    [
        ("fa2", {"causal": True, "window_size": (5, 0), "softcap": 2.0}),
        ("fa3", {"causal": True, "attention_chunk": 8, "window_size": (-7, 9)}),
    ],
)
def test_flashattention_functions_differentiate_them(device, interface, kwargs):
    """FlashAttention's prefill functions with a window, the cap or chunks, under autograd."""
    q, k, v, dout = (t.transpose(1, 2) for t in qkv_dout(2, 4, 2, 29, 41, 32, torch.float16, device, seed=41))
    q, k, v = leaves(q, k, v)
    fa = fa2 if interface == "fa2" else fa3
    fa.flash_attn_func(q, k, v, softmax_scale=0.3, **kwargs).backward(dout)
    left = max(kwargs["window_size"][0], -1)
    local = {"window_size": (left, -1), "attention_chunk": kwargs.get("attention_chunk", 0)}
    local["softcap"] = kwargs.get("softcap", 0.0)

    def forward(q, k, v, _):
        out, lse = attention_reference(
            *(t.transpose(1, 2) for t in (q, k, v)), causal=True, scale=0.3, **local
        )
        return out.transpose(1, 2), lse

    assert_close([q.grad, k.grad, v.grad], float64_grads(forward, (q, k, v), None, dout))
