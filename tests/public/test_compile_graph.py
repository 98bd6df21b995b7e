"""torch.compile(fullgraph=True) traces tunegen as one custom op, with the right shapes."""

from __future__ import annotations

import os

import pytest
import torch

import tunegen
from helpers import REL_TOL, assert_lse, rel_err
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need the interpreter"
)


def test_fullgraph_compile_of_attention():
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 4, 37, 32, generator=gen).half()
    k = torch.randn(2, 2, 37, 32, generator=gen).half()
    v = torch.randn(2, 2, 37, 32, generator=gen).half()

    def block(q, k, v):
        out, lse = tunegen.attention(q * 2, k, v, causal=True, return_lse=True)
        return out.float().relu(), lse, tunegen.attention(q, k, v, scale=0.5)

    torch._dynamo.reset()
    out, lse, plain = torch.compile(block, fullgraph=True)(q, k, v)
    ref, ref_lse = attention_reference(q * 2, k, v, causal=True, scale=32**-0.5)
    assert rel_err(out, ref.relu()) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
    ref_plain, _ = attention_reference(q, k, v, causal=False, scale=0.5)
    assert rel_err(plain, ref_plain) < REL_TOL[torch.float16]


def test_fullgraph_compile_of_attention_varlen():
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(50, 4, 32, generator=gen).half()
    k = torch.randn(50, 2, 32, generator=gen).half()
    v = torch.randn(50, 2, 32, generator=gen).half()
    cu = torch.tensor([0, 13, 50], dtype=torch.int32)

    def block(q, k, v, cu):
        return tunegen.attention_varlen(q, k, v, cu, cu, 37, 37, causal=True) + 1

    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True)(q, k, v, cu)
    ref, _ = attention_varlen_reference(q, k, v, cu, cu, causal=True, scale=32**-0.5)
    assert rel_err(out - 1, ref) < REL_TOL[torch.float16]


def test_the_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 2, 19, 16, generator=gen).half()
    k = torch.randn(1, 1, 19, 16, generator=gen).half()
    v = torch.randn(1, 1, 19, 16, generator=gen).half()
    for return_lse in (False, True):
        torch.library.opcheck(
            torch.ops.tunegen.attention.default,
            (q, k, v, True, 0.25, return_lse),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_bad_input_is_still_rejected_under_compile():
    q = torch.randn(1, 3, 8, 16).half()
    k = torch.randn(1, 2, 8, 16).half()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"number of query heads \(3\) must be a multiple"):
        torch.compile(lambda q, k: tunegen.attention(q, k, k), fullgraph=True)(q, k)
