"""Where the prefill family's Hopper schedule ("ws", FlashAttention-3's warp-specialized loop in
Gluon) runs: the GPU, the Triton version, and the inputs it was written for."""

from __future__ import annotations

from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem

WS_HEAD_DIMS = (64, 128)


def check_ws(problem: Problem, gpu: Gpu) -> None:
    """Where schedule "ws" runs: Hopper's wgmma and TMA (sm_90; not the interpreter, which cannot
    run Gluon), Gluon as of Triton 3.6, 16-bit or FP8 inputs whose rows TMA can address, head dims
    its register budget was sized for, and dense batches (varlen takes schedule "fa2")."""
    if gpu.backend != "cuda" or gpu.capability != (9, 0):
        where = "Triton's interpreter" if gpu.backend == "interpreter" else f"{gpu.name} {gpu.capability}"
        raise ValueError(f"variant.schedule: 'ws' needs a Hopper GPU (sm_90), not {where}")
    if _triton_version(gpu.triton_version) < (3, 6):
        raise ValueError(
            f"variant.schedule: 'ws' is written for Triton >= 3.6's Gluon, not {gpu.triton_version}"
        )
    if problem.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"variant.schedule: 'ws' takes float16 or bfloat16 inputs, got {problem.dtype}")
    if problem.head_dim not in WS_HEAD_DIMS:
        raise ValueError(
            f"variant.schedule: 'ws' takes head dims {WS_HEAD_DIMS}, got {problem.head_dim} ('fa2' runs it)"
        )
    if problem.varlen:
        raise ValueError("variant.schedule: 'ws' runs dense batches; varlen takes 'fa2'")
    if not problem.aligned:
        raise ValueError("variant.schedule: 'ws' loads by TMA, which needs 16-byte aligned bases and strides")


def _triton_version(text: str) -> tuple[int, int]:
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)
