"""The backward family's kernels against float64 autograd of the reference: every knob, launched
directly into poisoned gradients, varlen with empty sequences, the tuning case, the space and its
constraints, dispatch of a backward Winner, broadcast or unaligned gradients, the command line."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import tunegen
from helpers import H100 as RELEASED_H100
from helpers import (
    assert_grads,
    dispatch_interprets,
    leaves,
    packed,
    qkv_dout,
    reference_grads,
    run_backward_variant,
)
from tunegen.calls.backward import BackwardCall
from tunegen.calls.prefill import PrefillCall, Varlen
from tunegen.kernels import dispatch
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families import backward, base, get
from tunegen.kernels.gpu import Gpu, interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import TOLERANCE, attention_reference, attention_varlen_reference
from tunegen.tuning_db import Store, WinnerRecord

Variant = backward.BackwardVariant


pytestmark = pytest.mark.usefixtures("user_db")


KNOBS = [
    Variant(16, 16, 16, 16, num_warps=4, num_stages=1),
    Variant(32, 16, 16, 32, num_warps=4, num_stages=2, dq_num_warps=2, dq_num_stages=3),
    Variant(16, 32, 16, 32, num_warps=4, num_stages=1, dq_mode="atomic"),
    Variant(32, 16, num_warps=2, num_stages=3, dq_mode="atomic", persistent=True, order="heaviest_first"),
    Variant(16, 32, num_warps=4, num_stages=1, dq_mode="partial", order="heaviest_first"),
    Variant(32, 16, 16, 32, num_warps=4, num_stages=1, dq_mode="concurrent", persistent=True),
    Variant(16, 32, 32, 16, num_warps=4, num_stages=2, dq_mode="concurrent", order="heaviest_first"),
    Variant(16, 32, 32, 16, num_warps=4, num_stages=1, fuse_delta=True, load="desc"),
    Variant(32, 16, 16, 32, num_warps=4, num_stages=1, load="desc", persistent=True, order="heaviest_first"),
    Variant(16, 16, num_warps=4, num_stages=1, dq_mode="partial", load="desc", persistent=True),
]


@pytest.mark.parametrize("variant", KNOBS, ids=lambda v: v.to_json())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_knob_is_correct(device, variant, causal):
    """Tiles taller or wider than each other; dQ in its own pass, in the dK/dV launch, by atomics or
    by per-key-tile shares; delta fused into the dQ pass; pointer or descriptor loads; either
    program order; persistent grids: the same gradients."""
    if variant.load == "desc" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("tensor descriptors need compute capability 9.0")
    q, k, v, dout = qkv_dout(2, 4, 2, 45, 37, 40, torch.float16, device, seed=7)
    grads = run_backward_variant(variant, q, k, v, dout, causal=causal, scale=0.3)
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=0.3)
    assert_grads(grads, reference_grads(forward, (q, k, v), dout), torch.float16)


VARLEN_KNOBS = {
    "atomic": Variant(16, 16, num_warps=4, num_stages=1, dq_mode="atomic"),
    "partial": Variant(16, 32, num_warps=4, num_stages=1, dq_mode="partial", persistent=True),
    "concurrent-desc": Variant(16, 16, 16, 16, num_warps=4, num_stages=1, dq_mode="concurrent", load="desc"),
    "fused-delta-desc": Variant(16, 16, 16, 16, num_warps=4, num_stages=1, fuse_delta=True, load="desc"),
}


@pytest.mark.parametrize("knobs", ["default", *VARLEN_KNOBS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gradients_match_float64(device, knobs, causal):
    """Ragged packed sequences with an empty query sequence and an empty key sequence, GQA."""
    lq, lk = [37, 0, 20, 9], [30, 12, 33, 0]
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 48, torch.float16, device, seed=31)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(32)).to(device, q.dtype)
    forward = lambda q, k, v: attention_varlen_reference(q, k, v, cu_q, cu_k, causal=causal, scale=48**-0.5)
    ref = reference_grads(forward, (q, k, v), dout)
    if knobs == "default":  # through the public function and dispatch's default Variant
        q, k, v = leaves(q, k, v)
        tunegen.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal).backward(dout)
        grads = (q.grad, k.grad, v.grad)
    else:
        sizes = Varlen(cu_q, cu_k, max(lq), max(lk))
        grads = run_backward_variant(
            VARLEN_KNOBS[knobs], q, k, v, dout, causal=causal, scale=48**-0.5, varlen=sizes
        )
    assert_grads(grads, ref, torch.float16)
    no_queries = slice(int(cu_k[1]), int(cu_k[2]))  # the keys of the empty query sequence
    assert torch.all(grads[1][no_queries] == 0) and torch.all(grads[2][no_queries] == 0)


# A Winner that adds dQ by atomics, as the database would serve it.
ATOMIC_DQ = Variant(16, 16, 16, 16, num_warps=4, num_stages=1, dq_mode="atomic")


def _atomic_dq_winner(tmp_path, monkeypatch, seed, causal, batch):
    """Inputs, the backward Problem of attention over them and the interpreter Gpu, with ATOMIC_DQ
    recorded as that Problem's Winner in a fresh database."""
    if not dispatch_interprets():
        pytest.skip("CPU kernels need the interpreter")
    q, k, v, dout = qkv_dout(
        batch,
        4,
        2,
        20 if causal else 37,
        20 if causal else 37,
        16,
        torch.float16,
        torch.device("cpu"),
        seed=seed,
    )
    forward = PrefillCall(q, k, v, causal, 0.25, True)
    problem = BackwardCall(forward, *forward.reference(), dout, None).problem()
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    monkeypatch.setenv("TUNEGEN_DB", url)
    gpu = interpreter_gpu()
    with Store(url) as store:
        winner = (gpu_record(gpu), "backward", problem.as_dict(), ATOMIC_DQ.as_dict(), 1.0, 1e-3)
        store.record_winner(WinnerRecord(*winner, gpu.triton_version, torch_version="2", template_hash="h"))
    return (*leaves(q, k, v), dout), problem, gpu


