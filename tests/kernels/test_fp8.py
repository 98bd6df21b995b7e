"""FP8 prefill: the Walsh-Hadamard rotation, e4m3 block scales, the FP8 kernel and its knobs
against float64 (tight on the dequantized inputs, within FP8's bounds on the original ones),
ragged shapes, GQA, causal, poisoned outputs, the public API and its refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import NEEDS_GPU

import tunegen
from helpers import LSE_TOL, assert_lse, rel_err
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import fp8
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import Gpu, gpu_of
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import FP8_TOLERANCE, attention_reference, tolerance
from tunegen.measure.bench_fp8 import fp8_speedups
from tunegen.measure.rows import Row
from tunegen.measure.suites import Shape, fp8_decode_suite

# P is rounded to e4m3 before the second product (about 2% on these inputs); bf16 P is ~0.5%.
P_E4M3_TOL, P_BF16_TOL = 3e-2, 1e-2
# Against the 16-bit inputs, e4m3's 3 mantissa bits on Q, K and V give about 5% on N(0, 1).
INPUT_TOL = 8e-2


def randn(*shape, gen, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(device, dtype)


def dequantized(x: fp8.Fp8Inputs) -> list[torch.Tensor]:
    return [fp8.dequantize(t, s) for t, s in zip(x[:3], x[3:], strict=True)]


@pytest.mark.parametrize(("d", "block"), [(16, 16), (64, 64), (128, 128), (80, 16), (96, 32), (192, 64)])
def test_hadamard_is_orthonormal_and_keeps_qk(d, block):
    h = fp8.hadamard_matrix(d).double()
    assert fp8.hadamard_block(d) == block
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-6)
    if block < d:
        assert torch.all(h[:block, block:] == 0), "block-diagonal for head dims that are not powers of two"
    gen = torch.Generator().manual_seed(d)
    q, k = randn(3, 5, d, gen=gen, dtype=torch.float64), randn(3, 7, d, gen=gen, dtype=torch.float64)
    qk = q @ k.transpose(-1, -2)
    assert float((q @ h @ (k @ h).transpose(-1, -2) - qk).abs().max()) < 1e-5 * float(qk.abs().max())
    assert torch.allclose(fp8.rotate(q), (q @ h).float(), atol=1e-5)
    outlier = torch.zeros(d, dtype=torch.float64)
    outlier[1] = 10.0
    spread = (outlier @ h)[:block]
    assert torch.allclose(spread.abs(), torch.full((block,), 10.0 / block**0.5, dtype=torch.float64))


@pytest.mark.parametrize("d", [40, 17, 8])
def test_hadamard_refuses_head_dims_without_a_16_block(d):
    with pytest.raises(ValueError, match=rf"hadamard: .* multiple of 16 .* got {d}"):
        fp8.hadamard_block(d)


@pytest.mark.parametrize("per_block", [True, False], ids=["blocks", "fa3"])
def test_scales_map_each_block_max_to_448_and_round_trip(per_block):
    gen = torch.Generator().manual_seed(1)
    q = randn(2, 4, 150, 32, gen=gen, dtype=torch.float16)
    q[:, :, 128:] *= 16  # the second block of rows is larger: its own scale
    q[0, 1, 3, 5] = 200.0  # an outlier
    k, v = randn(2, 2, 150, 32, gen=gen, dtype=torch.float16), randn(2, 2, 150, 32, gen=gen)
    x = tunegen.quantize_fp8(q, k, v.half(), hadamard=False, per_block=per_block)
    assert all(t.dtype == fp8.E4M3 for t in x[:3]) and all(s.dtype == torch.float32 for s in x[3:])
    if per_block:
        assert x.q_descale.shape == (2, 4, 2) and x.k_descale.shape == (2, 2, 2)
        blocks = torch.stack(
            [x.q[:, :, :128].float().abs().amax((2, 3)), x.q[:, :, 128:].float().abs().amax((2, 3))], -1
        )
    else:
        assert x.q_descale.shape == x.k_descale.shape == (2, 2)
        blocks = x.q.float().abs().view(2, 2, -1).amax(-1)
    assert x.v_descale.shape == (2, 2)
    assert torch.all(blocks == fp8.E4M3_MAX), "each block's largest magnitude maps to 448"
    assert torch.all(x.v.float().abs().reshape(2, 2, -1).amax(-1) == fp8.E4M3_MAX)
    for original, quantized, descale in ((q, x.q, x.q_descale), (k, x.k, x.k_descale)):
        back = fp8.dequantize(quantized, descale)
        step = fp8.dequantize(torch.ones_like(quantized, dtype=torch.float32), descale)
        # Half an e4m3 ulp: 2^-4 relative for normal values, 2^-10 (in e4m3 units) for subnormal ones.
        bound = 2.0**-4 * original.double().abs() + 2.0**-10 * step
        assert torch.all((back - original.double()).abs() <= bound * 1.0001)


VARIANTS = [
    prefill.PrefillVariant(block_m=32, block_n=32, num_stages=1),
    prefill.PrefillVariant(block_m=16, block_n=32, num_stages=1, p_fp8=False),
    prefill.PrefillVariant(block_m=64, block_n=32, num_stages=1, v_trans=True, causal_split=False),
    prefill.PrefillVariant(block_m=16, block_n=32, num_stages=1, v_trans=True, load="desc"),
    prefill.PrefillVariant(
        block_m=32, block_n=32, num_stages=2, load="desc", order="head_inner", reverse_m=True
    ),
]


def run_fp8(variant, x: fp8.Fp8Inputs, *, causal, scale, return_lse=True):
    """Launch one FP8 Variant directly, into outputs poisoned with NaN."""
    descales = (x.q_descale, x.k_descale, x.v_descale)
    call = PrefillCall(x.q, x.k, x.v, causal, scale, return_lse, descales=descales, out_dtype=torch.bfloat16)
    out, lse = call.outputs()
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))
    kernel = base.build(prefill.FAMILY, variant, call.problem(out), gpu_of(x.q.device))
    kernel.launch(call.args(out, lse))
    return out, lse


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"p_fp8={v.p_fp8}-v_trans={v.v_trans}-{v.load}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_matches_float64(device, variant, causal):
    gen = torch.Generator().manual_seed(11)
    q = randn(2, 4, 37, 48, gen=gen, device=device, dtype=torch.bfloat16)  # GQA 2, ragged, head dim 48
    k, v = (randn(2, 2, 45, 48, gen=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = tunegen.quantize_fp8(q, k, v)
    out, lse = run_fp8(variant, x, causal=causal, scale=0.2)
    ref, ref_lse = attention_reference(*dequantized(x), causal=causal, scale=0.2)
    assert rel_err(out, ref) < (P_E4M3_TOL if variant.p_fp8 else P_BF16_TOL)
    assert_lse(lse, ref_lse, torch.bfloat16)
    original, _ = attention_reference(q, k, v, causal=causal, scale=0.2)
    assert rel_err(out, original) < INPUT_TOL


def test_each_block_of_rows_uses_its_own_scale(device):
    """Scale blocks that differ 16-fold, more queries than keys (causal rows with no key give zeros),
    and FA3's per-head descales on the same inputs."""
    gen = torch.Generator().manual_seed(12)
    q = randn(1, 2, 150, 32, gen=gen, device=device)
    k, v = randn(1, 1, 140, 32, gen=gen, device=device), randn(1, 1, 140, 32, gen=gen, device=device)
    q[:, :, 128:] *= 16
    k[:, :, :128] /= 16
    for per_block in (True, False):
        x = tunegen.quantize_fp8(q, k, v, hadamard=False, per_block=per_block)
        for causal in (False, True):
            out, lse = run_fp8(
                prefill.PrefillVariant(block_m=32, block_n=32, num_stages=1), x, causal=causal, scale=0.1
            )
            ref, ref_lse = attention_reference(*dequantized(x), causal=causal, scale=0.1)
            assert rel_err(out, ref) < P_E4M3_TOL, (per_block, causal)
            assert_lse(lse, ref_lse, torch.bfloat16)
    assert torch.all(out[:, :, :10] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_public_api_quantizes_16_bit_inputs(device, dtype):
    gen = torch.Generator().manual_seed(13)
    q = randn(2, 4, 33, 64, gen=gen, device=device, dtype=dtype)
    k, v = (randn(2, 2, 41, 64, gen=gen, device=device, dtype=dtype) for _ in range(2))
    ref, ref_lse = attention_reference(q, k, v, causal=True, scale=64**-0.5)
    for hadamard in (None, False):
        out, lse = tunegen.attention(
            q, k, v, causal=True, precision="fp8", hadamard=hadamard, return_lse=True, strict=True
        )
        assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, 4, 33)
        assert rel_err(out, ref) < INPUT_TOL
        assert float((lse.double() - ref_lse).abs().max()) < 0.1
    x = tunegen.quantize_fp8(q, k, v)
    rotated = tunegen.attention(q, k, v, causal=True, precision="fp8", strict=True)
    assert torch.equal(rotated, tunegen.attention(**x._asdict(), causal=True).to(dtype)), (
        "quantize_fp8 is the same step"
    )


