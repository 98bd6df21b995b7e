"""The GPU's measured ceilings for the roofline: dense matmul FLOP/s per input dtype and device
copy bandwidth, timed the same way as every kernel (tunegen.tuning.timing)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import triton

from tunegen.kernels.gpu import cuda_gpu
from tunegen.tuning.timing import median_ms


def _matmul_tflops(dtype: torch.dtype, size: int) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to("cuda")
    b = torch.randn(size, size, generator=gen).to("cuda")
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        a8, b8 = a.to(dtype), b.to(dtype).t()  # _scaled_mm takes its second operand column-major
        ms = median_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:
        a, b = a.to(dtype), b.to(dtype)
        ms = median_ms(lambda: a @ b)
    return 2.0 * size**3 / ms / 1e9


def copy_gbps(nbytes: int) -> float:
    """GB/s of a device-to-device copy of `nbytes` (bytes read plus bytes written), timed as every
    kernel is: the ceiling of a kernel that reads those bytes once."""
    src = torch.randn(max(1, nbytes // 4), device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2.0 * src.numel() * src.element_size() / ms / 1e6


def measure(size: int = 8192, megabytes: int = 2048) -> dict[str, Any]:
    """Measure bf16 and (where the GPU has it) fp8 matmul, and copy bandwidth (read + write)."""
    if not torch.cuda.is_available():
        raise RuntimeError("ceilings are measured on a CUDA GPU")
    gpu = cuda_gpu(torch.cuda.current_device())
    peaks = {"bf16": _matmul_tflops(torch.bfloat16, size)}
    if torch.cuda.get_device_capability() >= (8, 9):
        peaks["fp8"] = _matmul_tflops(torch.float8_e4m3fn, size)
    return {
        "gpu": gpu.name,
        "matmul_tflops": peaks,
        "copy_tbps": copy_gbps(megabytes * 2**20) / 1e3,
        "source": (
            f"tunegen bench ceilings on {gpu.name}, Triton {triton.__version__}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}: {size}^3 matmul, {megabytes} MiB copy"
        ),
    }
