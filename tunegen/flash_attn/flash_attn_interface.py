"""FlashAttention-2's functions (flash_attn 2.8's `flash_attn.flash_attn_interface`) on tunegen's
kernels; `tunegen.flash_attn` exports them as the `flash_attn` package does (see there)."""

from __future__ import annotations

import torch

from tunegen import checks
from tunegen.api import attention, attention_varlen
from tunegen.decode import decode_attention
from tunegen.unserved import flash_lse, require, served_local


def operand(name: str, t: object, layout: str, packed: int = 0) -> torch.Tensor:
    """`t` if it is a tensor of FlashAttention's `layout` (with `packed` > 0, holding that many
    tensors along its packing dim, shown as `packed` in the layout), else a ValueError naming it;
    tunegen's own checks then say what else is wrong."""
    dims = layout.strip("()").split(", ")
    if not isinstance(t, torch.Tensor) or t.dim() != len(dims):
        what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a tensor {layout}, got {what}")
    if packed and t.shape[dims.index(str(packed))] != packed:
        raise ValueError(f"{name}: expected a tensor {layout}, got shape {tuple(t.shape)}")
    return t


def dense(q, k, v, local: dict, scale: object, return_lse: object, deterministic: object, **fp8: object):
    """`tunegen.attention` on FlashAttention's (batch, seqlen, heads, head_dim) tensors with the
    mask and features `local` (`served_local`): the output in that layout, and the log-sum-exp
    (batch, heads, seqlen_q) if `return_lse`, in FlashAttention's convention (`flash_lse`)."""
    layout = "(batch, seqlen, heads, head_dim)"
    q_, k_, v_ = (operand(n, t, layout).transpose(1, 2) for n, t in (("q", q), ("k", k), ("v", v)))
    flags = {"return_lse": bool(return_lse), "deterministic": bool(deterministic)}
    result = attention(q_, k_, v_, scale=scale, **local, **flags, **fp8)
    if not return_lse:
        return result.transpose(1, 2)
    out, lse = result
    return out.transpose(1, 2), flash_lse(lse)