def test_dispatch_serves_a_backward_winner(tmp_path, monkeypatch):
    """The backward Problem of a call is looked up like any other: a recorded Winner is served."""
    (q, k, v, dout), problem, gpu = _atomic_dq_winner(tmp_path, monkeypatch, 91, causal=True, batch=1)
    tunegen.attention(q, k, v, causal=True).backward(dout)
    choice = dispatch.choice_for(problem, gpu)
    assert choice.source == "winner" and choice.kernel.variant == ATOMIC_DQ
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=0.25)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), torch.float16)


def test_deterministic_algorithms_get_a_fixed_order_dq(tmp_path, monkeypatch):
    """Under torch.use_deterministic_algorithms, a Winner that adds dQ by atomics is served as
    its fixed-order form (dQ by a pass of its own), with the right gradients; without, as tuned."""
    (q, k, v, dout), problem, gpu = _atomic_dq_winner(tmp_path, monkeypatch, 92, causal=False, batch=2)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        tunegen.attention(q, k, v).backward(dout)
    finally:
        torch.use_deterministic_algorithms(was)
    assert (problem, gpu) in dispatch._DETERMINISTIC
    served = dispatch.deterministic_kernel_for(problem, gpu).variant
    assert (
        served == ATOMIC_DQ.replace(dq_mode="separate")
        and dispatch.kernel_for(problem, gpu).variant == ATOMIC_DQ
    )
    forward = lambda q, k, v: attention_reference(q, k, v, causal=False, scale=0.25)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), torch.float16)


