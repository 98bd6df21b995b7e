"""tunegen as PyTorch's flash-attention provider: registered on import, never active until asked;
active, SDPA's flash ops and `varlen_attn` run tunegen forward and backward (against float64
autograd, GQA, ragged lengths); what it refuses runs PyTorch's own kernel, counted with the
reason (or raises in strict mode); restoring gives PyTorch's kernels and SDPA's priorities back.
On the CPU these run under the interpreter, where tunegen also takes CPU SDPA's flash op."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import NEEDS_GPU, NEEDS_INTERPRETER

import tunegen
from helpers import assert_grads, assert_lse, leaves, packed, qkv_dout, reference_grads, rel_err
from tunegen import flash_provider
from tunegen.backends import FallbackError
from tunegen.kernels.reference import attention_reference, attention_varlen_reference
from tunegen.unserved import flash_lse

attention = pytest.importorskip("torch.nn.attention")
if not hasattr(attention, "register_flash_attention_impl"):
    pytest.skip("this torch has no registry of flash-attention implementations", allow_module_level=True)
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

pytestmark = pytest.mark.usefixtures("user_db")
FLASH = int(attention.SDPBackend.FLASH_ATTENTION)


@pytest.fixture
def active():
    """The provider active for one test; restored after it."""
    attention.activate_flash_attention_impl("tunegen")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def _counts(op: str) -> tuple[int, dict[str, int]]:
    routing = tunegen.explain()
    return routing["served"].get(op, 0), dict(routing["refused"].get(op, {}))


def _sdpa_ops(device: torch.device) -> tuple[str, str]:
    """SDPA's flash forward and backward ops on `device`."""
    op = "_scaled_dot_product_flash_attention" + ("_for_cpu" if device.type == "cpu" else "")
    return op, op + "_backward"


def test_registered_on_import_and_active_only_when_asked():
    code = (
        "import torch.nn.attention as a, tunegen; "
        "print('tunegen' in a.list_flash_attention_impls(), a.current_flash_attention_impl(), "
        "tunegen.explain()['active'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "None", "False"]


def test_activation_puts_flash_first_and_restoring_gives_everything_back():
    # PyTorch settles its order at a process's first CUDA SDPA call (cuDNN first on Hopper), and
    # activation has that happen first: restoring gives back the settled order.
    flash_provider._settle_priority()
    before = list(torch._C._get_sdp_priority_order())
    attention.activate_flash_attention_impl("tunegen")
    try:
        assert torch._C._get_sdp_priority_order()[0] == FLASH
        assert tunegen.explain()["active"]
    finally:
        attention.restore_flash_attention_impl()
    assert list(torch._C._get_sdp_priority_order()) == before
    assert not tunegen.explain()["active"]
    attention.activate_flash_attention_impl("tunegen")  # twice in a row: the second replaces the first
    attention.activate_flash_attention_impl("tunegen")
    attention.restore_flash_attention_impl()
    assert list(torch._C._get_sdp_priority_order()) == before


def _sdpa_inputs(device, dtype, batch, hq, hkv, nq, nk, d, seed):
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("SDPA's flash backend takes 16-bit inputs on CUDA")
    return qkv_dout(batch, hq, hkv, nq, nk, d, dtype, device, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("causal", "batch", "hq", "hkv", "nq", "nk", "d"),
    [
        (True, 2, 4, 2, 37, 37, 64),  # GQA, ragged length, batch > 1
        (False, 1, 3, 1, 45, 23, 40),  # MQA, more queries than keys
        (False, 2, 2, 2, 19, 50, 17),  # odd head dim (SDPA pads it to 24 for the flash op)
    ],
)
def test_sdpa_runs_tunegen_forward_and_backward(device, active, dtype, causal, batch, hq, hkv, nq, nk, d):
    q, k, v, dout = _sdpa_inputs(device, dtype, batch, hq, hkv, nq, nk, d, seed=nq + d)
    q, k, v = leaves(q, k, v)
    forward_op, backward_op = _sdpa_ops(device)
    served = _counts(forward_op)[0], _counts(backward_op)[0]
    scale = 0.7 / d**0.5
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv)
    out.backward(dout)
    assert (_counts(forward_op)[0], _counts(backward_op)[0]) == (served[0] + 1, served[1] + 1), "tunegen ran"
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=scale)
    ref, _ = forward(*(t.detach().double() for t in (q, k, v)))
    assert out.dtype == dtype and rel_err(out.detach(), ref) < (2e-3 if dtype == torch.float16 else 1e-5)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_attn_runs_tunegen_forward_and_backward(device, active, causal):
    """Causal is FlashAttention's window (-1, 0), aligned bottom-right: sequences of unequal
    lengths, one longer on the query side, GQA where this torch lets varlen_attn take it."""
    gqa = "enable_gqa" in varlen_attn.__code__.co_varnames
    hq, hkv, d = (4, 2, 32) if gqa else (3, 3, 32)
    dtype = torch.float16
    q, k, v, cu_q, cu_k = packed([5, 31, 17], [9, 30, 17], hq, hkv, d, dtype, device, seed=3 + causal)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    q, k, v = leaves(q, k, v)
    extra = {"enable_gqa": True} if gqa else {}
    window = (-1, 0) if causal else (-1, -1)
    served = _counts("_flash_attention_forward")[0], _counts("_flash_attention_backward")[0]
    out, lse = varlen_attn(
        q, k, v, cu_q, cu_k, 31, 30, window_size=window, return_aux=_lse_request(), **extra
    )
    out.backward(dout)
    after = _counts("_flash_attention_forward")[0], _counts("_flash_attention_backward")[0]
    assert after == (served[0] + 1, served[1] + 1), "tunegen ran forward and backward"
    forward = lambda q, k, v: attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=d**-0.5)
    ref, ref_lse = forward(*(t.detach().double() for t in (q, k, v)))
    assert rel_err(out.detach(), ref) < 2e-3
    assert_lse(lse.detach(), flash_lse(ref_lse), dtype)  # FlashAttention's +inf where no key is seen
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), dtype)


