"""FlashAttention-2's and -3's Python interfaces served by tunegen (tunegen.flash_attn,
tunegen.flash_attn_interface): their exact signatures, layouts, bottom-right causal mask, return
values and gradients against float64 (GQA, ragged lengths, packed inputs, caches contiguous and
paged with appended tokens, FP8), and every unserved argument refused by name."""

from __future__ import annotations

import inspect

import pytest
import torch

import tunegen.flash_attn as fa2
import tunegen.flash_attn_interface as fa3
from helpers import (
    REL_TOL,
    assert_grads,
    assert_lse,
    leaves,
    make_cache,
    packed,
    qkv_dout,
    reference,
    reference_grads,
    rel_err,
)
from tunegen.kernels import dispatch
from tunegen.kernels.reference import attention_reference, attention_varlen_reference
from tunegen.unserved import flash_lse

pytestmark = pytest.mark.usefixtures("user_db")
VARLEN2 = "cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
TAIL2 = "dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 alibi_slopes=None "
TAIL2 += "deterministic=False return_attn_probs=False"
SIGNATURES = {
    fa2.flash_attn_func: f"q k v {TAIL2}",
    fa2.flash_attn_qkvpacked_func: f"qkv {TAIL2}",
    fa2.flash_attn_kvpacked_func: f"q kv {TAIL2}",
    fa2.flash_attn_varlen_func: f"q k v {VARLEN2} {TAIL2} block_table=None",
    fa2.flash_attn_varlen_qkvpacked_func: f"qkv cu_seqlens max_seqlen {TAIL2}",
    fa2.flash_attn_varlen_kvpacked_func: f"q kv {VARLEN2} {TAIL2}",
    fa2.flash_attn_with_kvcache: "q k_cache v_cache k=None v=None rotary_cos=None rotary_sin=None "
    "cache_seqlens=None cache_batch_idx=None cache_leftpad=None block_table=None softmax_scale=None "
    "causal=False window_size=(-1, -1) softcap=0.0 rotary_interleaved=True alibi_slopes=None num_splits=0 "
    "return_softmax_lse=False",
    fa3.flash_attn_func: "q k v softmax_scale=None causal=False qv=None q_descale=None k_descale=None "
    "v_descale=None window_size=(-1, -1) attention_chunk=0 softcap=0.0 num_splits=1 pack_gqa=None "
    "deterministic=False sm_margin=0 return_attn_probs=False",
    fa3.flash_attn_qkvpacked_func: "qkv softmax_scale=None causal=False q_descale=None k_descale=None "
    "v_descale=None window_size=(-1, -1) attention_chunk=0 softcap=0.0 deterministic=False num_heads_q=None "
    "sm_margin=0 return_attn_probs=False",
    fa3.flash_attn_varlen_func: "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q=None "
    "seqused_k=None softmax_scale=None causal=False qv=None q_descale=None k_descale=None v_descale=None "
    "window_size=(-1, -1) attention_chunk=0 softcap=0.0 num_splits=1 pack_gqa=None deterministic=False "
    "sm_margin=0 return_attn_probs=False",
    fa3.flash_attn_with_kvcache: "q k_cache v_cache k=None v=None qv=None rotary_cos=None rotary_sin=None "
    "cache_seqlens=None cache_batch_idx=None cache_leftpad=None page_table=None cu_seqlens_q=None "
    "cu_seqlens_k_new=None max_seqlen_q=None rotary_seqlens=None q_descale=None k_descale=None "
    "v_descale=None softmax_scale=None causal=False window_size=(-1, -1) attention_chunk=0 softcap=0.0 "
    "rotary_interleaved=True scheduler_metadata=None num_splits=0 pack_gqa=None sm_margin=0 "
    "return_softmax_lse=False",
}


@pytest.mark.parametrize("function", SIGNATURES, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_signatures_are_flashattentions(function):
    """Names, order and defaults of flash_attn 2.8 and FlashAttention-3's flash_attn_interface."""
    parameters = inspect.signature(function).parameters.values()
    shown = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in parameters]
    assert " ".join(shown) == SIGNATURES[function]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters)


def test_flash_attns_own_module_path_holds_the_same_functions():
    import tunegen.flash_attn.flash_attn_interface as own

    assert fa2.__all__ and all(getattr(own, name) is getattr(fa2, name) for name in fa2.__all__)


def _bshd(*tensors):
    return [t.transpose(1, 2).contiguous() for t in tensors]