def test_each_family_names_its_fixed_order_form():
    """The backward's atomic dQ and the Hopper schedule's unordered adds change (within the
    family's constraint; the Hopper schedule's to the writer warp's adds); nothing else does."""
    family = get("backward")
    problem = Problem("backward", "bfloat16", 128, True, 16, 4, 2, 4096, 4096)
    ws = backward.BackwardVariant(dkdv_block_m=64, dkdv_block_n=128, num_warps=8, num_stages=2, schedule="ws")
    for dq_write in ("tma", "atomic"):
        tuned = ws.replace(dq_write=dq_write)
        fixed = tuned.replace(deterministic=True, dq_write="tma")
        assert family.deterministic(tuned, problem, RELEASED_H100) == fixed
    for mode in ("separate", "concurrent", "partial"):
        loops = Variant(dq_mode=mode)
        assert family.deterministic(loops, problem, H100) is loops
    assert family.deterministic(Variant(dq_mode="atomic"), problem, H100) == Variant(dq_mode="separate")
    wide = Problem("backward", "float32", 256, False, 4, 4, 2, 1024, 1024)
    tuned = Variant(16, 16, num_warps=4, num_stages=1, dq_mode="atomic")
    assert family.constraint(tuned, wide, H100) is None
    assert family.constraint(tuned.replace(dq_mode="separate"), wide, H100) is not None
    fixed = family.deterministic(tuned, wide, H100)
    assert fixed.dq_mode != "atomic" and family.constraint(fixed, wide, H100) is None
    for problem in (
        Problem("prefill", "float16", 64, True, 4, 2, 2, 128, 128),
        Problem("decode", "float16", 64, False, 4, 2, 2, 1, 4096),
    ):
        default = get(problem.family).default_variant(problem, H100)
        assert get(problem.family).deterministic(default, problem, H100) is default


def test_the_tuning_case_checks_and_poisons():
    """The family's case: NaN before the launch, within tolerance after; 2.5x forward FLOPs."""
    family = get("backward")
    gpu = interpreter_gpu()
    problem = Problem("backward", "float16", 24, True, 4, 2, 2, 32, 32, varlen=True)
    kernel = base.build(family, family.default_variant(problem, gpu), problem, gpu)
    case = family.case(problem, kernel, torch.device("cpu"), seed=3)
    assert case.error() != case.error()
    case.launch()
    assert case.error() < TOLERANCE["float16"]
    unit, flops = family.measure(problem)
    assert unit == "TFLOP/s" and flops == 2.5 * problem.flops()


H100 = Gpu("H100", (9, 0), 132, 232448, "", "", "cuda")


A100 = Gpu("A100", (8, 0), 108, 166912, "", "", "cuda")


@pytest.mark.parametrize("gpu", [H100, A100, interpreter_gpu()], ids=lambda g: g.name)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_defaults_and_space_are_valid(gpu, dtype, d):
    family = get("backward")
    problem = Problem("backward", dtype, d, True, 32, 8, 2, 4096, 4096)
    assert family.constraint(family.default_variant(problem, gpu), problem, gpu) is None
    space = family.search_space(problem, gpu)
    default = family.default_variant(problem, gpu)
    fields = Variant.__dataclass_fields__
    # Knobs the space holds take one of its values; the others (another schedule's) keep their defaults.
    assert all(
        value in space[name] if name in space else value == fields[name].default
        for name, value in default.as_dict().items()
    )


def test_bad_variants_and_constraints():
    with pytest.raises(ValueError, match="dkdv_block_m: expected a power of two"):
        Variant(dkdv_block_m=24)
    with pytest.raises(ValueError, match="dq_mode: expected one of"):
        Variant(dq_mode="fused")
    with pytest.raises(ValueError, match="variant: expected a BackwardVariant"):
        get("backward").check_variant(get("prefill").variant_type(), None, H100)
    with pytest.raises(ValueError, match="fuse_delta: the dQ pass computes delta only in its own launch"):
        Variant(dq_mode="concurrent", fuse_delta=True)
    with pytest.raises(ValueError, match="dq_num_warps: expected 1, 2, 4, 8 or 16"):
        Variant(dq_num_warps=3)
    problem = Problem("backward", "bfloat16", 256, False, 8, 8, 1, 4096, 4096)
    family = get("backward")
    long = dataclasses.replace(problem, seqlen_q=8192, seqlen_k=8192)
    assert "'partial' would keep 8.0 GiB" in family.constraint(
        Variant(32, 64, num_warps=8, dq_mode="partial"), long, H100
    )
    unaligned = dataclasses.replace(problem, aligned=False)
    assert "'desc' needs 16-byte aligned" in family.constraint(Variant(load="desc"), unaligned, H100)
    assert "compute capability 9.0" in family.constraint(Variant(load="desc"), problem, A100)
    assert "float32 needs 'ptr'" in family.constraint(
        Variant(load="desc"), dataclasses.replace(problem, dtype="float32"), H100
    )
    assert "shared memory" in family.constraint(Variant(64, 256, 64, 32, num_stages=4), problem, H100)
    spilling = Variant(16, 128, 64, 16, num_warps=4, num_stages=1)
    assert "registers" in family.constraint(spilling, problem, H100)


