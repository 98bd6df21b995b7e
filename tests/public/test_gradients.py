"""Gradients of `attention` and `attention_varlen` through autograd, against float64 autograd of the
reference: GQA, causal with unequal lengths, odd head dims, the log-sum-exp's gradient, strided
inputs, the fallback path, torch.compile and the custom ops, bad gradients."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import tunegen
from helpers import (
    assert_grads,
    dispatch_interprets,
    leaves,
    local_reference_grads,
    qkv_dout,
    randn,
    reference_grads,
)
from tunegen.calls.local import Local
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

pytestmark = pytest.mark.usefixtures("user_db")


SHAPES = [
    (2, 4, 2, 37, 37, 64),  # GQA 2, ragged length, batch > 1
    (1, 3, 1, 45, 23, 80),  # MQA, more queries than keys: causal rows that see no key
    (2, 2, 2, 19, 50, 17),  # odd head dim, fewer queries than keys
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("batch", "hq", "hkv", "nq", "nk", "d"), SHAPES)
def test_attention_gradients_match_float64(device, dtype, causal, batch, hq, hkv, nq, nk, d):
    q, k, v, dout = qkv_dout(batch, hq, hkv, nq, nk, d, dtype, device, seed=nq * d + causal)
    q, k, v = leaves(q, k, v)
    out = tunegen.attention(q, k, v, causal=causal)
    out.backward(dout)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=d**-0.5)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("nq", "nk", "d"), [(300, 300, 128), (257, 511, 256), (1000, 999, 64)])
def test_bfloat16_gradients(device, causal, nq, nk, d):
    """The GPU's dtype at the shapes its default Variants are chosen for (compiled, not interpreted)."""
    if device.type == "cpu":
        pytest.skip("bfloat16 tl.dot is emulated on the interpreter; the float16 and float32 tests cover it")
    q, k, v, dout = qkv_dout(2, 8, 2, nq, nk, d, torch.bfloat16, device, seed=5)
    q, k, v = leaves(q, k, v)
    tunegen.attention(q, k, v, causal=causal).backward(dout)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=d**-0.5)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), torch.bfloat16)


def test_log_sum_exp_gradient_and_strided_inputs(device):
    """A loss on both outputs; q, k, v as transposed views of (B, N, H, D) tensors; a dout that
    is a broadcast (stride 0) tensor, as out.sum() gives."""
    gen = torch.Generator().manual_seed(41)
    base_q = randn(2, 29, 4, 32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    base_kv = randn(2, 41, 2, 2, 32, dtype=torch.float32, device=device, gen=gen).requires_grad_()
    q, k, v = base_q.transpose(1, 2), base_kv[:, :, 0].transpose(1, 2), base_kv[:, :, 1].transpose(1, 2)
    weights = randn(2, 4, 29, dtype=torch.float32, device=device, gen=gen)
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True)
    (out.sum() + (lse * weights).sum()).backward()
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=32**-0.5)
    dout = torch.ones(q.shape, device=device)
    grads = [base_q.grad.transpose(1, 2), *(base_kv.grad[:, :, i].transpose(1, 2) for i in (0, 1))]
    assert_grads(grads, reference_grads(forward, (q, k, v), dout, weights), torch.float32)


def test_the_fallback_is_differentiable(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch path, gradients included; strict
    refuses it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
    q, k, v, dout = qkv_dout(2, 4, 2, 21, 26, 24, torch.float16, torch.device("cpu"), seed=51)
    q, k, v = leaves(q, k, v)
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True)
    (out.float() * dout.float()).sum().add(lse.sum()).backward()
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=24**-0.5)
    ref = reference_grads(forward, (q, k, v), dout, torch.ones_like(lse))
    assert_grads((q.grad, k.grad, v.grad), ref, torch.float16)
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    qp, kp, vp = leaves(*(t[0, :, :21].transpose(0, 1) for t in (q, k, v)))
    tunegen.attention_varlen(qp, kp, vp, cu, cu, 12, 12, causal=True).sum().backward()
    forward = lambda q, k, v: attention_varlen_reference(q, k, v, cu, cu, causal=True, scale=24**-0.5)
    ref = reference_grads(forward, (qp, kp, vp), torch.ones(qp.shape))
    assert_grads((qp.grad, kp.grad, vp.grad), ref, torch.float16)
    with pytest.raises(tunegen.FallbackError):
        tunegen.attention(q, k, v, strict=True)


