"""The eager body of the prefill calls: a checked call (tunegen.calls.prefill) dispatched and
launched, or served by the PyTorch reference; and the fast path of `attention`'s repeated calls.
`attention`, `attention_varlen`, their autograd Function and their custom ops all run `run`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tunegen import checks
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch
from tunegen.kernels.gpu import gpu_of
from tunegen.kernels.launch_args import PrefillArgs


def run(
    call: PrefillCall, key: tuple | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and log-sum-exp (None unless `call.return_lse`) of `call`: the kernel dispatched
    for its Problem, or where no Triton kernel runs, the PyTorch reference. On CUDA, with a `key`
    (`attention`'s launch key), later calls of that key take the fast path. With `out` (q's shape
    and dtype, any strides with a unit last one; never with a key, whose fast path allocates), the
    kernel writes the output there.

    The key holds everything the checks, the Problem and the launch depend on (shapes, strides,
    dtypes, devices, 16-byte alignment, flags: launcher.key_of of q, k, v, then causal and
    return_lse), so that a later call whose tensors match skips all three and goes from one dict
    lookup to the compiled kernel's launch."""
    backend = call.backend()
    if backend == "torch":
        result, lse = call.fallback()
        if out is None:
            return result, lse if call.return_lse else None
        return out.copy_(result), lse if call.return_lse else None
    out, lse = call.outputs(out)
    kernel = dispatch.kernel_for(call.problem(out), gpu_of(call.q.device))
    args = call.args(out, lse)
    if key is None or backend != "cuda":
        kernel.launch(args)
    else:
        bound = kernel.bind(args)
        dispatch.fast_calls[key] = _fast(bound, call)
        bound(args)
    return out, lse


def _fast(bound: Callable[[PrefillArgs], None], call: PrefillCall) -> Callable[..., object]:
    """The whole of every later `attention` call with `call`'s launch key: outputs, the scale, the
    bound launch (see tunegen.kernels.launcher)."""
    return_lse, head_dim = call.return_lse, call.q.shape[-1]
    check_scale, empty_like, empty, f32 = checks.check_scale, torch.empty_like, torch.empty, torch.float32
    default_scale = check_scale(None, head_dim)

    def fast(q, k, v, scale):
        out = empty_like(q)
        lse = empty(q.shape[:3], device=q.device, dtype=f32) if return_lse else None
        bound(
            PrefillArgs(q, k, v, out, lse, default_scale if scale is None else check_scale(scale, head_dim))
        )
        return (out, lse) if return_lse else out

    return fast
