"""Chunked prefill over a paged KV cache: `attention_varlen` with FlashAttention-3's `block_table`
and `seqused_k` against float64 on the keys gathered from their pages, on ragged chunks, GQA, page
sizes 16 and 32 and shuffled pages among spare ones that hold NaN (as do the rows of a last page
past its sequence's keys), so that a read of a page or row no sequence uses shows; the same call
over the packed keys gives the same output; each bad argument is a ValueError naming it."""

from __future__ import annotations

import pytest
import torch

import tunegen
import tunegen.flash_attn as fa2
from helpers import DECODE_PATHS, REL_TOL, assert_lse, on_path, paged, rel_err, run_variant
from tunegen import checks
from tunegen.calls.prefill import PrefillCall, Varlen
from tunegen.kernels import dispatch
from tunegen.kernels.families import prefill
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.reference import attention_varlen_reference, gather_pages

# (queries, keys) per sequence, query heads, KV heads, head dim: chunks of prompts whose earlier
# tokens are cached (an empty chunk, one token over one key, 45 over 160, a whole prompt of 70),
# then a sequence with no key (its rows give zeros and -inf) beside ones with more keys.
CASES = [
    ([0, 1, 45, 70], [23, 1, 160, 70], 4, 2, 64),
    ([7, 30, 3], [0, 33, 50], 4, 4, 80),
]


@pytest.fixture(params=DECODE_PATHS)
def path(request, monkeypatch):
    return on_path(request.param, monkeypatch)


def test_gather_pages_gives_back_the_packed_keys():
    x = paged([3, 9], [40, 0], 2, 2, 16, 16, torch.float32, torch.device("cpu"), seed=1)
    k, v, cu_k = gather_pages(x.k_cache, x.v_cache, x.block_table, x.seqused_k)
    assert torch.equal(k, x.k) and torch.equal(v, x.v) and torch.equal(cu_k, x.cu_seqlens_k)
    assert cu_k.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("lq", "lk", "hq", "hkv", "d"), CASES)
def test_paged_matches_float64(path, dtype, page, causal, lq, lk, hq, hkv, d):
    device, strict = path
    x = paged(lq, lk, hq, hkv, d, page, dtype, device, seed=sum(lk) + page + d)
    out, lse = x.call(causal=causal, return_lse=True, strict=strict)
    ref, ref_lse = x.reference(causal)
    assert out.shape == x.q.shape and out.dtype == dtype and lse.shape == (hq, x.q.shape[0])
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_equals_the_call_over_packed_keys(path, causal):
    """The pages hold the packed keys: the paged call gives what the packed call gives (the same
    bits on the PyTorch path, which gathers them; within rounding of the two kernels elsewhere)."""
    device, strict = path
    lq, lk = [0, 1, 45, 70], [23, 1, 160, 70]
    x = paged(lq, lk, 4, 2, 64, 16, torch.float16, device, seed=3)
    out = x.call(causal=causal, strict=strict)
    same = tunegen.attention_varlen(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, max(lq), max(lk), causal=causal, strict=strict
    )
    if device.type == "cpu" and strict is None:
        assert torch.equal(out, same)
    else:
        torch.testing.assert_close(out, same, rtol=0, atol=2e-3)


@pytest.mark.parametrize("page", [16, 32])
def test_the_default_variant_launched_directly_into_poisoned_outputs(device, page):
    """The kernel dispatch would serve a paged Problem writes every output row and log-sum-exp."""
    x = paged([0, 1, 45, 70], [23, 1, 160, 70], 4, 2, 64, page, torch.float16, device, seed=4)
    varlen = Varlen(x.cu_seqlens_q, None, x.max_seqlen_q, x.max_seqlen_k, x.seqused_k, x.block_table)
    call = PrefillCall(x.q, x.k_cache, x.v_cache, True, 0.125, True, varlen=varlen)
    problem = call.problem(call.outputs()[0])
    assert problem.paged and problem.page_size == page and problem.num_heads_kv == 2 and problem.varlen
    variant = prefill.FAMILY.default_variant(problem, gpu_of(device))
    out, lse = run_variant(variant, x.q, x.k_cache, x.v_cache, causal=True, scale=0.125, varlen=varlen)
    ref, ref_lse = attention_varlen_reference(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, causal=True, scale=0.125
    )
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)


