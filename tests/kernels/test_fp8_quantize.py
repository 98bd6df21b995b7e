"""The fused rotate-and-quantize kernel behind `tunegen.quantize_fp8` against its PyTorch reference
(`tunegen.kernels.fp8.quantize_reference`, itself checked against float64 in test_fp8.py): every output
element and descale, into outputs poisoned first, at ragged lengths, GQA, head dims that are not
powers of two, both scale layouts, with and without the rotation; V's K-major layout as the
attention kernels take it; the refusals."""

from __future__ import annotations

import pytest
import torch

import tunegen
from tunegen.kernels import fp8, quantize
from tunegen.kernels.reference import attention_reference

SHAPES = [  # batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim
    (2, 4, 2, 200, 333, 64),
    (1, 3, 1, 130, 70, 80),
    (3, 2, 2, 17, 129, 32),
]


def inputs(shape, dtype, device, seed):
    batch, hq, hkv, nq, nk, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, d, generator=gen) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    q[0, 0, 3, 5] = 60.0  # an outlier feature, which the rotation spreads
    k[-1, -1, -1, 1] = -40.0
    v[0, -1, 2, 7] = 30.0
    return (t.to(device, dtype) for t in (q, k, v))


def poisoned(q, k, per_block):
    out = quantize.outputs(q, k, per_block=per_block)
    for t in out[:3]:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
    for t in out[3:]:
        t.fill_(float("nan"))
    return out


def assert_matches_reference(x: fp8.Fp8Inputs, ref: fp8.Fp8Inputs, *, exact: bool) -> None:
    """Equal descales and e4m3 values; or not `exact`, within a relative 1e-3 on the descales and
    one e4m3 step on at most 1% of the elements."""
    for name, got, want in zip(fp8.Fp8Inputs._fields, x, ref, strict=True):
        assert got.shape == want.shape, name
        got, want = got.double(), want.double()
        assert not got.isnan().any(), f"{name}: elements left unwritten"
        if exact:
            assert torch.equal(got, want), (name, float((got - want).abs().max()))
        elif name.endswith("descale"):
            assert torch.allclose(got, want, rtol=1e-3), name
        else:
            step = 2.0**-3 * want.abs() + 2.0**-9
            assert torch.all((got - want).abs() <= step * 1.001), name
            assert float((got != want).double().mean()) < 0.01, name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("hadamard", "per_block"), [(True, True), (True, False), (False, True)])
def test_kernel_writes_what_the_reference_computes(device, shape, dtype, hadamard, per_block):
    q, k, v = inputs(shape, dtype, device, seed=sum(shape))
    out = poisoned(q, k, per_block)
    quantize.quantize_into(q, k, v, out, hadamard=hadamard, per_block=per_block)
    ref = fp8.quantize_reference(q.cpu(), k.cpu(), v.cpu(), hadamard=hadamard, per_block=per_block)
    # The rotation sums in another order than torch.matmul (on a GPU, float32 in TF32, and it
    # divides approximately), which moves an e4m3 rounding now and then.
    exact = device.type == "cpu" and not hadamard
    assert_matches_reference(fp8.Fp8Inputs(*(t.cpu() for t in out)), ref, exact=exact)


def test_strided_views_and_the_public_call(device):
    q, k, v = inputs((2, 4, 2, 150, 150, 64), torch.bfloat16, device, seed=3)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (B, N, H, D) memory
    x = tunegen.quantize_fp8(*views)
    ref = fp8.quantize_reference(q.cpu(), k.cpu(), v.cpu(), hadamard=True, per_block=True)
    assert_matches_reference(fp8.Fp8Inputs(*(t.cpu() for t in x)), ref, exact=False)
    assert fp8.is_k_major(x.v) and x.v.shape == v.shape and x.v.stride(3) == 160  # 150 padded to 16 bytes
    assert x.q.is_contiguous() and x.k.stride() == (2 * 160 * 64, 160 * 64, 64, 1)  # whole 16-row groups


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_reads_k_major_and_row_major_v_alike(device, causal):
    """The FP8 kernels serve V as quantize_fp8 writes it (K-major) and as users may pass it."""
    q, k, v = inputs((2, 4, 2, 70, 90, 64), torch.bfloat16, device, seed=4)
    x = tunegen.quantize_fp8(q, k, v)
    row_major = x._replace(v=x.v.contiguous())
    out = tunegen.attention(**x._asdict(), causal=causal, strict=True)
    again = tunegen.attention(**row_major._asdict(), causal=causal, strict=True)
    values = [fp8.dequantize(t, s) for t, s in zip(x[:3], x[3:], strict=True)]
    ref, _ = attention_reference(*values, causal=causal, scale=64**-0.5)
    assert float((out.double() - ref).norm() / ref.norm()) < 3e-2
    assert torch.equal(out, again)


def test_refusals_name_the_argument():
    q = torch.randn(1, 2, 16, 40)
    with pytest.raises(ValueError, match="hadamard: the rotation needs head_dim to be a multiple of 16"):
        tunegen.quantize_fp8(q, q, q)
    with pytest.raises(ValueError, match="v: expected dtype"):
        tunegen.quantize_fp8(q, q, q.double(), hadamard=False)
    e4m3 = torch.zeros(1, 2, 16, 32).to(fp8.E4M3)
    strided = torch.zeros(1, 2, 16, 64).to(fp8.E4M3)[..., ::2]
    with pytest.raises(ValueError, match=r"v: the last dimension \(head_dim\) or seqlen \(K-major\) must"):
        tunegen.attention(e4m3, e4m3, strided)
    with pytest.raises(ValueError, match=r"k: the last dimension \(head_dim\) must have stride 1"):
        tunegen.attention(e4m3, e4m3.transpose(2, 3).contiguous().transpose(2, 3), e4m3)
