"""Which path a call runs: a compiled Triton kernel, Triton's interpreter, or the PyTorch reference
(refused in strict mode); and whether autograd records it."""

from __future__ import annotations

import os

import torch

from tunegen.kernels.gpu import interpreting


class FallbackError(RuntimeError):
    """Raised in strict mode when a call would not run a Triton kernel."""


def strict_default() -> bool:
    """Whether TUNEGEN_STRICT asks that anything but a Triton kernel be an error."""
    return os.environ.get("TUNEGEN_STRICT", "0").lower() in ("1", "true", "on", "yes")


def backend_for(device: torch.device, strict: bool | None = None) -> str:
    """Which path runs on `device`: "cuda" (compiled Triton), "interpreter" (Triton's interpreter
    on CPU tensors, with TRITON_INTERPRET=1) or "torch" (the PyTorch reference, refused when strict)."""
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu" and interpreting():
        return "interpreter"
    if strict is None:
        strict = strict_default()
    if strict:
        raise FallbackError(
            f"strict mode: no Triton kernel runs on {device.type} tensors "
            "(use CUDA tensors, or CPU tensors with TRITON_INTERPRET=1)"
        )
    return "torch"


def fallback_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the PyTorch fallback computes in: float32, or float64 for float64 inputs."""
    return torch.float32 if dtype != torch.float64 else torch.float64


def wants_grad(q: object, k: object, v: object, sinks: object = None) -> bool:
    """Whether autograd records and q, k, v or the sinks require grad (about 0.3 µs; arguments that
    are not tensors are left to the checks)."""
    try:
        return torch.is_grad_enabled() and (
            q.requires_grad
            or k.requires_grad
            or v.requires_grad
            or (sinks is not None and sinks.requires_grad)
        )
    except AttributeError:
        return False


def capturing(t: object) -> bool:
    """Whether `t` is a CUDA tensor and a CUDA graph is being captured on the current stream (where
    a call must not read anything back to the host)."""
    cuda = isinstance(t, torch.Tensor) and t.device.type == "cuda"
    return cuda and torch.cuda.is_current_stream_capturing()
