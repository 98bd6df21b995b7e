"""The prefill kernel against float64: every feature, every knob, ragged sizes, poisoned outputs."""

from __future__ import annotations

import itertools

import jinja2
import pytest
import torch

import tunegen
from helpers import DTYPES, REL_TOL, assert_lse, randn, rel_err, run_variant
from tunegen.kernels.families import prefill
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference
from tunegen.kernels.render import load, render, template_dir

SMALL = PrefillVariant(block_m=32, block_n=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "nq", "nk", "d"),
    [
        (2, 4, 4, 37, 37, 64),  # MHA, ragged length
        (3, 8, 2, 45, 45, 80),  # GQA 4, head dim not a power of two
        (1, 6, 1, 19, 70, 96),  # MQA, fewer queries than keys (causal aligned bottom-right)
        (2, 2, 2, 70, 19, 128),  # more queries than keys: causal rows with no key give zeros
        (1, 2, 1, 33, 41, 256),
        (2, 3, 3, 17, 23, 17),  # odd head dim
    ],
)
def test_matches_float64(device, dtype, causal, batch, hq, hkv, nq, nk, d):
    gen = torch.Generator().manual_seed(hash((batch, hq, nq, nk, d, causal)) % 2**31)
    q = randn(batch, hq, nq, d, dtype=dtype, device=device, gen=gen)
    k = randn(batch, hkv, nk, d, dtype=dtype, device=device, gen=gen)
    v = randn(batch, hkv, nk, d, dtype=dtype, device=device, gen=gen)
    scale = d**-0.5
    out, lse = run_variant(SMALL, q, k, v, causal=causal, scale=scale)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=scale)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)
    if causal and nq > nk:
        assert torch.all(out[:, :, : nq - nk] == 0)


KNOBS = [
    PrefillVariant(block_m=16, block_n=16, num_warps=4, num_stages=1),
    PrefillVariant(block_m=64, block_n=32, num_warps=4, num_stages=2, causal_split=False),
    PrefillVariant(block_m=32, block_n=64, num_warps=8, num_stages=3, load="desc"),
    PrefillVariant(block_m=16, block_n=32, num_warps=4, num_stages=2, load="desc", causal_split=False),
    PrefillVariant(block_m=32, block_n=32, num_warps=4, num_stages=2, order="head_inner", reverse_m=True),
    PrefillVariant(block_m=64, block_n=16, num_warps=4, num_stages=2, order="head_inner", load="desc"),
    PrefillVariant(block_m=16, block_n=32, num_warps=2, num_stages=3, order="m_inner", reverse_m=True),
    PrefillVariant(block_m=32, block_n=16, num_warps=4, num_stages=2, order="grouped", reverse_m=True),
    PrefillVariant(block_m=16, block_n=32, num_warps=4, num_stages=2, order="grouped"),
]


@pytest.mark.parametrize("variant", KNOBS, ids=lambda v: v.to_json())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_knob_is_correct(device, variant, causal):
    """Each knob changes the code; each setting must compute the same function."""
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16
    q = randn(2, 4, 75, 64, dtype=dtype, device=device, gen=gen)
    k = randn(2, 2, 61, 64, dtype=dtype, device=device, gen=gen)
    v = randn(2, 2, 61, 64, dtype=dtype, device=device, gen=gen)
    out, lse = run_variant(variant, q, k, v, causal=causal, scale=0.3)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.3)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


def _matches_float64_both_masks(variant, q, k, v):
    """`variant`'s fp16 output and log-sum-exp against float64, without a mask and causal."""
    for causal in (False, True):
        out, lse = run_variant(variant, q, k, v, causal=causal, scale=0.2)
        ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.2)
        assert rel_err(out, ref) < REL_TOL[torch.float16]
        assert_lse(lse, ref_lse, torch.float16)