@pytest.mark.parametrize("interface", ["fa2", "fa3"])
@pytest.mark.parametrize(
    ("causal", "window", "nq", "nk"),
    [
        (False, (-1, -1), 37, 37),
        (True, (-1, -1), 45, 23),  # bottom-right: the first rows see no key
        (False, (-1, 0), 19, 50),  # FlashAttention's window for causal
        (False, (64, 70), 19, 50),  # sides of at least seqlen_k are unbounded
    ],
)
def test_dense_forward_and_backward_match_float64(device, interface, causal, window, nq, nk):
    dtype = torch.float16
    q, k, v, dout = _bshd(*qkv_dout(2, 4, 2, nq, nk, 40, dtype, device, seed=nq + nk))
    q, k, v = leaves(q, k, v)
    if interface == "fa2":
        out, lse, s_dmask = fa2.flash_attn_func(q, k, v, 0.0, 0.3, causal, window, return_attn_probs=True)
        assert s_dmask.numel() == 0, "no dropout: FlashAttention's empty S_dmask"
    else:
        out, lse = fa3.flash_attn_func(q, k, v, 0.3, causal, window_size=window, return_attn_probs=True)
    out.backward(dout)
    forward = _bshd_reference(causal or window == (-1, 0), 0.3)
    ref, ref_lse = forward(*(t.detach().double() for t in (q, k, v)))
    assert out.shape == q.shape and rel_err(out.detach(), ref) < 2e-3
    assert lse.shape == (2, 4, nq)
    assert_lse(lse.detach(), flash_lse(ref_lse), dtype)  # +inf where no key is seen, as FlashAttention
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), dtype)


def _bshd_reference(causal, scale):
    """The float64 reference on (batch, seqlen, heads, head_dim) tensors: output and log-sum-exp."""

    def forward(q, k, v):
        out, lse = attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, scale=scale)
        return out.transpose(1, 2), lse

    return forward


def test_packed_inputs_get_their_gradients(device):
    dtype = torch.float16
    q, k, v, dout = _bshd(*qkv_dout(2, 2, 2, 29, 29, 32, dtype, device, seed=3))
    qkv = torch.stack([q, k, v], dim=2).requires_grad_()
    out = fa2.flash_attn_qkvpacked_func(qkv, causal=True)
    out.backward(dout)
    dq, dk, dv = reference_grads(_bshd_reference(True, 32**-0.5), (q, k, v), dout)
    assert_grads(qkv.grad.unbind(2), (dq, dk, dv), dtype)
    kv = torch.stack([k, v], dim=2)
    ref, _ = _bshd_reference(True, 32**-0.5)(q.double(), k.double(), v.double())
    assert rel_err(fa2.flash_attn_kvpacked_func(q, kv, causal=True), ref) < 2e-3
    by_heads = torch.cat([q, k, v], dim=2)  # FlashAttention-3's (batch, seqlen, hq + 2 hk, d)
    assert rel_err(fa3.flash_attn_qkvpacked_func(by_heads, causal=True, num_heads_q=2), ref) < 2e-3


@pytest.mark.parametrize("interface", ["fa2", "fa3"])
def test_varlen_forward_and_backward_match_float64(device, interface):
    dtype = torch.float16
    q, k, v, cu_q, cu_k = packed([5, 31, 1, 17], [9, 30, 4, 17], 4, 2, 32, dtype, device, seed=8)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    q, k, v = leaves(q, k, v)
    if interface == "fa2":
        out, lse, _ = fa2.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 31, 30, causal=True, deterministic=True, return_attn_probs=True
        )
    else:
        out, lse = fa3.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 31, 30, causal=True, deterministic=True, return_attn_probs=True
        )
    out.backward(dout)
    forward = lambda q, k, v: attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, scale=32**-0.5)
    ref, ref_lse = forward(*(t.detach().double() for t in (q, k, v)))
    assert rel_err(out.detach(), ref) < 2e-3 and lse.shape == (4, q.shape[0])
    assert_lse(lse.detach(), flash_lse(ref_lse), dtype)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(forward, (q, k, v), dout), dtype)
    qkv = torch.stack([q, q, q], dim=1).detach()
    cu = cu_q
    same = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 31, causal=True)
    ref, _ = attention_varlen_reference(
        *(t.double() for t in qkv.unbind(1)), cu, cu, causal=True, scale=32**-0.5
    )
    assert rel_err(same, ref) < 2e-3
    kv = torch.stack([k, v], dim=1).detach()
    again = fa2.flash_attn_varlen_kvpacked_func(q.detach(), kv, cu_q, cu_k, 31, 30, causal=True)
    ref, _ = forward(*(t.detach().double() for t in (q, k, v)))
    assert rel_err(again, ref) < 2e-3


def test_deterministic_asks_for_the_fixed_order_backward(device, monkeypatch):
    asked = []
    real = dispatch.deterministic_kernel_for
    monkeypatch.setattr(dispatch, "deterministic_kernel_for", lambda *a: asked.append(a) or real(*a))
    q, k, v, dout = _bshd(*qkv_dout(1, 2, 2, 21, 21, 32, torch.float16, device, seed=4))
    for function in (fa2.flash_attn_func, fa3.flash_attn_func):
        for deterministic in (False, True):
            asked.clear()
            function(*leaves(q, k, v), causal=True, deterministic=deterministic).backward(dout)
            assert len(asked) == deterministic


