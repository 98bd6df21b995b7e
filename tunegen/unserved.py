"""FlashAttention's conventions, for `tunegen.flash_attn`, `tunegen.flash_attn_interface` and the
flash provider: what tunegen does not serve of FlashAttention's and PyTorch's attention arguments
and why (one table: they refuse by the argument's name rather than ignore it), how a causal flag
and a window become tunegen's causal flag, and the log-sum-exp of a row that sees no key."""

from __future__ import annotations

import torch

# Why an argument's value is not served, by the argument's name.
WHY = {
    "dropout_p": "tunegen applies no dropout; pass 0.0, as in evaluation",
    "return_debug_mask": "tunegen returns no attention probabilities",
    "alibi_slopes": "ALiBi is not served",
    "window_size_left": "sliding windows are not served yet",
    "window_size_right": "sliding windows are not served yet",
    "rotary_cos": "tunegen applies no rotary embedding; rotate q and k before the call",
    "rotary_sin": "tunegen applies no rotary embedding; rotate q and k before the call",
    "cache_batch_idx": "the cache's rows are the batch's, in order; index the cache before the call",
    "cache_leftpad": "left-padded caches are not served; pass None",
    "block_table": "paged keys are served by flash_attn_with_kvcache (tunegen.decode_attention), not here",
    "seqused_q": "per-sequence used lengths are not served here; pass None",
    "seqused_k": "per-sequence used lengths are not served here; pass None",
    "num_splits": "tunegen chooses its own split from its tuning; pass 0 (or 1)",
    "qv": "the extra QV product is not served",
    "q_descale": "descales apply to float8_e4m3fn q, k, v of flash_attn_func only",
    "k_descale": "descales apply to float8_e4m3fn inputs of flash_attn_func, or an FP8 KV cache",
    "v_descale": "descales apply to float8_e4m3fn inputs of flash_attn_func, or an FP8 KV cache",
    "pack_gqa": "tunegen groups GQA heads as its tuning chooses; pass None",
    "cu_seqlens_q": "packed queries over a KV cache are not served yet; pass None",
    "cu_seqlens_k_new": "packed new keys are not served yet; pass None",
    "max_seqlen_q": "packed queries over a KV cache are not served yet; pass None",
    "rotary_seqlens": "tunegen applies no rotary embedding; rotate q and k before the call",
    "scheduler_metadata": "tunegen schedules its own programs; pass None",
    "sm_margin": "tunegen's kernels use every SM; pass 0",
    "attn_mask": "tunegen takes no mask",
    "is_causal": "SDPA aligns a causal mask of unequal lengths top-left, tunegen bottom-right",
    "cum_seq_k": "packed queries need packed keys",
}


class Unserved(ValueError):
    """An argument's value tunegen does not serve; the message names the argument and says why."""


def require(**conditions: bool) -> None:
    """Unserved for the first argument whose condition does not hold."""
    for name, ok in conditions.items():
        if not ok:
            raise Unserved(f"{name}: {WHY[name]}")


def causal_of(causal: bool, left: int | None, right: int | None, seqlen_k: int | None, name: str) -> bool:
    """tunegen's causal flag for FlashAttention's `causal` and window (left, right), as
    FlashAttention reads them: None or a negative side is unbounded, and so is one of at least
    `seqlen_k` keys; causal bounds the right side at 0, and (-1, 0) alone is causal. Any bounded
    window left is Unserved under `name` (the window's argument name)."""

    def bounded(side: int | None) -> bool:
        return side is not None and side >= 0 and (seqlen_k is None or side < seqlen_k)

    if bounded(left):
        require(**{name: False})
    if causal or (right is not None and right == 0):
        return True
    if bounded(right):
        require(**{name: False})
    return False


def served_local(
    causal: object,
    window_size: object,
    softcap: object = 0.0,
    alibi_slopes: object = None,
    attention_chunk: object = 0,
) -> dict[str, object]:
    """`tunegen.attention`'s mask and features for FlashAttention's prefill arguments (ALiBi
    Unserved), as FlashAttention reads them: a negative side is unbounded (-1), and causal bounds
    the right side (its override of a right side under causal)."""
    require(alibi_slopes=alibi_slopes is None)
    left, right = (max(side, -1) for side in window_of(window_size))
    causal = bool(causal)
    window = (left, -1 if causal else right)
    return {"causal": causal, "window_size": window, "softcap": softcap, "attention_chunk": attention_chunk}


def window_of(window_size: object) -> tuple[int, int]:
    """FlashAttention's `window_size` (left, right) as two ints, or a ValueError naming it."""
    try:
        left, right = window_size  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected (left, right), two ints, got {window_size!r}") from None
    if not all(isinstance(side, int) and not isinstance(side, bool) for side in (left, right)):
        raise ValueError(f"window_size: expected (left, right), two ints, got {window_size!r}")
    return left, right


def flash_lse(lse: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """The log-sum-exp in FlashAttention's convention: +inf (not tunegen's -inf, the mathematical
    value) for a row that sees no key; in place where the caller owns `lse` alone (autograd may
    keep it for the backward otherwise)."""
    if inplace:
        return lse.masked_fill_(lse == float("-inf"), float("inf"))
    return lse.masked_fill(lse == float("-inf"), float("inf"))