def test_the_dq_passes_knobs_apply_only_where_it_runs():
    """The tuner's grid never holds two Variants that differ only in knobs their kernels ignore:
    the dQ pass's tiles without a dQ pass, its own warps and stages or the fused delta outside a
    launch of its own; the program order only under a causal mask."""
    family = get("backward")
    problem = Problem("backward", "bfloat16", 128, False, 8, 8, 1, 4096, 4096)
    space = family.search_space(problem, H100)
    assert list(space)[:2] == ["schedule", "dq_mode"] and space["order"] == ["natural"]
    assert "desc" in space["load"] and "desc" not in family.search_space(problem, A100)["load"]
    defaults = Variant()
    for variant in itertools.islice(base.grid(family, space), 0, None, 97):
        if variant.dq_mode in ("atomic", "partial"):
            assert (variant.dq_block_m, variant.dq_block_n) == (defaults.dq_block_m, defaults.dq_block_n)
        if variant.dq_mode != "separate":
            assert variant.dq_num_warps == defaults.dq_num_warps
            assert variant.dq_num_stages == defaults.dq_num_stages
            assert not variant.fuse_delta


def test_broadcast_or_unaligned_gradients_take_pointer_loads(device):
    """dout as out.sum() makes it (a broadcast) and inputs at an odd offset: the Problem is marked
    unaligned, so the default Variant reads through pointers, and the gradients are right."""
    from tunegen.calls.backward import descriptor_ready

    q, k, v, _ = qkv_dout(1, 2, 1, 24, 24, 16, torch.float16, device, seed=61)
    assert descriptor_ready(q, k, v)
    assert not descriptor_ready(q, k, v, torch.ones(1, 1, 1, 16, device=device).expand(q.shape))
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape).copy_(q)
    assert not descriptor_ready(odd, k, v)
    odd, k, v = leaves(odd, k, v)
    tunegen.attention(odd, k, v, causal=True).sum().backward()
    forward = lambda q, k, v: attention_reference(q, k, v, causal=True, scale=0.25)
    ref = reference_grads(forward, (odd, k, v), torch.ones(q.shape, device=device))
    assert_grads((odd.grad, k.grad, v.grad), ref, torch.float16)


def test_command_line():
    """`tunegen render backward` prints the kernels and the tile functions they call; the benchmark
    suite is the prefill's, and `tunegen bench backward` needs a GPU."""
    from click.testing import CliRunner

    from tunegen.cli.main import main
    from tunegen.measure.suites import backward_suite

    result = CliRunner().invoke(main, ["render", "backward", "--head-dim", "80", "--causal", "--varlen"])
    assert result.exit_code == 0, result.output
    for kernel in ("attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "_dkdv_tile", "_dq_tile"):
        assert f"def {kernel}(" in result.output
    suite = backward_suite(seqlens=(1024, 16384), head_dims=(128,))
    assert {(p.family, p.batch, p.num_heads_q, p.seqlen_q, p.causal) for p in suite} == {
        ("backward", b, 16, n, c) for b, n in ((16, 1024), (1, 16384)) for c in (False, True)
    }
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, ["bench", "backward"])
        assert result.exit_code != 0 and "needs a CUDA GPU" in result.output