@pytest.mark.parametrize("interface", ["fa2", "fa3"])
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "paged"])
def test_kvcache_appends_in_place_and_attends(device, interface, page):
    dtype = torch.float16
    gen = torch.Generator().manual_seed(21 + page)
    k_cache, v_cache, table = make_cache(2, 2, 32, [40, 9], 64, page, dtype, device, gen)
    q = torch.randn(2, 3, 4, 32, generator=gen).to(device, dtype)
    k_new, v_new = (torch.randn(2, 3, 2, 32, generator=gen).to(device, dtype) for _ in range(2))
    seqlens = torch.tensor([40, 9], dtype=torch.int32, device=device)
    if interface == "fa2":
        out, lse = fa2.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True,
            return_softmax_lse=True,
        )  # fmt: skip
    else:
        out, lse, out_accum, lse_accum = fa3.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, page_table=table, causal=True,
            return_softmax_lse=True,
        )  # fmt: skip
        assert out_accum.numel() == 0 and lse_accum.numel() == 0
    ref, ref_lse = reference(q, k_cache, v_cache, table, [43, 12], True, 32**-0.5)
    assert rel_err(out, ref) < 2e-3, "the new tokens were written, then attended (causal, bottom-right)"
    assert_lse(lse, flash_lse(ref_lse), dtype)
    whole = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table)  # None: every slot
    capacity = k_cache.shape[1] * (table.shape[1] if page else 1)
    ref, _ = reference(q, k_cache, v_cache, table, [capacity, capacity], False, 32**-0.5)
    assert rel_err(whole, ref) < 2e-3
    as_int = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=12, block_table=table)
    ref, _ = reference(q, k_cache, v_cache, table, [12, 12], False, 32**-0.5)
    assert rel_err(as_int, ref) < 2e-3


