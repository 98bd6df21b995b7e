"""FlashAttention-3's Python interface (`flash_attn_interface`, the Hopper build), served by
tunegen's kernels:

    import tunegen.flash_attn_interface as flash_attn_interface   # was: import flash_attn_interface

Each function has FlashAttention-3's name, parameters (order and defaults: no dropout, the scale
fourth), layouts, bottom-right causal alignment and return values: `out`, or `(out, lse)` with
`return_attn_probs`; `flash_attn_with_kvcache` returns `(out, lse, out_accum, lse_accum)` with
`return_softmax_lse`, the partial sums empty as FlashAttention-3's are without splits. FP8 runs
as FlashAttention-3's does: float8_e4m3fn q, k, v with float32 descales (batch, kv_heads) in
`flash_attn_func`, returning bfloat16, and an FP8 KV cache with `k_descale`/`v_descale` in
`flash_attn_with_kvcache`. An argument tunegen does not serve is a ValueError naming it when its
value asks for the feature; performance hints tunegen decides for itself (`num_splits`,
`pack_gqa`, `sm_margin`, `scheduler_metadata`) are accepted at their defaults only.
"""

from __future__ import annotations

import torch

from tunegen.api import attention_varlen
from tunegen.decode import decode_attention
from tunegen.flash_attn.flash_attn_interface import (
    cache_lengths,
    dense,
    operand,
)
from tunegen.unserved import flash_lse, require, served_local

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]


def _hints(num_splits: int, pack_gqa: object, sm_margin: int) -> None:
    """The performance hints, accepted where they ask for nothing (FlashAttention-3 reads a
    num_splits of 0 or less as its own choice, 1 as none)."""
    require(num_splits=num_splits <= 1, pack_gqa=pack_gqa is None, sm_margin=not sm_margin)


def _fp8(q: torch.Tensor, descales: tuple[object, object, object]) -> dict[str, object]:
    """The descales tunegen.attention takes: FlashAttention-3's, for float8_e4m3fn q, k, v."""
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        return dict(zip(("q_descale", "k_descale", "v_descale"), descales, strict=True))
    q_descale, k_descale, v_descale = descales
    require(q_descale=q_descale is None, k_descale=k_descale is None, v_descale=v_descale is None)
    return {}


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """Attention over (batch, seqlen, heads, head_dim) q and k, v (fewer heads for GQA/MQA): the
    output like q (bfloat16 for float8 inputs), and with `return_attn_probs` the log-sum-exp
    (batch, heads, seqlen_q) float32. Differentiable in 16-bit q, k, v."""
    require(qv=qv is None)
    _hints(num_splits, pack_gqa, sm_margin)
    local = served_local(causal, window_size, softcap, attention_chunk=attention_chunk)
    fp8 = _fp8(q, (q_descale, k_descale, v_descale))
    return dense(q, k, v, local, softmax_scale, return_attn_probs, deterministic, **fp8)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """`flash_attn_func` on q, k, v packed as qkv (batch, seqlen, 3, heads, head_dim), or with
    `num_heads_q` as (batch, seqlen, heads_q + 2 * kv_heads, head_dim)."""
    if num_heads_q is None:
        q, k, v = operand("qkv", qkv, "(batch, seqlen, 3, heads, head_dim)", 3).unbind(dim=2)
    else:
        operand("qkv", qkv, "(batch, seqlen, heads_q + 2 * kv_heads, head_dim)")
        kv_heads, odd = divmod(qkv.shape[2] - num_heads_q, 2)
        if odd or kv_heads < 1:
            raise ValueError(
                f"num_heads_q: qkv's {qkv.shape[2]} heads must be num_heads_q ({num_heads_q}) plus twice "
                "the key/value heads"
            )
        q, k, v = qkv.split([num_heads_q, kv_heads, kv_heads], dim=2)
    return flash_attn_func(
        q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
        attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """Attention over packed (total_tokens, heads, head_dim) sequences with int32 offsets
    `cu_seqlens_q`/`cu_seqlens_k` (batch + 1): the output like q, and with `return_attn_probs`
    the log-sum-exp (heads, total_q) float32. Differentiable in q, k, v."""
    require(
        seqused_q=seqused_q is None,
        seqused_k=seqused_k is None,
        qv=qv is None,
        q_descale=q_descale is None,
        k_descale=k_descale is None,
        v_descale=v_descale is None,
    )
    _hints(num_splits, pack_gqa, sm_margin)
    local = served_local(causal, window_size, softcap, attention_chunk=attention_chunk)
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
    )
    if not return_attn_probs:
        return result
    out, lse = result
    return out, flash_lse(lse)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """Attention of q (batch, seqlen_q, heads, head_dim) over a KV cache, contiguous (batch,
    slots, kv_heads, head_dim) or paged (pages, page_size, kv_heads, head_dim) with `page_table`;
    `k`, `v` are written into the cache in place at `cache_seqlens` first. A float8_e4m3fn cache
    takes `k_descale`/`v_descale` (batch, kv_heads) float32. Returns the output like q, and with
    `return_softmax_lse` (out, lse (batch, heads, seqlen_q) float32, out_accum, lse_accum), the
    last two empty. Not differentiable, as FlashAttention-3's. A window, the cap and chunks run as
    FlashAttention-3 reads them. `rotary_interleaved` applies to the rotary embedding, which
    tunegen does not serve."""
    require(
        qv=qv is None,
        rotary_cos=rotary_cos is None,
        rotary_sin=rotary_sin is None,
        rotary_seqlens=rotary_seqlens is None,
        cache_batch_idx=cache_batch_idx is None,
        cache_leftpad=cache_leftpad is None,
        cu_seqlens_q=cu_seqlens_q is None,
        cu_seqlens_k_new=cu_seqlens_k_new is None,
        max_seqlen_q=max_seqlen_q is None,
        q_descale=q_descale is None,
        scheduler_metadata=scheduler_metadata is None,
    )
    _hints(num_splits, pack_gqa, sm_margin)
    if cache_seqlens is None and k is not None:
        raise ValueError("cache_seqlens: required where k and v are appended (where to write them)")
    lengths = cache_lengths(cache_seqlens, q, k_cache, page_table)
    local = served_local(causal, window_size, softcap, attention_chunk=attention_chunk)
    result = decode_attention(
        q,
        k_cache,
        v_cache,
        lengths,
        k=k,
        v=v,
        block_table=page_table,
        scale=softmax_scale,
        return_lse=bool(return_softmax_lse),
        k_descale=k_descale,
        v_descale=v_descale,
        **local,
    )
    if not return_softmax_lse:
        return result
    out, lse = result
    empty = out.new_empty(0, dtype=torch.float32)
    return out, flash_lse(lse, inplace=True), empty, empty
