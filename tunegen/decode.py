"""Decode attention over a KV cache, in FlashAttention's `flash_attn_with_kvcache` conventions."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tunegen import checks
from tunegen.backends import capturing
from tunegen.calls.decode import DecodeCall, unit_descales
from tunegen.calls.local import NO_WINDOW, local_arguments
from tunegen.kernels import dispatch, launcher
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.launch_args import DecodeArgs

# TUNEGEN_CHECK=1 when tunegen is imported: every decode call checks its lengths and pages on the
# host (read once: the environment is slow to read on every call).
CHECK = os.environ.get("TUNEGEN_CHECK", "0").lower() in ("1", "true", "on", "yes")


def checking(check: bool | None) -> bool:
    """Whether a call reads its lengths and pages back to check them: `check`, else CHECK."""
    return CHECK if check is None else bool(check)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    check: bool | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new query tokens per sequence over a KV cache (`flash_attn_with_kvcache`).

    q (batch, nq, heads, head_dim). The cache is contiguous, k_cache/v_cache (batch, slots,
    kv_heads, head_dim), or paged, (pages, page_size, kv_heads, head_dim) with `block_table`
    (batch, max_pages) int32 naming each sequence's pages in order (any physical order).
    `cache_seqlens` (batch,) int32: tokens already cached per sequence. `k`/`v` (batch,
    new_tokens, kv_heads, head_dim), when given, are written into the cache at those lengths
    first (in place; the caller advances `cache_seqlens`). `causal` aligns bottom-right: query i
    of nq sees the cache up to its own position. Returns (batch, nq, heads, head_dim), and with
    `return_lse` the log-sum-exp (batch, heads, nq) in float32.

    The lengths and the block table stay on the GPU: a call never waits for the device. A
    sequence whose length is negative or leaves no room for its new tokens, or whose pages lie
    outside the cache, reads and writes nothing and gets NaN outputs. `check=True` (default:
    TUNEGEN_CHECK=1) reads them back first and raises a ValueError naming the problem (a
    device-to-host copy per call; skipped while a CUDA graph is being captured).

    An FP8 cache (float8_e4m3fn k_cache/v_cache, half the bytes of bf16) takes float16 or
    bfloat16 queries and new tokens, with `k_descale`/`v_descale` (batch, kv_heads) float32
    (FlashAttention-3's names; None means 1): cached value = e4m3 value x descale. The kernel
    widens the cache to float16 in registers; new tokens are divided by the descales and rounded
    to e4m3 (saturating at ±448) as they are appended.

    `window_size`, `attention_chunk`, `softcap` and `sinks` as `tunegen.attention`'s (query i of nq
    at position cache_seqlens + new_tokens - nq + i): the splits of a window's or chunk's cache
    start at its first key, so pages before it are never read.
    """
    key = _launch_key(q, k_cache, v_cache, cache_seqlens, block_table, k, v, k_descale, v_descale)
    if key is not None and local_arguments(window_size, attention_chunk, softcap, sinks):
        key = _local_key(key, window_size, attention_chunk, softcap, sinks)
    key = None if key is None else (*key, bool(causal), bool(return_lse))
    fast = None if key is None else dispatch.fast_calls.get(key)
    if fast is not None and not checking(check):
        return fast(q, k_cache, v_cache, cache_seqlens, block_table, k, v, k_descale, v_descale, scale, sinks)
    call = DecodeCall.checked(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k=k,
        v=v,
        block_table=block_table,
        causal=causal,
        scale=scale,
        return_lse=return_lse,
        strict=strict,
        k_descale=k_descale,
        v_descale=v_descale,
        read_lengths=checking(check) and not capturing(q),
        window_size=window_size,
        attention_chunk=attention_chunk,
        softcap=softcap,
        sinks=sinks,
    )
    if call.backend() == "torch":
        out, lse = call.fallback()
        return (out, lse) if return_lse else out
    kernel = dispatch.kernel_for(call.problem(), gpu_of(q.device))
    out, lse = call.outputs()
    args = call.args(out, lse)
    if key is None or q.device.type != "cuda":
        kernel.launch(args)
    else:
        bound = kernel.bind(args)
        dispatch.fast_calls[key] = _fast(bound, call)
        bound(args)
    return (out, lse) if return_lse else out


def _launch_key(q, k_cache, v_cache, cache_seqlens, block_table, k, v, k_descale, v_descale) -> tuple | None:
    """The tensors' part of a call's launch key (see eager.run), or None where they are not tensors
    or not hashable (the checks then say what is wrong)."""
    try:
        plain = block_table is None and k is None and v is None and k_descale is None and v_descale is None
        tensors = launcher.key_of(q, k_cache, v_cache, cache_seqlens)
        return tensors, None if plain else launcher.key_of(block_table, k, v, k_descale, v_descale)
    except (AttributeError, TypeError):
        return None


def _local_key(key: tuple, window_size, attention_chunk, softcap, sinks) -> tuple | None:
    """A launch key with the features of current models: their values as passed (a tuple of two
    ints, an int, an int or float: values the checks passed once pass again) and the sinks by
    layout; None where they are of another kind (those calls take the checked path every time)."""
    window_ok = type(window_size) is tuple and len(window_size) == 2
    if not window_ok or any(type(w) is not int for w in window_size):
        return None
    if type(attention_chunk) is not int or type(softcap) not in (int, float):
        return None
    try:
        layout = None if sinks is None else launcher.key_of(sinks)
    except (AttributeError, TypeError):
        return None
    return (*key, window_size, attention_chunk, softcap, layout)


def _fast(bound: Callable[[DecodeArgs], None], call: DecodeCall) -> Callable[..., object]:
    """The whole of every later call with `call`'s launch key (see tunegen.kernels.launcher):
    outputs, the descales None stands for, the cap and the sinks (as float32, as the checks take
    them), the bound launch."""
    q = call.q
    cap = call.local.softcap
    ones = unit_descales(q.shape[0], call.k_cache.shape[2], q.device) if call.descales is not None else None
    fp8_cache, return_lse, head_dim = ones is not None, call.return_lse, q.shape[-1]
    check_scale, empty_like, empty, f32 = checks.check_scale, torch.empty_like, torch.empty, torch.float32
    default_scale = check_scale(None, head_dim)

    def fast(q, k_cache, v_cache, cache_seqlens, block_table, k, v, k_descale, v_descale, scale, sinks):
        out = empty_like(q)
        lse = empty((q.shape[0], q.shape[2], q.shape[1]), device=q.device, dtype=f32) if return_lse else None
        args = DecodeArgs(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            out,
            lse,
            default_scale if scale is None else check_scale(scale, head_dim),
            block_table,
            k,
            v,
        )
        if fp8_cache:
            args.k_descale = ones if k_descale is None else k_descale
            args.v_descale = ones if v_descale is None else v_descale
        if sinks is not None:
            args.softcap, args.sinks = cap, sinks.detach().to(f32).contiguous()
        elif cap:
            args.softcap = cap
        bound(args)
        return (out, lse) if return_lse else out

    return fast