def test_grouped_order_runs_every_tile_once(device):
    """Order "grouped" with groups of unequal sizes (7 heads: 2, 2, then 3, under the interpreter's
    nominal 64 KB cache), heaviest query blocks first: every output row written exactly as float64."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (randn(1, 7, 40, 64, dtype=torch.float16, device=device, gen=gen) for _ in range(3))
    variant = PrefillVariant(block_m=16, block_n=16, num_stages=1, order="grouped", reverse_m=True)
    _matches_float64_both_masks(variant, q, k, v)


def _module(variant, problem, device):
    """The rendered module of `variant` for `problem` (its launcher's helpers, whatever the device)."""
    features = prefill.FAMILY.features(problem, interpreter_gpu())
    return load(render(prefill.FAMILY.template, "prefill", variant, features), interpret=device.type == "cpu")


def test_grouped_order_fills_its_share_of_the_l2_counted_per_kv_head(device):
    """`l2_share` sizes the groups of "grouped": the query heads of as many KV heads as fit in
    1/l2_share of the L2 (the interpreter's nominal 64 KB), at least one; each size runs every
    tile once, as float64 says. 8 query heads over 2 KV heads, each KV head's K and V 10 KB: 3 of
    them would fit half the cache, so one group holds both; an eighth holds one at most."""
    gen = torch.Generator().manual_seed(9)
    q = randn(1, 8, 40, 64, dtype=torch.float16, device=device, gen=gen)
    k, v = (randn(1, 2, 40, 64, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    problem = Problem("prefill", "float16", 64, True, 8, 2, 1, 40, 40)
    for share, groups in ((2, (8, 1)), (8, (4, 2))):  # (query heads per group, groups)
        variant = PrefillVariant(block_m=16, block_n=16, num_stages=1, order="grouped", l2_share=share)
        module = _module(variant, problem, device)
        assert module._groups(torch.device("cpu"), 40, 64, 2, 8) == groups
        _matches_float64_both_masks(variant, q, k, v)


def test_grouped_order_puts_the_larger_groups_last_heaviest_first():
    """The tile order the kernels render, evaluated on the host: 22 (batch, head) pairs in groups of
    4 pairs and then 6 (GROUP 2: one KV head more), 3 query blocks each. Every tile once; each
    group's tiles together, the groups in that order; within a group the last query block first."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())), undefined=jinja2.StrictUndefined
    )
    code = env.from_string(
        '{% import "_attention.j2" as m %}{{ m.tile_order("grouped", True, "t", "torch") }}'
    )
    scope = {"torch": torch, "t": torch.arange(66), "n_bh": 22, "n_m_blocks": 3, "GROUP": 2}
    scope.update(group_heads=4, n_groups=4)
    exec(code.render(), scope)
    pairs = list(zip(scope["pid_bh"].tolist(), scope["pid_m"].tolist(), strict=True))
    assert sorted(pairs) == [(bh, m) for bh in range(22) for m in range(3)]
    bounds = [0, 4, 10, 16, 22]
    for first, end in itertools.pairwise(bounds):
        run = pairs[first * 3 : end * 3]
        assert {bh for bh, _ in run} == set(range(first, end))
        assert [m for _, m in run] == sorted((m for _, m in run), reverse=True)


def test_grouped_order_ends_with_the_larger_groups(device):
    """Groups as even as whole KV heads allow, the larger last, so that no small group's heaviest
    tiles start after every other tile: 11 KV heads (22 query heads) where 3 fit half the cache
    make groups of 2, 3, 3 and 3 KV heads. Every tile runs once, as float64 says."""
    gen = torch.Generator().manual_seed(10)
    q = randn(1, 22, 40, 64, dtype=torch.float16, device=device, gen=gen)
    k, v = (randn(1, 11, 40, 64, dtype=torch.float16, device=device, gen=gen) for _ in range(2))
    problem = Problem("prefill", "float16", 64, True, 22, 11, 1, 40, 40)
    variant = PrefillVariant(block_m=16, block_n=16, num_stages=1, order="grouped", reverse_m=True)
    module = _module(variant, problem, device)
    assert module._groups(torch.device("cpu"), 40, 64, 2, 22) == (4, 4)
    _matches_float64_both_masks(variant, q, k, v)


def test_strided_views_need_no_copy(device):
    """(B, N, H, D) tensors seen through .transpose(1, 2) run in place, output in the same layout."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    q = randn(2, 53, 4, 64, dtype=dtype, device=device, gen=gen).transpose(1, 2)
    kv = randn(2, 53, 2, 2, 64, dtype=dtype, device=device, gen=gen)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # interleaved K/V, strided heads
    assert not q.is_contiguous() and not k.is_contiguous()
    out = tunegen.attention(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True, scale=64**-0.5)
    assert out.stride() == q.stride()
    assert rel_err(out, ref) < REL_TOL[dtype]


def test_unaligned_strides_take_the_pointer_path(device):
    """Strides that are not 16-byte multiples cannot use tensor descriptors: the default handles them."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    base = randn(1, 3, 40, 3 * 33, dtype=dtype, device=device, gen=gen)
    q, k, v = base[..., :33], base[..., 33:66], base[..., 66:]
    out, lse = tunegen.attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=False, scale=33**-0.5)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)
    with pytest.raises(ValueError, match=r"variant\.load"):
        run_variant(PrefillVariant(load="desc", block_m=16, block_n=16), q, k, v, causal=False, scale=0.1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_api_defaults(device, dtype):
    gen = torch.Generator().manual_seed(5)
    q = randn(2, 8, 50, 128, dtype=dtype, device=device, gen=gen)
    k = randn(2, 2, 50, 128, dtype=dtype, device=device, gen=gen)
    v = randn(2, 2, 50, 128, dtype=dtype, device=device, gen=gen)
    for causal in (False, True):
        out = tunegen.attention(q, k, v, causal=causal, scale=0.2, strict=True)
        ref, ref_lse = attention_reference(q, k, v, causal=causal, scale=0.2)
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_err(out, ref) < REL_TOL[dtype]
        out2, lse = tunegen.attention(q, k, v, causal=causal, scale=0.2, return_lse=True)
        assert lse.dtype == torch.float32 and lse.shape == (2, 8, 50)
        assert_lse(lse, ref_lse, dtype)
        assert torch.equal(out, out2)


def test_default_scale_is_inverse_sqrt_head_dim(device):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn(1, 2, 24, 48, dtype=torch.float32, device=device, gen=gen) for _ in range(3))
    ref, _ = attention_reference(q, k, v, causal=False, scale=48**-0.5)
    assert rel_err(tunegen.attention(q, k, v), ref) < REL_TOL[torch.float32]
