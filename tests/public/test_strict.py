"""Which path runs: the Triton kernel (compiled or interpreted) or the PyTorch fallback, which
strict mode refuses so that a benchmark can never time the wrong thing."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import REL_TOL, rel_err
from tunegen.backends import backend_for
from tunegen.kernels.reference import attention_reference, attention_varlen_reference


def _qkv():
    gen = torch.Generator().manual_seed(9)
    return tuple(torch.randn(2, 4, 21, 32, generator=gen).half() for _ in range(3))


def test_interpreter_is_used_when_asked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_for(torch.device("cpu"), strict=True) == "interpreter"


def test_fallback_without_interpreter_is_correct(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
    assert backend_for(torch.device("cpu")) == "torch"
    q, k, v = _qkv()
    out, lse = tunegen.attention(q, k, v, causal=True, return_lse=True)
    ref, _ref_lse = attention_reference(q, k, v, causal=True, scale=32**-0.5)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    out = tunegen.attention_varlen(*packed, cu, cu, 12, 12, causal=True)
    ref, _ = attention_varlen_reference(*packed, cu, cu, causal=True, scale=32**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_refuses_the_fallback(monkeypatch, how):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = {}
    if how == "argument":
        kwargs["strict"] = True
    else:
        monkeypatch.setenv("TUNEGEN_STRICT", "1")
    with pytest.raises(tunegen.FallbackError, match="strict mode: no Triton kernel runs on cpu"):
        tunegen.attention(*_qkv(), **kwargs)
    cu = torch.tensor([0, 21], dtype=torch.int32)
    packed = [t[0].transpose(0, 1).contiguous() for t in _qkv()]
    with pytest.raises(tunegen.FallbackError):
        tunegen.attention_varlen(*packed, cu, cu, 21, 21, **kwargs)


def test_strict_false_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TUNEGEN_STRICT", "1")
    assert backend_for(torch.device("cpu"), strict=False) == "torch"
