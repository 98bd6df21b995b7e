"""The launcher: launch keys, one bind per key, the generic path where kernels do not launch
directly, and (on the GPU) direct launches that give exactly what Triton's own path gives."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl
from conftest import NEEDS_GPU, NEEDS_INTERPRETER

import tunegen
from tunegen.kernels import dispatch, launcher


@triton.jit
def _scaled_copy(X, Y, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * alpha, mask=offs < n)


def test_the_key_tells_apart_what_a_compiled_kernel_depends_on():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    assert launcher.key_of(a, None, 3) == launcher.key_of(b, None, 3), "values do not matter"
    assert launcher.key_of(a) != launcher.key_of(a.T), "strides do"
    assert launcher.key_of(a) != launcher.key_of(a.half()), "dtypes do"
    assert launcher.key_of(a) != launcher.key_of(a[:, :7]), "shapes do"
    misaligned = torch.randn(33)[1:].view(4, 8)
    assert launcher.key_of(a) != launcher.key_of(misaligned), "16-byte alignment does"
    assert launcher.key_of(a, 3) != launcher.key_of(a, 4), "other arguments by value"


def test_memoized_binds_once_per_key():
    bound = []

    def bind(x, scale):
        bound.append(x.shape)
        return lambda x, scale: x.mul_(scale)

    launch = launcher.memoized(bind, lambda x, scale: launcher.key_of(x))
    x = torch.ones(3)
    launch(x, 2.0)
    launch(torch.ones(3), 5.0)
    assert bound == [torch.Size([3])] and torch.equal(x, torch.full((3,), 2.0))
    launch(torch.ones(4), 2.0)
    assert len(bound) == 2


@NEEDS_INTERPRETER
def test_off_the_gpu_a_bound_launch_is_tritons_ordinary_launch():
    assert not launcher.direct_launches()
    x = torch.randn(100)
    y = torch.full_like(x, float("nan"))
    run = launcher.bound(_scaled_copy, (4,), (x, y, 2.0, 100, 32), device=x.device)
    run(x, y, 3.0, 100, 32)
    assert torch.equal(y, x * 3.0)


def test_constexprs_go_in_the_arguments_not_the_options():
    x = torch.randn(8)
    with pytest.raises(ValueError, match=r"options: \['BLOCK'\] are parameters of the kernel"):
        launcher.bound(_scaled_copy, (1,), (x, x, 1.0, 8), device=x.device, BLOCK=8)


def test_generic_launches_on_request(monkeypatch):
    monkeypatch.setenv("TUNEGEN_LAUNCH", "generic")
    assert not launcher.direct_launches()


def test_rebased_descriptors_keep_everything_but_the_base():
    @dataclasses.dataclass
    class Descriptor:
        base: torch.Tensor
        shape: list
        block_shape: list

        def __post_init__(self):
            raise AssertionError("the constructor's checks do not run again")

    template = object.__new__(Descriptor)
    template.__dict__.update(base=torch.zeros(2), shape=[2], block_shape=[2])
    other = torch.ones(2)
    copy = launcher.rebased(template, other)
    assert type(copy) is Descriptor and copy.base is other and copy.shape == [2]
    assert template.base is not other


@pytest.mark.gpu
@NEEDS_GPU
def test_direct_launches_match_tritons_own_path_in_every_family(monkeypatch):
    """Prefill (both schedules where the GPU has them), decode with a split and new tokens, and the
    backward: bitwise the same outputs through the direct launch and Triton's generic one."""
    gen = torch.Generator().manual_seed(3)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to("cuda", dtype)

    q, k, v = randn(2, 8, 333, 128), randn(2, 2, 333, 128), randn(2, 2, 333, 128)
    qd, kc, vc = randn(3, 1, 8, 64), randn(3, 256, 2, 64), randn(3, 256, 2, 64)
    kn, vn = randn(3, 1, 2, 64), randn(3, 1, 2, 64)
    lengths = torch.tensor([5, 100, 200], dtype=torch.int32, device="cuda")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = randn(*q.shape)

    def results():
        dispatch.forget()
        caches = kc.clone(), vc.clone()
        out = [tunegen.attention(q, k, v, causal=c) for c in (False, True)]
        out.append(tunegen.decode_attention(qd, *caches, lengths, k=kn, v=vn))
        out.extend(caches)
        for t in (qg, kg, vg):
            t.grad = None
        tunegen.attention(qg, kg, vg, causal=True).backward(dout)
        return [*out, qg.grad, kg.grad, vg.grad]

    direct = results()
    monkeypatch.setenv("TUNEGEN_LAUNCH", "generic")
    generic = results()
    for a, b in zip(direct, generic, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@NEEDS_GPU
def test_profilers_launch_hooks_see_bound_launches():
    seen = []
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    run = launcher.bound(_scaled_copy, (8,), (x, y, 2.0, 1000, 128), device=x.device)
    run(x, y, 2.0, 1000, 128)
    hook = lambda metadata: seen.append(metadata.get()["name"])
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        run(x, y, 4.0, 1000, 128)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    run(x, y, 3.0, 1000, 128)
    torch.cuda.synchronize()
    assert seen == ["_scaled_copy"] and torch.equal(y, x * 3.0)


@pytest.mark.gpu
@NEEDS_GPU
def test_a_warm_decode_call_never_waits_for_the_device():
    """No device-to-host copy per call: with CUDA's sync debug mode set to error, repeated decode
    calls (contiguous and paged, with new tokens) run without a synchronizing operation, each
    from its input signature's bound call."""
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(8, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([10, 50], dtype=torch.int32, device="cuda")
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device="cuda")
    contiguous = (kc[:2].clone(), vc[:2].clone())
    paged = (kc.view(32, 16, 2, 64), vc.view(32, 16, 2, 64))
    calls = [
        lambda: tunegen.decode_attention(q, *contiguous, lengths, k=kn, v=vn),
        lambda: tunegen.decode_attention(q, *paged, lengths, block_table=table),
    ]
    dispatch.forget()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(dispatch.fast_calls) == len(calls), "repeat calls, new tokens or not, take the fast path"


def test_split_tail_shares_the_last_wave_in_runs_shorter_than_a_tile():
    """Past the whole waves, the tiles' steps go to more programs than tiles (each run spans at
    most two tiles) in runs of SPLIT_STEPS_MIN steps at least; whole waves split nothing."""
    grid = itertools.product((1, 5, 131, 132, 133, 272, 2048), (4, 132), (1, 8, 66, 256))
    for tiles, programs, walk in grid:
        split, sharers = launcher.split_tail(tiles, programs, walk)
        rest = tiles % programs
        if (split, sharers) == (0, 0):
            assert rest == 0 or rest * walk // launcher.SPLIT_STEPS_MIN <= rest
            continue
        assert split == tiles % programs and split < sharers <= programs
        assert split * walk // sharers >= launcher.SPLIT_STEPS_MIN and split * walk / sharers < walk
    assert launcher.split_tail(2048, 132, 256) == (68, 132)
    assert launcher.split_tail(264, 132, 256) == (0, 0)
