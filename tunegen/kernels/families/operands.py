"""What the prefill, decode and backward families share about their operands: the head-dim tile,
tl.dot's precision for the input dtype, and where tensor descriptors may load the inputs."""

from __future__ import annotations

from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem


def block_d(head_dim: int, fp8: bool = False) -> int:
    """The head-dim tile: the next power of two, at least tl.dot's smallest K on NVIDIA GPUs (16,
    or 32 for e4m3 operands)."""
    return max(32 if fp8 else 16, 1 << (head_dim - 1).bit_length())


WS_PART = 64  # columns of each part of a Hopper head-dim tile between powers of two


def ws_block_d(head_dim: int, fp8: bool = False) -> tuple[int, int]:
    """The Hopper schedule's head-dim tile and the width of its parts. Gluon's tiles are powers of
    two, but wgmma's K and N take any multiple of 16: a head dim past 128 that is not past 192 runs
    in three parts of 64 columns (each its own shared-memory tile, TMA box and output accumulator)
    rather than in 256, whose padding is a third more work than the head dim needs. Elsewhere one
    part, the next power of two (`block_d`)."""
    d = block_d(head_dim, fp8)
    if 128 < head_dim <= 192 and not fp8:
        return 192, WS_PART
    return d, d


def dot_precision(problem: Problem) -> str | None:
    """tl.dot's input_precision for the Problem's dtype: "ieee" for float32, which would otherwise
    multiply in TF32 on tensor cores (a 1e-3 relative error where float32 promises 1e-6)."""
    return "ieee" if problem.dtype == "float32" else None


def check_descriptors(problem: Problem, gpu: Gpu) -> None:
    """Raise ValueError if tensor descriptors (load "desc") cannot read `problem`'s inputs on
    `gpu`: they take 16-bit, 16-byte aligned inputs and compute capability 9.0."""
    if problem.dtype == "float32":
        raise ValueError("variant.load: 'desc' takes 16-bit inputs; float32 needs 'ptr'")
    if not problem.aligned:
        raise ValueError(
            "variant.load: 'desc' needs 16-byte aligned base addresses and strides; these inputs need 'ptr'"
        )
    if gpu.backend == "cuda" and gpu.capability < (9, 0):
        raise ValueError(
            f"variant.load: 'desc' needs compute capability 9.0 or newer, {gpu.name} has {gpu.capability}"
        )


def load_paths(problem: Problem, gpu: Gpu) -> list[str]:
    """The load knob's values worth searching for `problem` on `gpu`: "desc" where it may run."""
    try:
        check_descriptors(problem, gpu)
    except ValueError:
        return ["ptr"]
    return ["ptr", "desc"]


def approx_tanh(problem: Problem, gpu: Gpu) -> bool:
    """Whether the cap (`softcap`) takes the GPU's tanh.approx, one special-function operation:
    16-bit inputs on a CUDA GPU, whose P it is precise enough for (2^-11), not float32's. Forward
    and backward alike, so that the backward's P matches the forward's log-sum-exp."""
    return gpu.backend == "cuda" and problem.dtype != "float32"