def test_public_api_takes_e4m3_inputs_with_fa3_descales(device):
    gen = torch.Generator().manual_seed(14)
    q = randn(2, 6, 29, 32, gen=gen, device=device)
    k, v = (randn(2, 3, 29, 32, gen=gen, device=device) for _ in range(2))
    x = tunegen.quantize_fp8(q, k, v, hadamard=False, per_block=False)
    out, lse = tunegen.attention(**x._asdict(), return_lse=True, strict=True)
    ref, ref_lse = attention_reference(*dequantized(x), causal=False, scale=32**-0.5)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < P_E4M3_TOL
    assert float((lse.double() - ref_lse).abs().max()) < LSE_TOL[torch.bfloat16]
    unscaled = tunegen.attention(x.q, x.k, x.v, scale=0.3)
    ref, _ = attention_reference(x.q.double(), x.k.double(), x.v.double(), causal=False, scale=0.3)
    assert rel_err(unscaled, ref) < P_E4M3_TOL, "descales default to 1"


def test_fp8_problems_are_their_own_key():
    gpu = Gpu("H100", (9, 0), 132, 232448, "", "", "cuda")
    plain = Problem("prefill", "bfloat16", 128, True, 32, 8, 1, 4096, 4096)
    fp8_problem = dataclasses.replace(plain, fp8=True)
    assert plain != fp8_problem and plain.to_json() != fp8_problem.to_json()
    space = prefill.FAMILY.search_space(fp8_problem, gpu)
    assert space["p_fp8"] == [True, False] and space["v_trans"] == [False, True]
    assert prefill.FAMILY.search_space(plain, gpu)["v_trans"] == [False]
    assert prefill.FAMILY.features(fp8_problem, gpu) != prefill.FAMILY.features(plain, gpu)


