"""Gpu: the identity of the device a kernel was compiled and timed on."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Name, compute capability, SM count, shared memory per block and the compiling stack."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    triton_version: str
    torch_version: str
    backend: str  # "cuda" or "interpreter"

    @property
    def arch(self) -> str:
        """The class of GPU that default Variants are chosen for."""
        if self.backend == "interpreter":
            return "interpreter"
        major = self.capability[0]
        if major >= 10:
            return "blackwell"
        if major == 9:
            return "hopper"
        if major == 8:
            return "ampere"
        return "older"


@functools.cache
def cuda_gpu(index: int) -> Gpu:
    """The Gpu record of CUDA device `index` (cached: properties never change in a process)."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return Gpu(
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        smem_per_block=int(smem),
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        backend="cuda",
    )


@functools.cache
def interpreter_gpu() -> Gpu:
    """The stand-in Gpu for kernels run by Triton's interpreter on the CPU."""
    return Gpu(
        name="triton-interpreter",
        capability=(0, 0),
        sm_count=1,
        smem_per_block=0,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        backend="interpreter",
    )


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): on CPU tensors, then."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def gpu_of(device: torch.device) -> Gpu:
    """The Gpu that runs kernels for tensors on `device`."""
    if device.type == "cuda":
        return cuda_gpu(device.index if device.index is not None else torch.cuda.current_device())
    return interpreter_gpu()


@functools.cache
def driver_version() -> str:
    """The NVIDIA driver's version, from nvidia-smi where it is installed (else empty)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""