def test_fa3_fp8_as_flashattention3_runs_it(device):
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 29, h, 32, generator=gen).to(device) for h in (4, 2, 2))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    descales = [torch.rand(2, 2, generator=gen).to(device) + 0.5 for _ in range(3)]
    named = dict(zip(("q_descale", "k_descale", "v_descale"), descales, strict=True))
    out = fa3.flash_attn_func(q8, k8, v8, causal=True, **named)
    widened = [
        t.double().transpose(1, 2) * s.double().repeat_interleave(t.shape[2] // 2, 1)[:, :, None, None]
        for t, s in zip((q8, k8, v8), descales, strict=True)
    ]
    ref, _ = attention_reference(*widened, causal=True, scale=32**-0.5)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref.transpose(1, 2)) < 3e-2


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda q, k, v: fa2.flash_attn_func(q, k, v, dropout_p=0.1),
            "dropout_p: tunegen applies no dropout",
        ),
        (
            lambda q, k, v: fa2.flash_attn_func(q, k, v, window_size=8),
            r"window_size: expected \(left, right\)",
        ),
        (lambda q, k, v: fa2.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2)), "alibi_slopes: ALiBi"),
        (lambda q, k, v: fa3.flash_attn_func(q, k, v, num_splits=4), "num_splits: tunegen chooses"),
        (lambda q, k, v: fa3.flash_attn_func(q, k, v, pack_gqa=True), "pack_gqa: tunegen groups"),
        (lambda q, k, v: fa3.flash_attn_func(q, k, v, sm_margin=8), "sm_margin: tunegen's kernels"),
        (lambda q, k, v: fa3.flash_attn_func(q, k, v, qv=q), "qv: the extra QV product"),
        (
            lambda q, k, v: fa3.flash_attn_func(q, k, v, q_descale=torch.ones(1, 2)),
            "q_descale: descales apply",
        ),
        (
            lambda q, k, v: fa2.flash_attn_with_kvcache(q, k, v, rotary_cos=q),
            "rotary_cos: tunegen applies no rotary",
        ),
        (
            lambda q, k, v: fa2.flash_attn_with_kvcache(
                q, k, v, cache_batch_idx=torch.zeros(1, dtype=torch.int32)
            ),
            "cache_batch_idx: the cache's rows",
        ),
        (lambda q, k, v: fa2.flash_attn_with_kvcache(q, k, v, k=k, v=v), "cache_seqlens: required"),
        (
            lambda q, k, v: fa3.flash_attn_with_kvcache(q, k, v, scheduler_metadata=torch.zeros(1)),
            "scheduler_metadata: tunegen schedules",
        ),
    ],
)
def test_unserved_arguments_are_refused_by_name(call, pattern):
    q, k, v = (torch.randn(1, 6, 2, 16, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=pattern):
        call(q, k, v)


@pytest.mark.parametrize(
    ("interface", "kwargs"),
    [
        ("fa2", {"causal": True, "window_size": (5, 0)}),
        ("fa2", {"window_size": (4, 3), "softcap": 2.0}),
        (
            "fa3",
            {"causal": True, "attention_chunk": 8, "window_size": (-7, 9)},
        ),  # causal drops the right side
    ],
)
def test_windows_caps_and_chunks_run_forward_as_flashattention_reads_them(device, interface, kwargs):
    """A negative side is unbounded, as FlashAttention reads it; under autograd too (their gradients:
    test_local_gradients.py)."""
    dtype = torch.float16
    q, k, v, _ = _bshd(*qkv_dout(2, 4, 2, 29, 41, 32, dtype, device, seed=9))
    fa = fa2 if interface == "fa2" else fa3
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, **kwargs)
    causal = kwargs.get("causal", False)
    left, right = kwargs["window_size"]
    local = {
        "window_size": (max(left, -1), -1 if causal else right),
        "attention_chunk": kwargs.get("attention_chunk", 0),
        "softcap": kwargs.get("softcap", 0.0),
    }
    forward = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=0.3, **local)
    ref, _ = forward(*(t.transpose(1, 2).double() for t in (q, k, v)))
    assert rel_err(out, ref.transpose(1, 2)) < REL_TOL[dtype]
    q.requires_grad_(True)
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, **kwargs)
    assert out.grad_fn is not None and rel_err(out.detach(), ref.transpose(1, 2)) < REL_TOL[dtype]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    ("interface", "kwargs"),
    [
        ("fa2", {"window_size": (5, 3), "softcap": 2.0}),
        ("fa3", {"window_size": (-4, -1), "attention_chunk": 8}),
    ],
)
def test_the_cache_functions_run_windows_caps_and_chunks(device, interface, kwargs, causal):
    """As FlashAttention reads them (causal drops the right side, a negative side is unbounded),
    three query tokens over caches of 30 and 12 tokens: float64's answer."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(2, 3, 4, 16, generator=gen).to(device, torch.float16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16, generator=gen).to(device, torch.float16) for _ in range(2))
    seqlens = torch.tensor([30, 12], dtype=torch.int32, device=device)
    fa = fa2 if interface == "fa2" else fa3
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, **kwargs)
    left, right = kwargs["window_size"]
    local = {
        "window_size": (max(left, -1), -1 if causal else right),
        "attention_chunk": kwargs.get("attention_chunk", 0),
        "softcap": kwargs.get("softcap", 0.0),
    }
    for b, n in enumerate((30, 12)):
        kk, vv = (c[b : b + 1, :n].transpose(1, 2) for c in (k_cache, v_cache))
        ref, _ = attention_reference(q[b : b + 1].transpose(1, 2), kk, vv, causal=causal, scale=0.25, **local)
        assert rel_err(out[b : b + 1], ref.transpose(1, 2)) < REL_TOL[torch.float16]


def test_varlen_refusals_name_the_argument():
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 16, torch.float16, torch.device("cpu"), seed=1)
    with pytest.raises(
        ValueError, match=r"k: expected 4 dimensions \(num_pages, page_size, kv_heads, head_dim\)"
    ):
        fa2.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 4, 4, block_table=torch.zeros(2, 1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="seqused_k: per-sequence used lengths"):
        fa3.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 4, 4, seqused_k=torch.tensor([3, 4], dtype=torch.int32)
        )


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda z: fa2.flash_attn_func([1], z, z),
            r"q: expected a tensor \(batch, seqlen, heads, head_dim\)",
        ),
        (
            lambda z: fa3.flash_attn_func(z, z[0], z),
            r"k: expected a tensor \(batch, seqlen, heads, head_dim\)",
        ),
        (lambda z: fa2.flash_attn_qkvpacked_func(None), r"qkv: expected a tensor \(batch, seqlen, 3, heads"),
        (lambda z: fa2.flash_attn_kvpacked_func(z, z[:, :, None]), r"kv: expected a tensor .*got shape"),
        (
            lambda z: fa2.flash_attn_varlen_qkvpacked_func(z, None, 4),
            r"qkv: expected a tensor \(total_tokens, 3",
        ),
        (lambda z: fa3.flash_attn_qkvpacked_func(z, num_heads_q=1), "num_heads_q: qkv's 2 heads"),
        (lambda z: fa2.flash_attn_with_kvcache(None, z, z, cache_seqlens=3), "q: expected a torch.Tensor"),
    ],
)
def test_bad_operands_are_named(call, pattern):
    z = torch.randn(1, 6, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=pattern):
        call(z)
