"""tunegen's functions as PyTorch custom ops (`torch.ops.tunegen.*`), with fake-tensor shapes,
so `torch.compile(fullgraph=True)` traces a call as one opaque op instead of breaking the graph
on its Python checks and dispatch."""

from __future__ import annotations

import torch

from tunegen import api


@torch.library.custom_op("tunegen::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention(); the log-sum-exp is a 0-element tensor unless asked for."""
    if return_lse:
        return api.attention_eager(q, k, v, causal=causal, scale=scale, return_lse=True)
    out = api.attention_eager(q, k, v, causal=causal, scale=scale)
    return out, q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _(q, k, v, causal, scale, return_lse):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tunegen::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_varlen(); the log-sum-exp is a 0-element tensor unless asked for."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if return_lse:
        return api.attention_varlen_eager(*args, causal=causal, scale=scale, return_lse=True)
    out = api.attention_varlen_eager(*args, causal=causal, scale=scale)
    return out, q.new_empty(0, dtype=torch.float32)


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse):
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)