def _fp8_args():
    gen = torch.Generator().manual_seed(15)
    q, k, v = (randn(2, 4, 20, 32, gen=gen, dtype=torch.float16) for _ in range(3))
    return q, k[:, :2], v[:, :2]


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda q, k, v: ((q, k, v), {"precision": "int8"}),
            r"precision: expected None or 'fp8', got 'int8'",
        ),
        (
            lambda q, k, v: ((q.float(), k.float(), v.float()), {"precision": "fp8"}),
            r"q: expected dtype float16 or bfloat16",
        ),
        (
            lambda q, k, v: ((q, k, v), {"hadamard": True}),
            r"hadamard: the rotation applies to precision='fp8' only",
        ),
        (
            lambda q, k, v: ((q, k, v), {"q_descale": torch.ones(2, 2)}),
            r"q_descale: descales come with float8_e4m3fn q, k, v",
        ),
        (
            lambda q, k, v: ((q.requires_grad_(), k, v), {"precision": "fp8"}),
            r"precision: 'fp8' attention is not differentiable",
        ),
        (
            lambda q, k, v: ((q[..., :24], k[..., :24], v[..., :24]), {"precision": "fp8"}),
            r"hadamard: the rotation needs head_dim to be a multiple of 16",
        ),
        (lambda q, k, v: ((q.to(fp8.E4M3), k, v), {}), r"k: expected dtype float8_e4m3fn, got torch.float16"),
        (
            lambda q, k, v: (tuple(t.to(fp8.E4M3) for t in (q, k, v)), {"hadamard": True}),
            r"hadamard: q, k and v are float8_e4m3fn already",
        ),
        (
            lambda q, k, v: (tuple(t.to(fp8.E4M3) for t in (q, k, v)), {"q_descale": torch.ones(2, 4)}),
            r"q_descale: expected shape \(2, 2\) or \(2, 4, 1\), got \(2, 4\)",
        ),
        (
            lambda q, k, v: (
                tuple(t.to(fp8.E4M3) for t in (q, k, v)),
                {"v_descale": torch.ones(2, 2).half()},
            ),
            r"v_descale: expected a float32 tensor of shape \(2, 2\), got torch.float16 tensor",
        ),
    ],
)
def test_fp8_refuses_bad_arguments(change, pattern):
    args, kwargs = change(*_fp8_args())
    with pytest.raises(ValueError, match=pattern):
        tunegen.attention(*args, **kwargs)


