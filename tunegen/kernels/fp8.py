"""FP8 inputs for attention: the Walsh-Hadamard rotation that spreads outliers across head_dim,
and quantization to float8 e4m3 with per-block scales (FlashAttention-3's incoherent processing
and block quantization).

Descale factors follow FlashAttention-3: float32, `x ≈ x_fp8 · descale`. The kernels take
`q_descale` and `k_descale` per (batch, KV head), FA3's shape, or per block of SCALE_BLOCK rows:
(batch, heads_q, ceil(seqlen_q / SCALE_BLOCK)) for q, (batch, heads_kv, ceil(seqlen_k /
SCALE_BLOCK)) for k; `v_descale` is always per (batch, KV head).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Rows of Q or K sharing one scale; every FP8 kernel tile (at most 128 rows) lies inside one block.
SCALE_BLOCK = 128
MIN_HADAMARD_BLOCK = 16
_TINY = 1e-12


class Fp8Inputs(NamedTuple):
    """Quantized attention inputs and their descale factors, in `tunegen.attention`'s names:
    `tunegen.attention(**x._asdict(), causal=True)` runs them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor


def hadamard_block(head_dim: int) -> int:
    """The Walsh-Hadamard block size used for `head_dim`: its largest power-of-two divisor.

    A power-of-two head_dim is rotated as a whole; others (80, 96, 192) block-diagonally, which
    keeps QK^T exact without padding. Head dims whose block would be under 16 (not a multiple
    of 16) spread outliers too little and are refused.
    """
    block = head_dim & -head_dim
    if block < MIN_HADAMARD_BLOCK:
        raise ValueError(
            f"hadamard: the rotation needs head_dim to be a multiple of {MIN_HADAMARD_BLOCK} "
            f"(Walsh-Hadamard blocks of a power of two), got {head_dim}; pass hadamard=False"
        )
    return block


@functools.cache
def _hadamard_matrix(head_dim: int, device: torch.device) -> torch.Tensor:
    block = hadamard_block(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h / math.sqrt(block)] * (head_dim // block))
    return h.to(device=device, dtype=torch.float32)


def hadamard_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal (block-diagonal) Walsh-Hadamard matrix H of `head_dim`, float32: H·Hᵀ = I,
    so (qH)(kH)ᵀ = qkᵀ, while an outlier in one coordinate spreads evenly over its block."""
    return _hadamard_matrix(head_dim, torch.device(device))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x rotated along its last dimension (head_dim), in float32: one matrix product, which a GPU
    runs at memory speed for head dims up to 256."""
    return torch.matmul(x.float(), hadamard_matrix(x.shape[-1], x.device))


def _to_e4m3(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return (x / descale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _descale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp_min(_TINY) / E4M3_MAX


def quantize_blocks(x: torch.Tensor, group: int, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (batch, heads, seqlen, head_dim) to e4m3 so that each block's largest magnitude
    maps to 448. Blocks: `block` rows of one head (descale (batch, heads, ceil(seqlen / block))),
    or with block None all rows of the `group` heads sharing a KV head (descale (batch, heads /
    group))."""
    b, h, n, d = x.shape
    x = x.float()
    if block is None:
        descale = _descale_of(x.reshape(b, h // group, group * n * d).abs().amax(-1))
        expanded = descale.repeat_interleave(group, 1)[..., None, None]
        return _to_e4m3(x, expanded), descale
    blocks = -(-n // block)
    padded = F.pad(x, (0, 0, 0, blocks * block - n)).view(b, h, blocks, block * d)
    descale = _descale_of(padded.abs().amax(-1))
    expanded = descale.repeat_interleave(block, 2)[..., :n, None]
    return _to_e4m3(x, expanded), descale


def dequantize(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x_fp8 (batch, heads, seqlen, head_dim) times its descale, in `dtype`: per (batch, KV head)
    (2-D, heads a multiple of its KV heads) or per block of rows (3-D)."""
    heads, n = x.shape[1], x.shape[2]
    if descale.dim() == 2:
        scale = descale.repeat_interleave(heads // descale.shape[1], 1)[..., None, None]
    else:
        scale = descale.repeat_interleave(SCALE_BLOCK, 2)[..., :n, None]
    return x.to(dtype) * scale.to(dtype)


def quantize_kv(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """New cache entries x (batch, tokens, kv_heads, head_dim) quantized with a cache's descales
    (batch, kv_heads), saturating at ±448."""
    return _to_e4m3(x.float(), descale[:, None, :, None].float())


def calibrate_kv(x: torch.Tensor, headroom: float) -> torch.Tensor:
    """Descales (batch, kv_heads) for a cache whose first tokens are x (batch, tokens, kv_heads,
    head_dim): their largest magnitude per head times `headroom` maps to 448."""
    return _descale_of(x.float().abs().amax(dim=(1, 3)) * headroom)


def empty_k_major(shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialized e4m3 (batch, heads, seqlen, head_dim) tensor whose memory is K-major:
    (head_dim, seqlen) per head, rows padded to 16 bytes. Hopper's FP8 products read their right
    operand so (V in P·V), and `quantize_fp8` writes V so."""
    b, h, n, d = shape
    return torch.empty((b, h, d, -(-n // 16) * 16), device=device, dtype=E4M3)[..., :n].transpose(2, 3)


def empty_key_groups(shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialized e4m3 (batch, heads, seqlen, head_dim) tensor whose heads are whole groups
    of 16 rows apart: a view of (batch, heads, ceil(seqlen / 16) * 16, head_dim) contiguous memory,
    contiguous itself where seqlen is a multiple of 16. The Hopper schedule's FP8 kernel reads K's
    rows in its own order from 16-row groups (a rank-5 TMA box), and `quantize_fp8` writes K so."""
    b, h, n, d = shape
    return torch.empty((b, h, -(-n // 16) * 16, d), device=device, dtype=E4M3)[:, :, :n]


def k_major(x8: torch.Tensor) -> torch.Tensor:
    """e4m3 x8 (batch, heads, seqlen, head_dim) copied into `empty_k_major`'s layout."""
    view = empty_k_major(x8.shape, x8.device)
    view.copy_(x8)
    return view


def is_k_major(x: torch.Tensor) -> bool:
    """Whether (batch, heads, seqlen, head_dim) x is laid out as `empty_k_major` makes it: seqlen
    contiguous, each head_dim row starting 16 bytes after the last."""
    return x.stride(2) == 1 and (x.shape[3] == 1 or (x.stride(3) * x.element_size()) % 16 == 0)


def quantize_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, hadamard: bool, per_block: bool
) -> Fp8Inputs:
    """`tunegen.quantize_fp8` in PyTorch operations (the CPU path and the kernel's reference): the
    same rotation, scales and layouts, one tensor operation at a time."""
    group = q.shape[1] // k.shape[1]
    if hadamard:
        q, k = rotate(q), rotate(k)
    rows = SCALE_BLOCK if per_block else None
    q8, q_descale = quantize_blocks(q, group, rows)
    k8, k_descale = quantize_blocks(k, 1, rows)
    v8, v_descale = quantize_blocks(v, 1, None)
    k_groups = empty_key_groups(k8.shape, k8.device)
    k_groups.copy_(k8)
    return Fp8Inputs(q8, k_groups, k_major(v8), q_descale, k_descale, v_descale)