def _probs(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `return_attn_probs=True` returns without dropout: the output, the log-sum-exp and
    FlashAttention's empty S_dmask (it holds probabilities only where dropout applies)."""
    return out, lse, torch.empty(0, dtype=out.dtype, device=out.device)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention over (batch, seqlen, heads, head_dim) q and k, v (fewer heads for GQA/MQA): the
    output like q, and with `return_attn_probs` the log-sum-exp (batch, heads, seqlen_q) float32
    and an empty S_dmask. Differentiable in q, k, v, a window and the cap included;
    `deterministic` makes the backward's gradients the same bits on every run."""
    require(dropout_p=not dropout_p)
    local = served_local(causal, window_size, softcap, alibi_slopes)
    result = dense(q, k, v, local, softmax_scale, return_attn_probs, deterministic)
    if not return_attn_probs:
        return result
    out, lse = result
    return _probs(out, flash_lse(lse))


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """`flash_attn_func` on q, k, v packed as qkv (batch, seqlen, 3, heads, head_dim)."""
    q, k, v = operand("qkv", qkv, "(batch, seqlen, 3, heads, head_dim)", 3).unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """`flash_attn_func` with k, v packed as kv (batch, seqlen_k, 2, kv_heads, head_dim)."""
    k, v = operand("kv", kv, "(batch, seqlen_k, 2, kv_heads, head_dim)", 2).unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Attention over packed (total_tokens, heads, head_dim) sequences whose int32 offsets are
    `cu_seqlens_q`/`cu_seqlens_k` (batch + 1): the output like q, and with `return_attn_probs`
    the log-sum-exp (heads, total_q) float32 and an empty S_dmask. Differentiable in q, k, v.

    With `block_table` (batch, max_pages) int32, k and v are paged caches (num_pages, page_size,
    kv_heads, head_dim) and cu_seqlens_k's differences count each sequence's keys, as in
    FlashAttention-2: `tunegen.attention_varlen` with those counts as seqused_k (and its page
    sizes, multiples of 16; not differentiable)."""
    require(dropout_p=not dropout_p)
    pages = {}
    if block_table is not None:
        pages = {"seqused_k": _key_counts(cu_seqlens_k, q.device), "block_table": block_table}
        cu_seqlens_k = None
    local = served_local(causal, window_size, softcap, alibi_slopes)
    result = attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale=softmax_scale,
        return_lse=bool(return_attn_probs),
        deterministic=bool(deterministic),
        **local,
        **pages,
    )
    if not return_attn_probs:
        return result
    out, lse = result
    return _probs(out, flash_lse(lse))


def _key_counts(cu_seqlens_k: object, device: torch.device) -> torch.Tensor:
    """Each sequence's number of keys, (batch,) int32, from FlashAttention-2's offsets of a paged
    call (checked then as tunegen.attention_varlen's seqused_k)."""
    cu_seqlens_k = checks.offsets_arg("cu_seqlens_k", cu_seqlens_k, device)
    return cu_seqlens_k[1:] - cu_seqlens_k[:-1]


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """`flash_attn_varlen_func` on q, k, v packed as qkv (total_tokens, 3, heads, head_dim)."""
    q, k, v = operand("qkv", qkv, "(total_tokens, 3, heads, head_dim)", 3).unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """`flash_attn_varlen_func` with k, v packed as kv (total_k, 2, kv_heads, head_dim)."""
    k, v = operand("kv", kv, "(total_k, 2, kv_heads, head_dim)", 2).unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def capacity(k_cache: object, block_table: object) -> int | None:
    """How many tokens a cache holds per sequence: its slots, or its pages' tokens per row of the
    block table (None where `k_cache` is not a cache: the checks that follow say why)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return None
    return k_cache.shape[1] * (block_table.shape[1] if isinstance(block_table, torch.Tensor) else 1)


def cache_lengths(cache_seqlens: object, q: torch.Tensor, k_cache: torch.Tensor, block_table: object):
    """FlashAttention's `cache_seqlens` as the (batch,) int32 tensor tunegen takes: a tensor as
    given, an int for every sequence, None for the whole cache."""
    if cache_seqlens is None:
        cache_seqlens = capacity(k_cache, block_table)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) and isinstance(q, torch.Tensor):
        return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    return cache_seqlens


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q (batch, seqlen_q, heads, head_dim) over a KV cache, contiguous (batch,
    slots, kv_heads, head_dim) or paged (pages, page_size, kv_heads, head_dim) with
    `block_table`; `k`, `v` (batch, new_tokens, kv_heads, head_dim) are written into the cache in
    place at `cache_seqlens` first. Returns the output like q, and with `return_softmax_lse` the
    log-sum-exp (batch, heads, seqlen_q) float32. Not differentiable, as FlashAttention's. A
    window and the cap run as FlashAttention reads them (a window side of at least the cache's
    size is unbounded). `rotary_interleaved` applies to the rotary embedding, which tunegen does
    not serve."""
    require(
        rotary_cos=rotary_cos is None,
        rotary_sin=rotary_sin is None,
        cache_batch_idx=cache_batch_idx is None,
        cache_leftpad=cache_leftpad is None,
        num_splits=num_splits <= 1,
    )
    if cache_seqlens is None and k is not None:
        raise ValueError("cache_seqlens: required where k and v are appended (where to write them)")
    lengths = cache_lengths(cache_seqlens, q, k_cache, block_table)
    local = served_local(causal, window_size, softcap, alibi_slopes)
    result = decode_attention(
        q,
        k_cache,
        v_cache,
        lengths,
        k=k,
        v=v,
        block_table=block_table,
        scale=softmax_scale,
        return_lse=bool(return_softmax_lse),
        **local,
    )
    if not return_softmax_lse:
        return result
    out, lse = result
    return out, flash_lse(lse, inplace=True)
