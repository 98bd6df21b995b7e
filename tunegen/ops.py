"""tunegen's functions as PyTorch custom ops (`torch.ops.tunegen.*`), with fake-tensor shapes,
so `torch.compile(fullgraph=True)` traces a call as one opaque op instead of breaking the graph
on its Python checks and dispatch; each forward op registers its backward op for autograd.

An op takes tensors and plain values only; its body rebuilds the checked call
(tunegen.calls.prefill) from them and runs the eager body; `through_op` calls the op for a call."""

from __future__ import annotations

import torch

from tunegen import backward, eager
from tunegen.backends import capturing
from tunegen.calls.backward import BackwardCall
from tunegen.calls.prefill import PrefillCall


@torch.library.custom_op("tunegen::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    return_lse: bool,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention(); the log-sum-exp is a 0-element tensor unless asked for (`deterministic` is
    the backward's)."""
    local = _local(window_left, window_right, attention_chunk, softcap, sinks)
    out, lse = eager.run(
        PrefillCall.dense(q, k, v, causal=causal, scale=scale, return_lse=return_lse, **local)
    )
    return out, lse if lse is not None else q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _(q, k, v, causal, scale, return_lse, *_):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tunegen::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    return_lse: bool,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_varlen(), paged keys too (`seqused_k`, `block_table`, cu_seqlens_k None); the
    log-sum-exp is a 0-element tensor unless asked for."""
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    call = PrefillCall.packed(
        q,
        k,
        v,
        *sizes,
        causal=causal,
        scale=scale,
        return_lse=return_lse,
        read_lengths=not capturing(q),
        seqused_k=seqused_k,
        block_table=block_table,
        **_local(window_left, window_right, attention_chunk, softcap, sinks),
    )
    out, lse = eager.run(call)
    return out, lse if lse is not None else q.new_empty(0, dtype=torch.float32)


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, *_):
    # The output is like the packed q, the log-sum-exp (heads, total_q), paged keys or not.
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tunegen::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv, and the sinks' in float32, a 0-element tensor without sinks) of
    attention() from its output's and log-sum-exp's gradients."""
    local = _local(window_left, window_right, attention_chunk, softcap, sinks)
    forward = PrefillCall.dense(
        q, k, v, causal=causal, scale=scale, return_lse=True, deterministic=deterministic, **local
    )
    return _four(backward.gradients(BackwardCall.checked(forward, out, lse, dout, dlse)), q)


@attention_backward_op.register_fake
def _(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    causal,
    scale,
    deterministic=False,
    window_left=-1,
    window_right=-1,
    attention_chunk=0,
    softcap=0.0,
    sinks=None,
):
    return _fake_grads(q, k, v, sinks)


@torch.library.custom_op("tunegen::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv, and the sinks' as attention_backward's) of attention_varlen()."""
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    local = _local(window_left, window_right, attention_chunk, softcap, sinks)
    forward = PrefillCall.packed(
        q, k, v, *sizes, causal=causal, scale=scale, return_lse=True, deterministic=deterministic, **local
    )
    return _four(backward.gradients(BackwardCall.checked(forward, out, lse, dout, dlse)), q)


@attention_varlen_backward_op.register_fake
def _(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    scale,
    deterministic=False,
    window_left=-1,
    window_right=-1,
    attention_chunk=0,
    softcap=0.0,
    sinks=None,
):
    return _fake_grads(q, k, v, sinks)


def _four(grads: tuple[torch.Tensor, ...], q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A backward op's outputs: dq, dk, dv and the sinks' gradient, 0 elements where there are none."""
    return grads if len(grads) == 4 else (*grads, q.new_empty(0, dtype=torch.float32))


def _fake_grads(q, k, v, sinks) -> tuple[torch.Tensor, ...]:
    """A backward op's outputs as shapes."""
    dsinks = q.new_empty(0 if sinks is None else sinks.shape[0], dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _local(window_left: int, window_right: int, attention_chunk: int, softcap: float, sinks) -> dict:
    """An op's feature arguments as the public call's."""
    window = (window_left, window_right)
    return {"window_size": window, "attention_chunk": attention_chunk, "softcap": softcap, "sinks": sinks}


def through_op(call: PrefillCall) -> tuple[torch.Tensor, torch.Tensor]:
    """`call` (checked, as traced) through its custom op: the output and log-sum-exp (a 0-element
    tensor unless `call.return_lse`)."""
    x = call.local
    local = (x.window_left, x.window_right, x.attention_chunk, x.softcap, x.sinks)
    flags = (call.causal, call.scale, call.return_lse, call.deterministic, *local)
    if call.varlen is None:
        return torch.ops.tunegen.attention(call.q, call.k, call.v, *flags)
    x = call.varlen
    return torch.ops.tunegen.attention_varlen(
        call.q,
        call.k,
        call.v,
        x.cu_seqlens_q,
        x.cu_seqlens_k,
        x.max_seqlen_q,
        x.max_seqlen_k,
        *flags,
        x.seqused_k,
        x.block_table,
    )


def _keep_for_backward(ctx, inputs, output) -> None:
    """Save q, k, v, the output, the log-sum-exp, the sinks (the last input) and the varlen offsets;
    the rest as is, and how many inputs follow q, k, v (of which only the sinks get a gradient)."""
    q, k, v, *rest = inputs
    out, lse = output
    tensors = [t for t in rest[:-1] if isinstance(t, torch.Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, rest[-1], *tensors)
    ctx.rest = [a for a in rest[:-1] if not isinstance(a, torch.Tensor)]
    ctx.inputs_past_qkv = len(rest)


def _grads(ctx, dq, dk, dv, dsinks, sinks) -> tuple:
    """The gradients of every input of a forward op: q, k, v, None for the flags and sizes, and the
    sinks' (where there are sinks)."""
    return dq, dk, dv, *(None,) * (ctx.inputs_past_qkv - 1), dsinks if sinks is not None else None


def _attention_grads(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    causal, scale, _, deterministic, *local = ctx.rest
    if lse.numel() == 0:  # called without the log-sum-exp (return_lse=False): compute it again
        out, lse = attention_op(q, k, v, causal, scale, True, deterministic, *local, sinks)
        dlse = None
    grads = attention_backward_op(dout, q, k, v, out, lse, dlse, causal, scale, deterministic, *local, sinks)
    return _grads(ctx, *grads, sinks)


def _keep_varlen_for_backward(ctx, inputs, output) -> None:
    """`_keep_for_backward` for attention_varlen's op, whose paged keys (its last two inputs, after
    the sinks) take no gradient."""
    *inputs, _, block_table = inputs
    if block_table is not None:
        raise ValueError("block_table: paged calls take no gradient (the cache is no leaf to train)")
    _keep_for_backward(ctx, inputs, output)


def _attention_varlen_grads(ctx, dout, dlse):
    q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, causal, scale, _, deterministic, *local = ctx.rest
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if lse.numel() == 0:  # called without the log-sum-exp (return_lse=False): compute it again
        out, lse = attention_varlen_op(q, k, v, *sizes, causal, scale, True, deterministic, *local, sinks)
        dlse = None
    flags = (causal, scale, deterministic, *local, sinks)
    grads = attention_varlen_backward_op(dout, q, k, v, out, lse, dlse, *sizes, *flags)
    return *_grads(ctx, *grads, sinks), None, None  # none for seqused_k and block_table


attention_op.register_autograd(_attention_grads, setup_context=_keep_for_backward)
attention_varlen_op.register_autograd(_attention_varlen_grads, setup_context=_keep_varlen_for_backward)
