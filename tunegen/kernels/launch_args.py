"""What one launch of each family's kernel takes, by name: the tensors it reads and writes and the
values it needs, built by the public calls (tunegen.calls), the tuner's cases and the tests.

A rendered module's `bind(args)` and `launch(args)` take one of these; its launch key reads the
fields the bound call depends on beyond their values (tunegen.kernels.launcher.key_of). Slotted
dataclasses: building one costs about what passing its fields positionally did, on every call.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class PrefillArgs:
    """The prefill family's launch: q, k, v (batch, heads, seqlen, head_dim), or packed (total_tokens,
    heads, head_dim) with the varlen fields; out like q (bfloat16 for float8 e4m3 inputs); lse the
    log-sum-exp in float32, (batch, heads, seqlen_q) or packed (heads, total_q), or None; scale the
    softmax's. FP8 Problems take e4m3 q, k, v with float32 descales (tunegen.kernels.fp8's layout).
    Problems with `softcap` take the cap (> 0), with `sinks` one float32 logit per query head
    (contiguous, (heads,)).

    Paged Problems (`Problem.paged`, chunked prefill over a KV cache, FlashAttention's
    `block_table`/`seqused_k`): q packed as above with cu_seqlens_q and max_seqlen_q; k, v the
    caches (num_pages, page_size, kv_heads, head_dim), unit last stride, the page size
    `Problem.page_size` (a multiple of 16); cu_seqlens_k None; `block_table` (batch, max_pages)
    int32 with a unit last stride, sequence b's key j in page block_table[b, j // page_size] at row
    j % page_size (only the first ceil(seqused_k[b] / page_size) entries of a row are meaningful);
    `seqused_k` (batch,) int32, each sequence's number of keys (0 allowed; at most the call's
    max_seqlen_k, whose bucket is `Problem.seqlen_k`). The causal mask is aligned bottom-right per
    sequence, on its query count and seqused_k."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    scale: float
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class DecodeArgs:
    """The decode family's launch: q (batch, nq, heads, head_dim) over k_cache, v_cache (contiguous
    (batch, slots, kv_heads, head_dim), or pages with block_table), cache_seqlens (batch,) int32;
    out like q; lse (batch, heads, nq) float32 or None; new k, v to append first, or None; an e4m3
    cache's float32 descales (batch, kv_heads); the cap and the sinks as `PrefillArgs` takes them."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    scale: float
    block_table: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class BackwardArgs:
    """The backward family's launch: the forward's q, k, v, its output and log-sum-exp (float32),
    the gradients of both (dout like out; dlse like lse, or None), and dq, dk, dv to write; packed
    tensors take the varlen fields (the maxima bound the lengths). Problems with `softcap` take the
    cap, with `sinks` the forward's sinks as `PrefillArgs` takes them and `dsinks` (float32,
    (heads,)) to write their gradient into."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    scale: float
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    dsinks: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class QuantizeArgs:
    """The FP8 quantizer's launch (tunegen.kernels.quantize): 16-bit q, k, v in, e4m3 q8, k8, v8
    and their float32 descales out, with float32 scratch for the running maxima."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    amax_q: torch.Tensor
    amax_k: torch.Tensor
    amax_v: torch.Tensor
