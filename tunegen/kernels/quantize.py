"""The fused FP8 quantize kernels (templates/quantize_fp8.py.j2): they read Q and K once and V twice
(its scale spans the sequence), rotate Q and K in registers and write the e4m3 tensors, their
descales, V's K-major layout and K's heads of whole 16-row groups. Not a
Family: it moves memory at the copy's speed with any sensible Variant, so nothing tunes it."""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import ClassVar

import torch

from tunegen.kernels import fp8
from tunegen.kernels.gpu import Gpu, gpu_of, interpreting
from tunegen.kernels.launch_args import QuantizeArgs
from tunegen.kernels.problem import DTYPE_NAMES
from tunegen.kernels.render import Rendered, load, render
from tunegen.kernels.variant import Variant

TEMPLATE = "quantize_fp8.py.j2"


@dataclasses.dataclass(frozen=True)
class QuantizeVariant(Variant):
    """Knobs of templates/quantize_fp8.py.j2: num_warps per program of SCALE_BLOCK rows. The kernel
    moves memory at the copy's speed with any sensible count, so it is not tuned."""

    family: ClassVar[str] = "quantize_fp8"

    num_warps: int = 8


def rendered(dtype: str, head_dim: int, group: int, hadamard: bool, per_block: bool, gpu: Gpu) -> Rendered:
    """The quantizer's source for inputs of `dtype` and `head_dim`, query heads per KV head `group`,
    rotated or not, scaled per block or per KV head, as `gpu` runs it."""
    interpreted = gpu.backend == "interpreter"
    features = {  # hadamard_block refuses, by name, head dims the rotation cannot take
        "head_dim": head_dim,
        "block_d": max(16, 1 << (head_dim - 1).bit_length()),
        "hadamard": fp8.hadamard_block(head_dim) if hadamard else 0,
        "group": group,
        "per_block": per_block,
        "scale_block": fp8.SCALE_BLOCK,
        # float32 inputs rotate in three TF32 products (float32's accuracy): one would err by 1e-3 of
        # the largest term, many e4m3 steps of a small rotated coordinate.
        "precision": "ieee" if interpreted else "tf32x3" if dtype == "float32" else None,
        "upcast": interpreted and dtype == "bfloat16",
        "emulate_fp8": interpreted,
    }
    variant = QuantizeVariant(num_warps=4 if interpreted else 8)
    return render(TEMPLATE, QuantizeVariant.family, variant, features)


@functools.cache
def _module(dtype: str, head_dim: int, group: int, hadamard: bool, per_block: bool, gpu: Gpu) -> ModuleType:
    source = rendered(dtype, head_dim, group, hadamard, per_block, gpu)
    return load(source, interpret=gpu.backend == "interpreter")


def outputs(q: torch.Tensor, k: torch.Tensor, *, per_block: bool) -> fp8.Fp8Inputs:
    """Uninitialized outputs of `quantize_fp8` for inputs shaped like q and k (v as k)."""
    batch, heads_q, seqlen_q = q.shape[:3]
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    e4m3 = {"device": q.device, "dtype": fp8.E4M3}
    f32 = {"device": q.device, "dtype": torch.float32}
    if per_block:
        q_descale = torch.empty(batch, heads_q, -(-seqlen_q // fp8.SCALE_BLOCK), **f32)
        k_descale = torch.empty(batch, heads_kv, -(-seqlen_k // fp8.SCALE_BLOCK), **f32)
    else:
        q_descale, k_descale = torch.empty(batch, heads_kv, **f32), torch.empty(batch, heads_kv, **f32)
    return fp8.Fp8Inputs(
        torch.empty(q.shape, **e4m3),
        fp8.empty_key_groups(k.shape, q.device),
        fp8.empty_k_major(k.shape, q.device),
        q_descale,
        k_descale,
        torch.empty(batch, heads_kv, **f32),
    )


def quantize_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: fp8.Fp8Inputs, *, hadamard: bool, per_block: bool
) -> None:
    """`quantize_fp8` by the fused kernel into `out`, laid out as `outputs` makes it (CUDA tensors,
    or CPU tensors under Triton's interpreter; q, k and v checked by the caller)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    gpu = gpu_of(q.device)
    module = _module(DTYPE_NAMES[q.dtype], head_dim, heads_q // heads_kv, hadamard, per_block, gpu)
    f32 = {"device": q.device, "dtype": torch.float32}
    scratch_q = scratch_k = torch.empty(1, **f32)  # block maxima, for tensors scaled per KV head
    if not per_block:
        scratch_q = torch.empty(batch, heads_q, -(-seqlen_q // fp8.SCALE_BLOCK), **f32)
        scratch_k = torch.empty(batch, heads_kv, -(-seqlen_k // fp8.SCALE_BLOCK), **f32)
    scratch = (scratch_q, scratch_k, torch.empty(batch, heads_kv, -(-seqlen_k // fp8.SCALE_BLOCK), **f32))
    v8 = out.v.transpose(2, 3)
    module.launch(
        QuantizeArgs(q, k, v, out.q, out.k, v8, out.q_descale, out.k_descale, out.v_descale, *scratch)
    )


def quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, hadamard: bool, per_block: bool
) -> fp8.Fp8Inputs:
    """`tunegen.quantize_fp8` on checked inputs: the fused kernel on CUDA tensors (and CPU tensors
    under TRITON_INTERPRET=1), PyTorch operations (`fp8.quantize_reference`) elsewhere."""
    device = q.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return fp8.quantize_reference(q, k, v, hadamard=hadamard, per_block=per_block)
    out = outputs(q, k, per_block=per_block)
    quantize_into(q, k, v, out, hadamard=hadamard, per_block=per_block)
    return out
