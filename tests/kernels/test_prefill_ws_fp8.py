"""The prefill family's Hopper schedule ("ws") on FP8 inputs: the Variants its register budget
admits (CPU), and on an sm_90 GPU every knob against float64 on the dequantized inputs, FA3's
descales and row-major V."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_prefill_ws import INSTALLED, PROBLEM, WS, _inputs

import tunegen
from helpers import H100, HOPPER, rel_err, ws_shapes
from tunegen.kernels.families import prefill
from tunegen.kernels.reference import attention_reference

FP8 = dataclasses.replace(PROBLEM, fp8=True, return_lse=True)
FP8_LSE_TOL = 1.5e-2


@pytest.mark.parametrize(
    ("d", "changes", "reason"),
    [
        (128, {}, None),
        (128, {"num_stages": 4}, None),  # e4m3 K and V tiles take half the shared memory
        (128, {"block_m": 128, "consumers": 1, "pingpong": False}, "registers"),
        (64, {"block_m": 128, "block_n": 64, "consumers": 1, "pingpong": False}, None),
        (64, {"consumers": 3}, "registers"),  # an e4m3 P tile costs a 16-bit one's registers
        (64, {"consumers": 3, "overlap": False}, None),
    ],
)
def test_ws_takes_fp8_within_its_budget(d, changes, reason):
    variant, problem = dataclasses.replace(WS, **changes), dataclasses.replace(FP8, head_dim=d)
    found = prefill.FAMILY.constraint(variant, problem, H100)
    assert (found is None) if reason is None else (reason in found), found
    assert "ws" in prefill.FAMILY.search_space(FP8, H100)["schedule"]
    with pytest.raises(ValueError, match=r"problem\.varlen: fp8 prefill takes \(batch, heads"):
        prefill.FAMILY.check_variant(WS, dataclasses.replace(FP8, varlen=True), H100)
    with pytest.raises(ValueError, match=r"variant\.mask_branch: fp8 masks its scores after scaling"):
        prefill.FAMILY.check_variant(dataclasses.replace(WS, mask_branch=True), FP8, H100)
    assert prefill.FAMILY.search_space(FP8, H100)["mask_branch"] == [False]


FP8_KNOBS = [
    WS,
    dataclasses.replace(WS, pingpong=False),
    dataclasses.replace(WS, overlap=False, num_stages=3),
    dataclasses.replace(WS, block_n=64, num_stages=4, persistent=True),
    dataclasses.replace(WS, block_n=64, consumers=1, pingpong=False, ctas_per_sm=2, order="grouped"),
    dataclasses.replace(WS, consumers=3, overlap=False, persistent=True, order="head_inner"),
    dataclasses.replace(WS, persistent=True, dynamic=True, order="grouped", reverse_m=True, q_stages=2),
]


def _fp8_check(variant, x, causal, scale=0.3):
    """One FP8 Variant into poisoned outputs against float64 on the dequantized inputs."""
    from test_fp8 import P_E4M3_TOL, dequantized, run_fp8

    out, lse = run_fp8(variant, x, causal=causal, scale=scale)
    ref, ref_lse = attention_reference(*dequantized(x), causal=causal, scale=scale)
    assert rel_err(out, ref) < P_E4M3_TOL
    # Hopper's e4m3 wgmma sums the scores in reduced precision (FlashAttention-3 runs it so too):
    # the log-sum-exp measured 5e-3 off at head dim 128 (1.5e-3 at 64), beyond the 16-bit bound.
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and not lse.isnan().any()
    assert float((lse.double() - ref_lse)[seen].abs().max()) < FP8_LSE_TOL
    return out


@pytest.mark.parametrize("variant", FP8_KNOBS, ids=lambda v: v.to_json())
@ws_shapes
def test_every_ws_knob_in_fp8_against_float64(variant, causal, nq, nk, d):
    """e4m3 inputs from tunegen.quantize_fp8 (per-block scales, rotated, V K-major), ragged, GQA."""
    if prefill.FAMILY.constraint(variant, dataclasses.replace(FP8, head_dim=d), INSTALLED):
        pytest.skip("outside the constraint at this head dim on this Triton")
    q, k, v = _inputs(2, 4, 2, nq, nk, d, torch.bfloat16, seed=nq * 5 + nk + d)
    x = tunegen.quantize_fp8(q, k, v)
    out = _fp8_check(variant, x, causal)
    if causal and nq > nk:
        assert torch.all(out[:, :, : nq - nk] == 0)


def _key_groups_of(k8, fill):
    """k8 copied into quantize_fp8's K layout (heads of whole 16-row groups), its padding rows
    holding the byte `fill` (0x7F: e4m3's NaN)."""
    b, h, n, d = k8.shape
    rows = -(-n // 16) * 16
    groups = torch.full((b, h, rows, d), fill, dtype=torch.uint8, device=k8.device).view(k8.dtype)
    groups[:, :, :n] = k8
    return groups[:, :, :n]


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("nk", [1100, 1104, 9], ids=str)
def test_ws_fp8_reads_k_in_any_layout(nk):
    """K as quantize_fp8 writes it (heads of whole 16-row groups, read in place), with NaN bytes in
    its padding rows (masked, never seen), contiguous (in place where 16 divides the length, else
    copied), in (batch, seqlen, heads) memory (copied): the same bits every way. GQA, both masks."""
    variant = dataclasses.replace(WS, overlap=False, persistent=True)
    if prefill.FAMILY.constraint(variant, dataclasses.replace(FP8, head_dim=128), INSTALLED):
        pytest.skip("the Hopper schedule takes no FP8 on this Triton")
    x = tunegen.quantize_fp8(*_inputs(2, 4, 2, 300, nk, 128, torch.bfloat16, seed=nk))
    layouts = [
        _key_groups_of(x.k, 0x7F),
        x.k.contiguous(),
        x.k.transpose(1, 2).contiguous().transpose(1, 2),
    ]
    for causal in (False, True):
        a = _fp8_check(variant, x, causal)
        for k8 in layouts:
            assert torch.equal(a, _fp8_check(variant, x._replace(k=k8), causal))


@pytest.mark.gpu
@HOPPER
def test_ws_fp8_takes_fa3_descales_and_row_major_v():
    """One descale per (batch, KV head), V as users pass it (row-major, transposed by the launcher),
    MQA, a persistent grid of several waves; and the public call on 16-bit inputs (alone on a
    release whose Hopper schedule takes no FP8, where it runs FlashAttention-2's loop)."""
    q, k, v = _inputs(3, 8, 1, 1100, 1100, 128, torch.bfloat16, seed=21)
    x = tunegen.quantize_fp8(q, k, v, per_block=False)
    runs_fp8 = prefill.FAMILY.constraint(WS, dataclasses.replace(FP8, head_dim=128), INSTALLED) is None
    dynamic = dataclasses.replace(
        WS, persistent=True, dynamic=True, q_stages=2, order="grouped", reverse_m=True
    )
    for variant in (WS, dataclasses.replace(WS, persistent=True), dynamic) if runs_fp8 else ():
        for causal in (False, True):
            a = _fp8_check(variant, x, causal)
            b = _fp8_check(variant, x._replace(v=x.v.contiguous()), causal)
            assert torch.equal(a, b)
    for causal in (False, True):
        out = tunegen.attention(q, k, v, causal=causal, precision="fp8", strict=True)
        ref, _ = attention_reference(q, k, v, causal=causal, scale=128**-0.5)
        assert rel_err(out, ref) < 8e-2