def test_fp8_variants_are_checked():
    hopper = Gpu("H100", (9, 0), 132, 232448, "", "", "cuda")
    ampere = Gpu("A100", (8, 0), 108, 166912, "", "", "cuda")
    problem = Problem("prefill", "bfloat16", 128, False, 8, 8, 1, 1024, 1024, fp8=True)
    fam = prefill.FAMILY
    with pytest.raises(
        ValueError, match=r"problem.fp8: e4m3 tensor-core products need compute capability 8.9"
    ):
        fam.check_variant(fam.default_variant(problem, ampere), problem, ampere)
    with pytest.raises(
        ValueError, match=r"variant.block_m, variant.block_n: fp8 tiles must lie in one 128-row"
    ):
        fam.check_variant(prefill.PrefillVariant(block_m=256), problem, hopper)
    with pytest.raises(ValueError, match=r"variant.block_n: fp8 key tiles need at least 32 rows, got 16"):
        fam.check_variant(prefill.PrefillVariant(block_n=16), problem, gpu_of(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"variant.p_fp8, variant.v_trans: FP8 knobs"):
        plain = Problem("prefill", "bfloat16", 128, False, 8, 8, 1, 1024, 1024)
        fam.check_variant(prefill.PrefillVariant(v_trans=True), plain, hopper)
    fam.check_variant(fam.default_variant(problem, hopper), problem, hopper)


def test_bench_fp8_pairs_and_speedups():
    problems = fp8_decode_suite(batches=(64,), cache_lengths=(32768,), page_sizes=(0,))
    assert [p.fp8 for p in problems] == [False, True] and problems[0] == dataclasses.replace(
        problems[1], fp8=False
    )
    shape = Shape(1, 16, 16, 4096, 128, False)
    prefill_rows = [
        Row.of(impl, dtype, shape, ms, tflops, 0.01, "", "H100", "2026-11-22")
        for impl, dtype, ms, tflops in (
            ("tunegen-bf16", "bf16", 1.75, 400.0),
            ("tunegen-fp8", "fp8", 1.0, 700.0),
            ("tunegen-fp8-hadamard", "fp8", 1.1, 636.0),
            ("quantize-fp8", "fp8", 0.05, None),
        )
    ]
    decode_rows = [
        {"impl": "tunegen", "batch": 64, "seqlen_k": 32768, "page_size": 0, "fp8": fp8_cache, "ms": ms}
        for fp8_cache, ms in ((False, 3.4), (True, 1.8))
    ]
    prefill_speedup, decode_speedup = fp8_speedups(prefill_rows, decode_rows)
    assert prefill_speedup["speedup"] == pytest.approx(1.75) and prefill_speedup["unit"] == "TFLOP/s"
    assert prefill_speedup["end_to_end"] == pytest.approx(1.59) and prefill_speedup["quantize_share"] == 0.05
    assert decode_speedup["end_to_end"] is None
    assert (
        decode_speedup["speedup"] == pytest.approx(3.4 / 1.8) and decode_speedup["shape"] == "B64 cache 32768"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_fp8_needs_a_gpu():
    from click.testing import CliRunner

    from tunegen.cli.main import main

    result = CliRunner().invoke(main, ["bench", "fp8"])
    assert result.exit_code == 2 and "bench needs a CUDA GPU" in result.output


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_tuners_fp8_case_checks_the_kernel_it_times(causal):
    """The case a tuning trial runs: e4m3 inputs, a poisoned output until the launch, then an error
    within FP8's bound against float64 on the dequantized inputs."""
    problem = Problem("prefill", "bfloat16", 64, causal, 4, 2, 2, 48, 40, fp8=True, return_lse=True)
    gpu = gpu_of(torch.device("cpu"))
    kernel = base.build(prefill.FAMILY, prefill.FAMILY.default_variant(problem, gpu), problem, gpu)
    case = prefill.FAMILY.case(problem, kernel, torch.device("cpu"), seed=3)
    assert math.isnan(case.error()), "unwritten outputs read as NaN"
    case.launch()
    assert case.error() < tolerance(problem) and tolerance(problem) == FP8_TOLERANCE


@pytest.mark.gpu
@NEEDS_GPU
def test_the_tuners_fp8_case_has_sdpa_peers_in_bf16():
    """FP8 Problems are tuned against SDPA in bf16 on the same (dequantized) inputs: every SDPA
    backend can run them (V's K-major layout made contiguous) and passes the float64 check."""
    problem = Problem("prefill", "bfloat16", 128, True, 8, 8, 2, 512, 512, fp8=True)  # MHA: every backend
    case = prefill.FAMILY.case(problem, None, torch.device("cuda"), seed=5)
    assert sorted(case.peers) == ["sdpa-cudnn", "sdpa-efficient", "sdpa-flash"]
    for name, call in case.peers.items():
        assert case.peer_error(call()) < tolerance(problem), name


@pytest.mark.parametrize("per_block", [True, False], ids=["blocks", "fa3"])
def test_quantize_fp8_takes_strided_views(per_block):
    gen = torch.Generator().manual_seed(16)
    q, k, v = (randn(2, 19, h, 32, gen=gen, dtype=torch.bfloat16).transpose(1, 2) for h in (4, 2, 2))
    strided = tunegen.quantize_fp8(q, k, v, hadamard=False, per_block=per_block)
    copied = tunegen.quantize_fp8(*(t.contiguous() for t in (q, k, v)), hadamard=False, per_block=per_block)
    for a, b in zip(strided, copied, strict=True):
        assert torch.equal(a.float(), b.float())


def test_pytorch_fallback_computes_fp8_attention_on_the_dequantized_inputs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TUNEGEN_STRICT", raising=False)
    gen = torch.Generator().manual_seed(17)
    q, k, v = (randn(2, 4, 30, 32, gen=gen, dtype=torch.float16) for _ in range(3))
    out, lse = tunegen.attention(q, k, v, causal=True, precision="fp8", return_lse=True)
    ref, ref_lse = attention_reference(
        *dequantized(tunegen.quantize_fp8(q, k, v)), causal=True, scale=32**-0.5
    )
    assert out.dtype == torch.float16 and rel_err(out, ref) < 2e-3
    assert_lse(lse, ref_lse, torch.float16)
    with pytest.raises(tunegen.FallbackError):
        tunegen.attention(q, k, v, precision="fp8", strict=True)
