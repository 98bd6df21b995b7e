"""Bad input: a ValueError naming the argument and what was expected, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import tunegen


def qkv(b=1, hq=4, hkv=2, n=8, d=16, dtype=torch.float16):
    return (
        torch.randn(b, hq, n, d, dtype=dtype),
        torch.randn(b, hkv, n, d, dtype=dtype),
        torch.randn(b, hkv, n, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda q, k, v: (q[0], k, v), r"q: expected 4 dimensions"),
        (lambda q, k, v: (q, k[..., :8], v), r"k: expected head_dim 16 like q"),
        (lambda q, k, v: (q, k, v[..., :8]), r"v: expected head_dim 16 like q"),
        (lambda q, k, v: (q[:, :3], k, v), r"k: the number of query heads \(3\) must be a multiple"),
        (lambda q, k, v: (q, k, v[:, :1]), r"v: expected 2 heads like k"),
        (lambda q, k, v: (q, k.float(), v), r"k: expected dtype torch.float16 like q"),
        (lambda q, k, v: (q.to(torch.int32), k, v), r"q: expected dtype float16, bfloat16 or float32"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), r"q: expected dtype float16"),
        (lambda q, k, v: (q[:, :, :0], k, v), r"q: every dimension must be non-zero"),
        (lambda q, k, v: (q, k, v[:, :, :4]), r"v: expected seqlen 8 like k"),
        (lambda q, k, v: (q, torch.cat([k, k]), v), r"k: expected batch 1 like q"),
        (lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v), r"q: the last dimension"),
        (lambda q, k, v: (q.numpy(), k, v), r"q: expected a torch.Tensor"),
        (
            lambda q, k, v: (
                torch.randn(1, 2, 4, 300).half(),
                torch.randn(1, 2, 4, 300).half(),
                torch.randn(1, 2, 4, 300).half(),
            ),
            r"q: head_dim must be at most 256",
        ),
    ],
)
def test_attention_rejects(mutate, pattern):
    with pytest.raises(ValueError, match=pattern):
        tunegen.attention(*mutate(*qkv()))


@pytest.mark.skipif(
    not torch.backends.mps.is_available() and not torch.cuda.is_available(), reason="one device"
)
def test_mixed_devices_rejected():
    q, k, v = qkv()
    other = "cuda" if torch.cuda.is_available() else "mps"
    with pytest.raises(ValueError, match=r"k: expected device cpu like q"):
        tunegen.attention(q, k.to(other), v)


def test_mixed_devices_rejected_on_meta():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v: expected device cpu like q, got meta"):
        tunegen.attention(q, k, v.to("meta"))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "0.1", True, 1e-40])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=r"scale: expected None or a positive finite float"):
        tunegen.attention(*qkv(), scale=scale)


def packed(lq=(3, 5), lk=(4, 6)):
    cu_q = torch.tensor([0, lq[0], lq[0] + lq[1]], dtype=torch.int32)
    cu_k = torch.tensor([0, lk[0], lk[0] + lk[1]], dtype=torch.int32)
    return (
        torch.randn(sum(lq), 4, 16).half(),
        torch.randn(sum(lk), 2, 16).half(),
        torch.randn(sum(lk), 2, 16).half(),
        cu_q,
        cu_k,
        max(lq),
        max(lk),
    )


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda a: (a[0][None], *a[1:]), r"q: expected 3 dimensions"),
        (lambda a: (*a[:3], a[3].long(), *a[4:]), r"cu_seqlens_q: expected a 1-D int32 tensor"),
        (lambda a: (*a[:4], [0, 4, 10], *a[5:]), r"cu_seqlens_k: expected a 1-D int32 tensor"),
        (
            lambda a: (*a[:3], torch.tensor([0, 6, 3], dtype=torch.int32), *a[4:]),
            r"cu_seqlens_q: offsets must not decrease",
        ),
        (
            lambda a: (*a[:3], torch.tensor([1, 3, 8], dtype=torch.int32), *a[4:]),
            r"cu_seqlens_q: expected the first offset to be 0",
        ),
        (
            lambda a: (*a[:4], torch.tensor([0, 4, 9], dtype=torch.int32), *a[5:]),
            r"cu_seqlens_k: expected the last offset to equal the token count 10",
        ),
        (
            lambda a: (*a[:4], torch.tensor([0, 10], dtype=torch.int32), *a[5:]),
            r"cu_seqlens_k: expected 3 offsets like cu_seqlens_q",
        ),
        (lambda a: (*a[:5], 4, a[6]), r"max_seqlen_q: a sequence has 5 tokens, more than 4"),
        (lambda a: (*a[:6], 0), r"max_seqlen_k: expected a positive int"),
        (
            lambda a: (*a[:3], torch.tensor([0], dtype=torch.int32), *a[4:]),
            r"cu_seqlens_q: expected at least 2 offsets",
        ),
        (lambda a: (a[0], a[1][:, :1], *a[2:]), r"v: expected 1 heads like k|v: expected 2 heads"),
    ],
)
def test_varlen_rejects(mutate, pattern):
    with pytest.raises(ValueError, match=pattern):
        tunegen.attention_varlen(*mutate(packed()))