def test_the_call_keys_launch_arguments_and_explain(monkeypatch):
    """The Problem (paged, its page size, the caches' KV heads, max_seqlen_k's bucket), the launch
    arguments the kernels read (cu_seqlens_k None), and explain() of the same arguments."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = paged([5, 12], [40, 20], 4, 2, 32, 32, torch.float16, torch.device("cpu"), seed=5)
    sizes = (x.cu_seqlens_q, None, x.max_seqlen_q, x.max_seqlen_k)
    pages = {"seqused_k": x.seqused_k, "block_table": x.block_table}
    call = PrefillCall.packed(x.q, x.k_cache, x.v_cache, *sizes, causal=True, **pages)
    out, lse = call.outputs()
    problem = call.problem(out)
    assert (problem.paged, problem.page_size, problem.num_heads_kv, problem.seqlen_k) == (True, 32, 2, 64)
    args = call.args(out, lse)
    assert args.cu_seqlens_k is None and args.k is x.k_cache and args.v is x.v_cache
    assert args.block_table is x.block_table and args.seqused_k is x.seqused_k and args.max_seqlen_q == 12
    explained = tunegen.explain(x.q, x.k_cache, x.v_cache, *sizes, causal=True, **pages)
    assert explained["problem"] == problem.as_dict() and explained["source"] == "torch"


def test_flash_attn_2_block_table_counts_keys_by_cu_seqlens_k(monkeypatch):
    """FlashAttention-2's paged varlen call: cu_seqlens_k's differences are the keys' counts."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = paged([4, 9], [30, 9], 4, 2, 32, 16, torch.float16, torch.device("cpu"), seed=6)
    out = fa2.flash_attn_varlen_func(
        x.q,
        x.k_cache,
        x.v_cache,
        x.cu_seqlens_q,
        x.cu_seqlens_k,
        9,
        30,
        causal=True,
        block_table=x.block_table,
    )
    assert torch.equal(out, x.call(causal=True))
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected a 1-D int32 tensor"):
        fa2.flash_attn_varlen_func(
            x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, None, 9, 30, block_table=x.block_table
        )


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
    reason="Dynamo before torch 2.13 cannot wrap the paged call's Local (SourcelessBuilder, torch 2.11)",
)
def test_torch_compile_traces_a_paged_call(monkeypatch):
    """The custom op carries the pages: a paged call under torch.compile(fullgraph=True), its fake
    shapes (opcheck), and the op refusing a gradient as the public call does."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = paged([0, 7, 20], [9, 7, 40], 4, 2, 32, 16, torch.float16, torch.device("cpu"), seed=7)

    def block(q, k_cache, v_cache, cu_q, seqused_k, block_table):
        out, lse = tunegen.attention_varlen(
            q, k_cache, v_cache, cu_q, None, 20, 40, causal=True, return_lse=True,
            seqused_k=seqused_k, block_table=block_table,
        )  # fmt: skip
        return out + 1, lse

    torch._dynamo.reset()
    out, lse = torch.compile(block, fullgraph=True)(
        x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.seqused_k, x.block_table
    )
    ref, ref_lse = x.reference(True)
    assert rel_err(out - 1, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
    flags = (True, 0.25, True, False, -1, -1, 0, 0.0, None)
    inputs = (x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, None, 20, 40, *flags, x.seqused_k, x.block_table)
    torch.library.opcheck(
        torch.ops.tunegen.attention_varlen.default, inputs, test_utils=("test_schema", "test_faketensor")
    )
    with pytest.raises(ValueError, match="block_table: paged calls take no gradient"):
        torch.ops.tunegen.attention_varlen(x.q.clone().requires_grad_(), *inputs[1:])


def test_paged_calls_take_no_gradient(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = paged([3, 5], [8, 20], 4, 2, 16, 16, torch.float16, torch.device("cpu"), seed=8)
    for name in ("q", "k_cache", "v_cache"):
        leaf = getattr(x, name).clone().requires_grad_()
        with pytest.raises(ValueError, match=r"block_table: paged calls take no gradient"):
            x._replace(**{name: leaf}).call(causal=True)
    with torch.no_grad():
        out = x._replace(q=x.q.clone().requires_grad_()).call(causal=True)
    assert torch.equal(out, x.call(causal=True))


def _args(**changes):
    """A valid paged call's arguments (batch 2, page 16, 4 pages per row, 7 pages), with `changes`
    (a callable takes the valid value)."""
    x = paged([3, 5], [8, 20], 4, 2, 16, 16, torch.float16, torch.device("cpu"), seed=9, spare=4)
    a = {
        "q": x.q,
        "k": x.k_cache,
        "v": x.v_cache,
        "cu_seqlens_q": x.cu_seqlens_q,
        "cu_seqlens_k": None,
        "max_seqlen_q": 5,
        "max_seqlen_k": 20,
        "seqused_k": x.seqused_k,
        "block_table": x.block_table,
    }
    for name, change in changes.items():
        a[name] = change(a[name]) if callable(change) else change
    return a


def _table(rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"seqused_k": None}, r"seqused_k: expected a \(batch,\) int32 tensor .* with block_table, got None"),
        (
            {"block_table": None, "cu_seqlens_k": _table([0, 8, 28])},
            r"block_table: expected a \(batch, max_pages\) int32 tensor with seqused_k",
        ),
        ({"cu_seqlens_k": _table([0, 8, 28])}, r"cu_seqlens_k: expected None with block_table"),
        ({"block_table": None, "seqused_k": None}, r"cu_seqlens_k: expected a 1-D int32 tensor"),
        ({"k": lambda k: k[:, 0]}, r"k: expected 4 dimensions \(num_pages, page_size, kv_heads, head_dim\)"),
        ({"v": lambda v: v[:-1]}, r"v: expected shape \(7, 16, 2, 16\) like k"),
        ({"k": lambda k: k.float()}, r"k: expected dtype torch.float16 like q"),
        ({"k": lambda k: k[..., :8], "v": lambda v: v[..., :8]}, r"k: expected head_dim 16 like q"),
        ({"q": lambda q: q[:, :3]}, r"k: the number of query heads \(3\) must be a multiple .* got 2"),
        ({"k": lambda k: k[:, :, :1], "v": lambda v: v[:, :, :1], "q": lambda q: q[:, :3]}, None),  # MQA
        (
            {"k": lambda k: k[:, :8], "v": lambda v: v[:, :8]},
            r"k: the page size \(dimension 1\) must be a positive multiple of 16, got 8",
        ),
        ({"block_table": lambda t: t.long()}, r"block_table: expected a 2-D int32 tensor"),
        ({"block_table": lambda t: t[0]}, r"block_table: expected a 2-D int32 tensor"),
        ({"block_table": lambda t: t[:1]}, r"block_table: expected 2 rows \(one per sequence\), got 1"),
        ({"block_table": lambda t: t.t().contiguous().t()}, r"block_table: expected a unit last stride"),
        ({"block_table": lambda t: t.to("meta")}, r"block_table: expected device cpu like q, got meta"),
        ({"seqused_k": lambda s: s.long()}, r"seqused_k: expected a 1-D int32 tensor"),
        ({"seqused_k": lambda s: s[:1]}, r"seqused_k: expected 2 lengths \(one per sequence\), got 1"),
        ({"seqused_k": lambda s: s.to("meta")}, r"seqused_k: expected device cpu like q, got meta"),
        ({"max_seqlen_k": 100}, r"max_seqlen_k: expected at most the 48 keys a block_table row names"),
        ({"max_seqlen_k": 19}, r"seqused_k: sequence 1 has 20 keys, expected 0 to max_seqlen_k \(19\)"),
        ({"seqused_k": _table([-1, 20])}, r"seqused_k: sequence 0 has -1 keys"),
        ({"block_table": _table([[0, 9, 1], [2, 3, 4]])}, None),  # an unused entry is never read
        ({"block_table": _table([[0, 1, 2], [3, 11, 4]])}, r"block_table: sequence 1 names pages \[11\], "),
        ({"block_table": _table([[-2, 1, 2], [3, 5, 4]])}, r"block_table: sequence 0 names pages \[-2\]"),
    ],
)
def test_paged_rejects(changes, pattern, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = _args(**changes)
    if pattern is None:  # accepted
        tunegen.attention_varlen(**a)
        return
    with pytest.raises(ValueError, match=pattern):
        tunegen.attention_varlen(**a)


def test_counts_and_pages_are_read_only_when_asked():
    """Under torch.compile and CUDA-graph capture (read_lengths False) the counts and pages stay on
    the device, as the offsets do: only their shapes are checked then."""
    x = paged([3, 5], [8, 20], 4, 2, 16, 16, torch.float16, torch.device("cpu"), seed=10)
    bad = {"seqused_k": torch.tensor([-5, 99], dtype=torch.int32), "block_table": x.block_table}
    sizes = (x.cu_seqlens_q, None, 5, 20)
    unread = PrefillCall.packed(x.q, x.k_cache, x.v_cache, *sizes, **bad, read_lengths=False)
    assert unread.varlen.paged and unread.lengths is None
    read = PrefillCall.packed(x.q, x.k_cache, x.v_cache, *sizes, **bad, read_lengths=True)
    with pytest.raises(ValueError, match=r"seqused_k: sequence 0 has -5 keys"):
        read.lengths.wait()


@pytest.mark.parametrize("pages", [False, True], ids=["packed", "paged"])
def test_the_lengths_are_read_back_in_one_copy(pages, monkeypatch):
    """Offsets, counts and the pages' check come to the host in one copy: each read is a sync on
    a GPU, and the public call makes it every time."""
    x = paged([3, 5], [8, 20], 4, 2, 16, 16, torch.float16, torch.device("cpu"), seed=11)
    if pages:
        keys = (x.k_cache, x.v_cache, x.cu_seqlens_q, None)
        extra = {"seqused_k": x.seqused_k, "block_table": x.block_table}
    else:
        keys = (x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k)
        extra = {}
    reads = []
    tolist, as_bool = torch.Tensor.tolist, torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or as_bool(t))
    call = PrefillCall.packed(x.q, *keys, 5, 20, **extra, read_lengths=True)
    assert reads == []
    call.args(torch.empty_like(x.q), None)
    call.args(torch.empty_like(x.q), None)
    assert reads == ["tolist"]


@pytest.mark.parametrize("pages", [False, True], ids=["packed", "paged"])
def test_the_lengths_are_checked_after_the_dispatch(path, pages, monkeypatch):
    """The public call dispatches while its lengths are on their way to the host, and waits for
    them (raising what they fail) right before the launch: a read at the start left the GPU idle
    for the whole dispatch. Bad lengths still raise before any kernel runs; the PyTorch path
    waits for them too."""
    device, strict = path
    steps = []
    kernel_for, wait = dispatch.kernel_for, checks.LengthsCheck.wait
    monkeypatch.setattr(dispatch, "kernel_for", lambda *a: steps.append("dispatch") or kernel_for(*a))
    monkeypatch.setattr(checks.LengthsCheck, "wait", lambda self: steps.append("wait") or wait(self))
    if pages:
        a, pattern = _args(seqused_k=_table([8, 99])), r"seqused_k: sequence 1 has 99 keys"
    else:
        x = paged([3, 5], [8, 20], 4, 2, 16, 16, torch.float16, torch.device("cpu"), seed=12)
        a = {"q": x.q, "k": x.k, "v": x.v, "cu_seqlens_q": x.cu_seqlens_q, "cu_seqlens_k": _table([0, 8, 27])}
        a.update(max_seqlen_q=5, max_seqlen_k=20)
        pattern = r"cu_seqlens_k: expected the last offset to equal the token count 28, got 27"
    a = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in a.items()}
    with pytest.raises(ValueError, match=pattern):
        tunegen.attention_varlen(**a, strict=strict)
    assert steps == (["wait"] if strict is None else ["dispatch", "wait"])