def test_no_autograd_without_grad(monkeypatch):
    """Calls that need no gradient never enter the autograd Function."""
    from tunegen.backward import AttentionFunction

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(AttentionFunction, "apply", lambda *a: pytest.fail("autograd path taken"))
    q, k, v, _ = qkv_dout(1, 2, 2, 8, 8, 16, torch.float16, torch.device("cpu"), seed=0)
    assert tunegen.attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert tunegen.attention(*leaves(q, k, v)).grad_fn is None


def test_fullgraph_compile_gradients():
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(2, 4, 2, 37, 37, 32, torch.float16, torch.device("cpu"), seed=61)
    qp, kp, vp, dout_p = (t[0].transpose(0, 1) for t in (q, k, v, dout))
    cu = torch.tensor([0, 13, 37], dtype=torch.int32)
    weights = torch.randn(4, 37, generator=torch.Generator().manual_seed(62))

    def block(q, k, v, qp, kp, vp):
        out = tunegen.attention(q * 2, k, v, causal=True)
        packed_out, lse = tunegen.attention_varlen(qp, kp, vp, cu, cu, 24, 24, causal=True, return_lse=True)
        losses = (out.float() * dout.float(), packed_out.float() * dout_p.float(), lse * weights)
        return sum(loss.sum() for loss in losses)

    inputs = leaves(q, k, v, qp, kp, vp)
    torch._dynamo.reset()
    torch.compile(block, fullgraph=True)(*inputs).backward()
    forward = lambda q, k, v: attention_reference(q * 2, k, v, causal=True, scale=32**-0.5)
    assert_grads([t.grad for t in inputs[:3]], reference_grads(forward, (q, k, v), dout), torch.float16)
    forward = lambda q, k, v: attention_varlen_reference(q, k, v, cu, cu, causal=True, scale=32**-0.5)
    ref = reference_grads(forward, (qp, kp, vp), dout_p, weights)
    assert_grads([t.grad for t in inputs[3:]], ref, torch.float16)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_deterministic_call_gets_the_fixed_order_backward(monkeypatch, compiled):
    """`deterministic=True` asks this call's backward for the kernel that gives the same bits on
    every run (dispatch.deterministic_kernel_for), eagerly and through the custom ops; other calls
    keep the fastest one."""
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    from tunegen.kernels import dispatch

    asked = []
    real = dispatch.deterministic_kernel_for
    monkeypatch.setattr(dispatch, "deterministic_kernel_for", lambda *a: asked.append(a) or real(*a))
    q, k, v, dout = qkv_dout(1, 4, 2, 29, 29, 32, torch.float16, torch.device("cpu"), seed=63)
    qp, kp, vp, dout_p = (t[0].transpose(0, 1) for t in (q, k, v, dout))
    cu = torch.tensor([0, 11, 29], dtype=torch.int32)

    def losses(q, k, v, qp, kp, vp, deterministic):
        out = tunegen.attention(q, k, v, causal=True, deterministic=deterministic)
        packed_out = tunegen.attention_varlen(qp, kp, vp, cu, cu, 18, 18, deterministic=deterministic)
        return (out.float() * dout.float()).sum() + (packed_out.float() * dout_p.float()).sum()

    run = losses
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(losses, fullgraph=True)
    for deterministic in (False, True):
        asked.clear()
        inputs = leaves(q, k, v, qp, kp, vp)
        run(*inputs, deterministic).backward()
        assert len(asked) == (2 if deterministic else 0)
        forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=32**-0.5)
        ref = reference_grads(forward, (q, k, v), dout)
        assert_grads([t.grad for t in inputs[:3]], ref, torch.float16)


def test_backward_ops_pass_opcheck():
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(1, 2, 1, 19, 19, 16, torch.float16, torch.device("cpu"), seed=71)
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True)
    for dlse in (None, torch.randn(lse.shape)):
        torch.library.opcheck(
            torch.ops.tunegen.attention_backward.default,
            (dout, q, k, v, out, lse, dlse, True, 0.25),
            test_utils=("test_schema", "test_faketensor"),
        )
    torch.library.opcheck(
        torch.ops.tunegen.attention.default,
        (*leaves(q, k, v), True, 0.25, False),
        test_utils=("test_autograd_registration",),
    )


