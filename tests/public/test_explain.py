"""`tunegen.explain` takes exactly the arguments of the call it explains, refuses any other by
name, and explains the kernel that call runs: FP8 calls their FP8 kernel, calls recorded by
autograd the forward that keeps its log-sum-exp."""

from __future__ import annotations

import pytest
import torch
from conftest import NEEDS_INTERPRETER

import tunegen
from tunegen.kernels import dispatch

pytestmark = pytest.mark.usefixtures("user_db")


def _qkv(n: int = 40, d: int = 32, dtype=torch.float16):
    q = torch.randn(1, 4, n, d, dtype=dtype)
    k, v = (torch.randn(1, 2, n, d, dtype=dtype) for _ in range(2))
    return q, k, v


def _packed():
    q, k, v = (torch.randn(50, h, 32, dtype=torch.float16) for h in (4, 2, 2))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"causel": True}, "causel: tunegen.attention takes no such argument"),
        ((), {"cu_seqlens_q": None}, "cu_seqlens_q: tunegen.attention takes no such argument"),
        ((True,), {}, "too many positional arguments"),
        ((), {"window": (4, 0)}, "window: tunegen.attention takes no such argument"),
    ],
)
def test_explain_refuses_arguments_attention_does_not_take(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tunegen.explain(*_qkv(), *args, **kwargs)


def test_explain_refuses_arguments_attention_varlen_does_not_take():
    q, k, v, cu = _packed()
    with pytest.raises(ValueError, match=r"precision: tunegen\.attention_varlen takes no such argument"):
        tunegen.explain(q, k, v, cu, cu, 30, 30, precision="fp8")
    with pytest.raises(ValueError, match="missing a required argument: 'max_seqlen_k'"):
        tunegen.explain(q, k, v, cu, cu, 30)


@NEEDS_INTERPRETER
def test_explain_takes_varlen_sizes_by_position_or_by_name():
    q, k, v, cu = _packed()
    by_position = tunegen.explain(q, k, v, cu, cu, 30, 30, causal=True)
    sizes = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 30, "max_seqlen_k": 30}
    by_name = tunegen.explain(q, k, v, **sizes, causal=True)
    assert by_position == by_name and by_position["problem"]["varlen"]


@NEEDS_INTERPRETER
@pytest.mark.parametrize("given", ["precision", "e4m3"])
def test_explain_explains_the_fp8_kernel_of_an_fp8_call(given):
    q, k, v = _qkv(d=64)
    if given == "e4m3":
        x = tunegen.quantize_fp8(q, k, v)
        args, kwargs = (x.q, x.k, x.v), {"q_descale": x.q_descale, "k_descale": x.k_descale}
    else:
        args, kwargs = (q, k, v), {"precision": "fp8"}
    info = tunegen.explain(*args, causal=True, **kwargs)
    assert info["problem"]["fp8"] and info["problem"]["dtype"] == "bfloat16"
    plain = tunegen.explain(q, k, v, causal=True)
    assert not plain["problem"]["fp8"], "the same tensors without precision explain the 16-bit kernel"
    dispatch.forget()
    tunegen.attention(*args, causal=True, **kwargs)
    served = [problem.as_dict() for problem, _ in dispatch._CHOICES]
    assert served == [info["problem"]], "explain names the Problem the call dispatched"


@NEEDS_INTERPRETER
def test_explain_under_autograd_explains_the_forward_that_keeps_its_lse():
    q, k, v = _qkv()
    assert not tunegen.explain(q, k, v)["problem"]["return_lse"]
    q.requires_grad_()
    assert tunegen.explain(q, k, v)["problem"]["return_lse"], "the backward needs the log-sum-exp"
    with torch.no_grad():
        assert not tunegen.explain(q, k, v)["problem"]["return_lse"]
    dispatch.forget()
    tunegen.attention(q, k, v)
    assert [p.as_dict() for p, _ in dispatch._CHOICES] == [tunegen.explain(q, k, v)["problem"]]


def test_explain_checks_fp8_arguments_as_the_call_does():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="precision: expected None or 'fp8'"):
        tunegen.explain(q, k, v, precision="fp16")
    with pytest.raises(ValueError, match="q_descale: descales come with float8_e4m3fn"):
        tunegen.explain(q, k, v, q_descale=torch.ones(1, 2))