def _lse_request():
    from torch.nn.attention.varlen import AuxRequest

    return AuxRequest(lse=True)


def test_the_flash_op_in_its_own_layout_and_in_place(device, active):
    """aten's flash forward on (batch, seqlen, heads, head_dim), and its in-place form (what
    varlen_attn_out calls) writing every element of an output poisoned with NaN."""
    q, k, v, _ = qkv_dout(2, 4, 2, 29, 29, 32, torch.float16, device, seed=11)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    served = _counts("_flash_attention_forward")[0]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 29, 29, 0.0, True, False)
    assert _counts("_flash_attention_forward")[0] == served + 1
    ref, ref_lse = attention_reference(
        *(t.transpose(1, 2).double() for t in (q, k, v)), causal=True, scale=32**-0.5
    )
    assert out.shape == q.shape and rel_err(out.transpose(1, 2), ref) < 2e-3
    assert_lse(lse, ref_lse, torch.float16)
    if not hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):
        return
    op = "_flash_attention_forward_no_dropout_inplace"
    served = _counts(op)[0]
    poisoned = torch.full_like(q, float("nan"))
    lse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(
        poisoned, q, k, v, None, None, 29, 29, 0.0, True, False
    )
    assert _counts(op)[0] == served + 1
    assert rel_err(poisoned.transpose(1, 2), ref) < 2e-3
    assert_lse(lse, ref_lse, torch.float16)
    packed_q, packed_k, packed_v, cu_q, cu_k = packed(
        [5, 0, 14], [9, 3, 14], 4, 2, 32, torch.float16, device, 12
    )
    poisoned = torch.full_like(packed_q, float("nan"))
    lse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(
        poisoned, packed_q, packed_k, packed_v, cu_q, cu_k, 14, 14, 0.0, False, False, window_size_right=0
    )
    ref, ref_lse = attention_varlen_reference(
        *(t.double() for t in (packed_q, packed_k, packed_v)), cu_q, cu_k, causal=True, scale=32**-0.5
    )
    assert rel_err(poisoned, ref) < 2e-3, "packed, causal by FlashAttention's window (-1, 0)"
    assert_lse(lse, flash_lse(ref_lse), torch.float16)


