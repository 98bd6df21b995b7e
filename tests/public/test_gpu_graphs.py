"""Under CUDA graph capture: a warmed-up call captures and replays correctly on new inputs."""

from __future__ import annotations

import pytest
import torch

import tunegen
from helpers import REL_TOL, rel_err
from tunegen.kernels.reference import attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_cuda_graph_capture_and_replay(varlen):
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 4, 77, 64, generator=gen).cuda().half() for _ in range(3))
    cu = torch.tensor([0, 77, 154], dtype=torch.int32, device="cuda")

    def call():
        if varlen:
            packed = [t.transpose(1, 2).reshape(154, 4, 64) for t in (q, k, v)]
            return tunegen.attention_varlen(*packed, cu, cu, 77, 77, causal=True)
        return tunegen.attention(q, k, v, causal=True)

    call()  # compile outside the capture, as with any Triton kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (1, 2):
        fresh = torch.Generator().manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=fresh))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got = out.view(2, 77, 4, 64).transpose(1, 2) if varlen else out
        ref, _ = attention_reference(q, k, v, causal=True, scale=64**-0.5)
        assert rel_err(got, ref) < REL_TOL[torch.float16]


def test_the_fast_path_serves_repeat_calls_and_keeps_them_correct():
    from tunegen.kernels import dispatch

    dispatch.forget()
    gen = torch.Generator().manual_seed(32)
    q, k, v = (torch.randn(2, 4, 50, 64, generator=gen).cuda().half() for _ in range(3))
    tunegen.attention(q, k, v, causal=True)
    assert len(dispatch.fast_calls) == 1
    for seed in (1, 2):
        fresh = torch.Generator().manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=fresh))
        out = tunegen.attention(q, k, v, causal=True)
        ref, _ = attention_reference(q, k, v, causal=True, scale=64**-0.5)
        assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert len(dispatch.fast_calls) == 1, "repeat calls hit the fast path"
    tunegen.attention(q.float(), k.float(), v.float(), causal=True)
    assert len(dispatch.fast_calls) == 2, "another dtype is another entry"
    with pytest.raises(ValueError, match=r"k: expected dtype torch\.float16 like q"):
        tunegen.attention(q, k.float(), v, causal=True)
