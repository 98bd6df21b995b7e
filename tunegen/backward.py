"""Gradients of `attention` and `attention_varlen`.

The eager path wraps a checked prefill call (tunegen.calls.prefill) in a torch.autograd.Function
that keeps q, k, v, the output and the log-sum-exp; the custom ops (tunegen.ops) run the same
backward body for torch.compile. The body dispatches the backward family's kernel like the
forward does (Winner, nearest bucket, default), or, where no Triton kernel runs, differentiates
the PyTorch reference.
"""

from __future__ import annotations

import dataclasses

import torch

from tunegen import eager
from tunegen.calls.backward import BackwardCall, Grads
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch
from tunegen.kernels.gpu import gpu_of


def gradients(call: BackwardCall) -> Grads:
    """dq, dk, dv of `call.forward`, and where it has sinks their gradient (float32, (heads,)): the
    kernel dispatched for the backward Problem (where the forward asked for it, or under
    torch.use_deterministic_algorithms, its fixed-order form: the same bits on every run), or
    where no Triton kernel runs, autograd through the forward's reference."""
    if call.forward.backend() == "torch":
        return call.fallback()
    grads = call.outputs()
    problem, gpu = call.problem(), gpu_of(call.forward.q.device)
    if call.forward.deterministic or torch.are_deterministic_algorithms_enabled():
        kernel = dispatch.deterministic_kernel_for(problem, gpu)
    else:
        kernel = dispatch.kernel_for(problem, gpu)
    kernel.launch(call.args(*grads))
    return grads


class AttentionFunction(torch.autograd.Function):
    """A prefill call with gradients, for the eager path: `apply(q, k, v, sinks, call)` with the
    call's own q, k, v and sinks (`call.local.sinks`, None without; and `call.return_lse` True)
    returns (out, lse) and keeps both for the backward.

    The graph keeps q, k, v and the sinks only as saved tensors, which autograd frees after the
    backward (or keeps for another, under `retain_graph`) and checks for changes in place; the
    call's other fields are kept without them."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: PrefillCall):
        out, lse = eager.run(call)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.call = dataclasses.replace(
            call, q=None, k=None, v=None, local=dataclasses.replace(call.local, sinks=None)
        )
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        local = dataclasses.replace(ctx.call.local, sinks=sinks)
        forward = dataclasses.replace(ctx.call, q=q, k=k, v=v, local=local)
        dq, dk, dv, *dsinks = gradients(BackwardCall.checked(forward, out, lse, dout, dlse))
        return dq, dk, dv, dsinks[0] if dsinks else None, None