def test_the_custom_op_without_lse_still_has_gradients():
    """torch.ops.tunegen.attention called directly with return_lse=False computes it again."""
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(1, 2, 1, 21, 21, 16, torch.float32, torch.device("cpu"), seed=81)
    q, k, v = leaves(q, k, v)
    out, _ = torch.ops.tunegen.attention(q, k, v, False, 0.3, False)
    out.backward(dout)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=False, scale=0.3)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), torch.float32)


def test_bad_gradients_are_rejected():
    q, k, v, dout = qkv_dout(1, 2, 1, 8, 8, 16, torch.float16, torch.device("cpu"), seed=0)
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"dout: expected the output's shape \(1, 2, 8, 16\)"):
        torch.ops.tunegen.attention_backward(dout[:, :, :4], q, k, v, out, lse, None, False, 0.25)
    with pytest.raises(ValueError, match=r"lse: expected the forward's log-sum-exp, shape \(1, 2, 8\)"):
        torch.ops.tunegen.attention_backward(dout, q, k, v, out, lse[:, :1], None, False, 0.25)
    with pytest.raises(ValueError, match=r"k: the number of query heads \(2\) must be a multiple"):
        tunegen.attention(*leaves(q, k.expand(1, 3, 8, 16), v.expand(1, 3, 8, 16)))


def test_a_log_sum_exp_laid_out_otherwise_gives_the_same_gradients():
    """The backward reads each row of the log-sum-exp as consecutive floats: one laid out
    (batch, seqlen, heads) in memory, as PyTorch's CPU flash op writes it, is read right."""
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(2, 4, 2, 23, 23, 32, torch.float32, torch.device("cpu"), seed=64)
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True)
    permuted = torch.empty_permuted(lse.shape, (0, 2, 1)).copy_(lse)
    assert permuted.stride(-1) != 1
    *grads, dsinks = torch.ops.tunegen.attention_backward(dout, q, k, v, out, permuted, None, True, 32**-0.5)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=32**-0.5)
    assert_grads(grads, reference_grads(forward, (q, k, v), dout), torch.float32)
    assert dsinks.numel() == 0  # no sinks


def test_a_padded_log_sum_exp_with_sinks_and_its_gradient_gives_the_right_gradients():
    """A log-sum-exp that is a view into a longer buffer (rows padded), with a gradient of its own
    and sinks: the backward addresses dlse and the sinks' scratch with the log-sum-exp's strides,
    which a dense copy of it has (before, the scratch was dense and the strides the view's)."""
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(2, 4, 2, 23, 23, 32, torch.float32, torch.device("cpu"), seed=65)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(66))
    out, lse = tunegen.attention(q, k, v, causal=True, window_size=(7, -1), sinks=sinks, return_lse=True)
    padded = torch.full((2, 4, 40), float("nan"))[:, :, :23].copy_(lse)
    dlse = torch.randn(2, 4, 23, generator=torch.Generator().manual_seed(67))
    grads = torch.ops.tunegen.attention_backward(
        dout, q, k, v, out, padded, dlse, True, 32**-0.5, False, 7, -1, 0, 0.0, sinks
    )
    local = Local(window_left=7, sinks=sinks)
    ref = local_reference_grads(q, k, v, dout, causal=True, scale=32**-0.5, local=local, dlse=dlse)
    assert_grads(grads, ref, torch.float32)


def test_a_retained_graph_gives_the_same_gradients_twice_and_frees_its_inputs_after(device):
    """`retain_graph` runs the backward again on the same graph (deterministic, so that both runs
    give the same bits); without it, the graph keeps no input once its backward ran, though its
    output lives on."""
    q0, k, v, dout = qkv_dout(2, 4, 2, 21, 30, 32, torch.float32, device, seed=71)
    q0, k, v = leaves(q0, k, v)
    q = q0 * 1.5
    out = tunegen.attention(q, k, v, causal=True, deterministic=True)
    first = torch.autograd.grad(out, (q0, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q0, k, v), dout)
    forward = lambda q0, k, v: attention_reference(q0 * 1.5, k, v, causal=True, scale=32**-0.5)
    assert_grads(first, reference_grads(forward, (q0, k, v), dout), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    alive = weakref.ref(q)
    del q
    gc.collect()
    assert alive() is None, "the graph kept q after its backward"
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, (q0, k, v), dout)