@NEEDS_INTERPRETER
def test_what_tunegen_refuses_runs_pytorchs_kernel_counted(active):
    """SDPA's causal mask of unequal lengths is top-left, tunegen's bottom-right: that call, and
    one with a mask, run PyTorch's CPU kernel, counted with the reason."""
    q, k, v, _ = qkv_dout(2, 4, 2, 19, 30, 32, torch.float32, torch.device("cpu"), seed=13)
    op = "_scaled_dot_product_flash_attention_for_cpu"
    served, refused = _counts(op)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    top_left = torch.ones(19, 30, dtype=torch.bool).tril()
    mask = torch.randn(19, 30, generator=torch.Generator().manual_seed(1)) > 0
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    after_served, after_refused = _counts(op)
    assert after_served == served, "neither call ran tunegen"
    reason = "is_causal: SDPA aligns a causal mask of unequal lengths top-left, tunegen bottom-right"
    assert after_refused.get(reason, 0) == refused.get(reason, 0) + 1
    assert (
        after_refused.get("attn_mask: tunegen takes no mask", 0)
        == refused.get("attn_mask: tunegen takes no mask", 0) + 1
    )
    k2, v2 = (t.repeat_interleave(2, dim=1).double() for t in (k, v))
    for got, allowed in ((out, top_left), (masked, mask)):
        scores = (q.double() @ k2.transpose(-1, -2)) * 32**-0.5
        ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v2
        assert rel_err(got, ref) < 1e-5


@NEEDS_INTERPRETER
def test_a_refusal_without_a_pytorch_kernel_or_in_strict_mode_is_an_error(active, monkeypatch):
    q, k, v, cu_q, cu_k = packed([5, 9], [5, 9], 2, 2, 32, torch.float16, torch.device("cpu"), seed=4)
    with pytest.raises(RuntimeError, match="window_size_left: sliding windows are not served yet"):
        varlen_attn(q, k, v, cu_q, cu_k, 9, 9, window_size=(4, 0))
    monkeypatch.setenv("TUNEGEN_STRICT", "1")
    q, k, v, _ = qkv_dout(1, 2, 2, 7, 12, 32, torch.float32, torch.device("cpu"), seed=5)
    with pytest.raises(FallbackError, match="strict mode: aten::_scaled_dot_product_flash_attention_for_cpu"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)


@NEEDS_INTERPRETER
def test_restored_pytorch_kernels_run_again():
    q, k, v, _ = qkv_dout(1, 2, 2, 7, 7, 32, torch.float32, torch.device("cpu"), seed=6)
    op = "_scaled_dot_product_flash_attention_for_cpu"
    attention.activate_flash_attention_impl("tunegen")
    attention.restore_flash_attention_impl()
    counts = _counts(op)
    F.scaled_dot_product_attention(q, k, v)
    assert _counts(op) == counts


