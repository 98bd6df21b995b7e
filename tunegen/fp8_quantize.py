"""`tunegen.quantize_fp8`: 16-bit attention inputs to float8 e4m3 for `tunegen.attention`, by one
fused kernel (tunegen.kernels.quantize) where a Triton kernel runs, by PyTorch operations
(`tunegen.kernels.fp8.quantize_reference`) elsewhere."""

from __future__ import annotations

import torch

from tunegen import checks
from tunegen.kernels import fp8, quantize


def quantize_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    hadamard: bool = True,
    per_block: bool = True,
) -> fp8.Fp8Inputs:
    """Rotate (optionally) and quantize attention inputs to float8 e4m3 for `tunegen.attention`.

    q (batch, heads_q, seqlen_q, head_dim), k and v (batch, heads_kv, seqlen_k, head_dim), in
    float16, bfloat16 or float32. With `hadamard`, q and k are multiplied by the orthonormal
    Walsh-Hadamard matrix along head_dim (see `tunegen.kernels.fp8.hadamard_block`), which leaves QKᵀ
    unchanged and spreads outlier features over many coordinates before rounding. With
    `per_block`, q and k get one scale per SCALE_BLOCK (128) rows of each head; otherwise one per
    (batch, KV head), FlashAttention-3's layout. v is scaled per (batch, KV head). Each block's
    largest magnitude maps to 448, e4m3's largest.

    The returned v has v's shape but is K-major in memory, (head_dim, seqlen) per head (a
    transposed view), the layout Hopper's FP8 products read; q is contiguous, and k's heads are
    whole groups of 16 rows apart (contiguous where 16 divides seqlen_k), the memory the Hopper
    schedule reads K's rows from in its own order (it copies a k laid out otherwise, such as a
    `.contiguous()` of this one). On CUDA tensors (and CPU tensors under
    TRITON_INTERPRET=1) two fused kernels do it all, reading q and k once and v twice (its scale
    spans the whole sequence); elsewhere PyTorch operations compute the same.
    """
    checks.check_attention(q, k, v)
    return quantize.quantize(q, k, v, hadamard=hadamard, per_block=per_block)
