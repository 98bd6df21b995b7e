"""Gpu: the identity of the device a kernel was compiled and timed on."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

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

    @property
    def model(self) -> str:
        """The model whose own sweep picks the defaults where models of one arch measured apart:
        "h200" (1.4x the H100's memory bandwidth; benchmarks/results/issue31_h200.md), "h100", else
        the arch."""
        for model in ("H200", "H100"):
            if model in self.name.upper():
                return model.lower()
        return self.arch


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What compiling a kernel reads of a CUDA device, under torch's names for its properties:
    enough for a process that never touches CUDA to compile for it (`set_meta_device`) and to name
    its Gpu. Plain data, so it crosses processes."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    L2_cache_size: int
    shared_memory_per_block_optin: int
    shared_memory_per_block: int

    def gpu(self) -> Gpu:
        """The Gpu record of the device, as `cuda_gpu` gives it."""
        return Gpu(
            name=self.name,
            capability=(self.major, self.minor),
            sm_count=self.multi_processor_count,
            smem_per_block=self.shared_memory_per_block_optin or self.shared_memory_per_block,
            triton_version=triton.__version__,
            torch_version=torch.__version__,
            backend="cuda",
        )


@functools.cache
def device_facts(index: int) -> DeviceFacts:
    """The facts of CUDA device `index` (cached: properties never change in a process). Reading
    them initializes CUDA in this process but makes no context."""
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(
        name=props.name,
        major=props.major,
        minor=props.minor,
        multi_processor_count=props.multi_processor_count,
        L2_cache_size=props.L2_cache_size,
        shared_memory_per_block_optin=int(getattr(props, "shared_memory_per_block_optin", 0)),
        shared_memory_per_block=int(props.shared_memory_per_block),
    )


@functools.cache
def cuda_gpu(index: int) -> Gpu:
    """The Gpu record of CUDA device `index`."""
    return device_facts(index).gpu()


_meta_device: DeviceFacts | None = None


def set_meta_device(facts: DeviceFacts) -> None:
    """From now on, kernels bound to meta tensors in this process compile for the device `facts`
    describes (`meta_facts`), and nothing asks CUDA about the current device: a process that
    asks initializes CUDA, 0.3-0.4 s, then torch registers its own Triton kernels, 0.4-0.7 s
    more (2 x H200 host, 2026-11-26), all on a tuning compile worker's first compile."""
    global _meta_device
    _meta_device = facts


def meta_device_given() -> DeviceFacts | None:
    """The device given to `set_meta_device` in this process, if any."""
    return _meta_device


def meta_facts() -> DeviceFacts:
    """The device that kernels bound to meta tensors compile for: the one given to `set_meta_device`,
    else the current CUDA device."""
    return _meta_device or device_facts(torch.cuda.current_device())


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


# What the NVIDIA kernel module says of itself on Linux: "NVRM version: NVIDIA UNIX ... Kernel
# Module [for x86_64]  580.82.07  Release Build ...".
DRIVER_FILE = Path("/proc/driver/nvidia/version")


@functools.cache
def driver_version() -> str:
    """The NVIDIA driver's version: the kernel module's own line where Linux shows it, else from
    nvidia-smi where it is installed (which takes seconds on a host whose GPUs sleep between
    programs), else empty."""
    import shutil
    import subprocess

    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", DRIVER_FILE.read_text())
    except OSError:
        found = None
    if found:
        return found.group(1)
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