@pytest.mark.gpu
@NEEDS_GPU
def test_the_first_sdpa_call_of_a_process_runs_tunegen():
    """PyTorch settles SDPA's priority order at a process's first CUDA SDPA call (cuDNN first on
    Hopper): activated before it, the provider still serves that call, and the ones after."""
    code = (
        "import torch, torch.nn.functional as F, tunegen; "
        "torch.nn.attention.activate_flash_attention_impl('tunegen'); "
        "q = torch.randn(2, 4, 37, 64, device='cuda', dtype=torch.float16); "
        "k = torch.randn(2, 2, 37, 64, device='cuda', dtype=torch.float16); "
        "[F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True) for _ in range(2)]; "
        "print(tunegen.explain()['served'].get('_scaled_dot_product_flash_attention', 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "2"


@pytest.mark.gpu
@NEEDS_GPU
def test_sdpa_through_the_provider_under_torch_compile_and_a_cuda_graph(active):
    """Compiled, SDPA's flash op is an extern call that runs tunegen at run time, gradients
    included; a warmed-up call captured in a CUDA graph replays correctly on new inputs."""
    q, k, v, dout = qkv_dout(2, 8, 2, 300, 300, 128, torch.bfloat16, torch.device("cuda"), seed=21)
    q, k, v = leaves(q, k, v)
    served = (
        _counts("_scaled_dot_product_flash_attention")[0],
        _counts("_scaled_dot_product_flash_attention_backward")[0],
    )
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        fullgraph=True,
    )
    out = compiled(q, k, v)
    out.backward(dout)
    after = (
        _counts("_scaled_dot_product_flash_attention")[0],
        _counts("_scaled_dot_product_flash_attention_backward")[0],
    )
    assert after == (served[0] + 1, served[1] + 1), "the compiled graph called tunegen's kernels"
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=128**-0.5)
    ref, _ = forward(*(t.detach().double() for t in (q, k, v)))
    assert rel_err(out.detach(), ref) < 1.6e-2
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), torch.bfloat16)
    x = [t.detach().clone() for t in (q, k, v)]
    call = lambda: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    served = _counts("_scaled_dot_product_flash_attention")[0]
    with torch.cuda.graph(graph):
        captured = call()
    assert _counts("_scaled_dot_product_flash_attention")[0] == served + 1, "the captured call is tunegen's"
    for seed in (1, 2):
        fresh = torch.Generator().manual_seed(seed)
        for t in x:
            t.copy_(torch.randn(t.shape, generator=fresh))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_reference(*(t.double() for t in x), causal=True, scale=128**-0.5)
        assert rel_err(captured, ref) < 1.6e-2


@NEEDS_INTERPRETER
def test_a_keyword_argument_of_a_later_torch_is_served_only_where_it_asks_for_nothing():
    from tunegen import flash_provider

    kernel = flash_provider._kernel("_scaled_dot_product_flash_attention", flash_provider.sdpa_forward, None)
    q, k, v, _ = qkv_dout(1, 2, 2, 9, 9, 16, torch.float32, torch.device("cpu"), seed=7)
    out, lse, *_ = kernel(None, q, k, v, 0.0, True, False, scale=0.25, new_feature=None)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, scale=0.25)
    assert rel_err(out, ref) < 1e-5
    assert_lse(lse, ref_lse, torch.float32)
    with pytest.raises(
        RuntimeError, match="new_feature: an argument of aten::_scaled_dot_product_flash_attention"
    ):
        kernel(None, q, k, v, 0.0, True, False, new_feature=3)
    op = "_flash_attention_forward_no_dropout_inplace"
    into = flash_provider._kernel(op, flash_provider.flash_forward_into, None)
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    with pytest.raises(RuntimeError, match=f"new_feature: an argument of aten::{op}"):
        into(None, torch.empty_like(bshd[0]), *bshd, None, None, 9, 9, 0.0, True, False, new_feature=3)


def test_restoring_keeps_a_priority_order_set_since():
    """An sdpa_kernel(set_priority=True) entered before activation and left while active restored
    its own order: restoring tunegen keeps that order rather than an older one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    default = list(torch._C._get_sdp_priority_order())
    order = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        attention.activate_flash_attention_impl("tunegen")
    attention.restore_flash_attention_impl()
    assert list(torch._C._get_sdp_priority_order()) == default


@NEEDS_INTERPRETER
def test_cpu_outputs_take_the_layout_pytorchs_cpu_op_declares():
    """Compiled code may rely on the strides the op's meta function declares: the log-sum-exp
    (batch, seqlen, heads) in memory, the gradients (batch, seqlen, heads, head_dim)."""
    q, k, v, dout = qkv_dout(2, 4, 4, 11, 11, 16, torch.float32, torch.device("cpu"), seed=8)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def strides():
        out, lse = op(q, k, v, 0.0, True)
        grads = backward(dout, q, k, v, out, lse, 0.0, True)
        return [t.stride() for t in (out, lse, *grads)]

    theirs = strides()
    attention.activate_flash_attention_impl("tunegen")
    try:
        served = _counts("_scaled_dot_product_flash_attention_for_cpu")[0]
        ours = strides()
        assert _counts("_scaled_dot_product_flash_attention_for_cpu")[0] == served + 1
    finally:
        attention.restore_flash_attention_impl()
    assert ours == theirs
