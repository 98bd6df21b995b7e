"""tunegen as a provider in PyTorch's registry of flash-attention implementations (torch >= 2.11).

    import tunegen
    torch.nn.attention.activate_flash_attention_impl("tunegen")
    ...  # SDPA's flash backend and torch.nn.attention.varlen.varlen_attn run tunegen, with gradients
    torch.nn.attention.restore_flash_attention_impl()

Importing tunegen registers the provider; nothing changes until it is activated. Activated, it
takes the CUDA kernels of the aten ops behind SDPA's flash backend and `varlen_attn` (forward and
backward), and puts the flash backend first in SDPA's priority order (cuDNN's comes first on
Hopper otherwise); restoring gives both back. Under TRITON_INTERPRET=1 it takes their CPU kernels
too, and CPU SDPA's flash op, where tunegen runs kernels in the interpreter.

A call tunegen does not serve runs PyTorch's own kernel for the op, which is still there: dropout,
a window, ALiBi, a paged or used-length cache, forced splits, SDPA's top-left causal mask of
unequal lengths on CPU, or inputs tunegen's checks refuse. Each call is counted by op, served or
refused with the reason (`routing()`, or `tunegen.explain()` without arguments). In strict mode
(TUNEGEN_STRICT=1) a refusal is a FallbackError instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tunegen import backward, eager
from tunegen.backends import FallbackError, capturing, strict_default
from tunegen.calls.backward import BackwardCall
from tunegen.calls.prefill import PrefillCall
from tunegen.decode import checking
from tunegen.kernels import dispatch, launcher
from tunegen.kernels.gpu import interpreting
from tunegen.unserved import Unserved, causal_of, flash_lse, require

NAME = "tunegen"
# Distinct refusal reasons kept per op; more are counted together (the counts stay bounded).
MAX_REASONS = 32
OTHER = "(other reasons)"


_LOCK = threading.Lock()
_SERVED: collections.Counter[str] = collections.Counter()
_REFUSED: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def _count(op: str, reason: str | None) -> None:
    with _LOCK:
        if reason is None:
            _SERVED[op] += 1
            return
        reasons = _REFUSED[op]
        reasons[reason if reason in reasons or len(reasons) < MAX_REASONS else OTHER] += 1


def routing() -> dict[str, Any]:
    """Whether the provider is active, and per aten op how many calls it served and refused (with
    each reason): what ran tunegen's kernels and what went back to PyTorch's."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)
    with _LOCK:
        return {
            "active": current() == NAME,
            "served": dict(_SERVED),
            "refused": {op: dict(reasons) for op, reasons in _REFUSED.items()},
        }


def _checked(make: Callable[..., PrefillCall], *args: Any, **kwargs: Any) -> PrefillCall:
    """A prefill call whose checks pass and which a Triton kernel serves, or Unserved with why."""
    try:
        call = make(*args, strict=False, **kwargs)
    except ValueError as exc:
        raise Unserved(str(exc)) from None
    if call.backend() == "torch":
        raise Unserved(f"no Triton kernel runs on {call.q.device.type} tensors without TRITON_INTERPRET=1")
    return call


def _causal(is_causal: bool, left: int | None, right: int | None, max_k: int) -> bool:
    """The op's causal flag and window (FlashAttention's: (-1, 0) is causal, bottom-right)."""
    name = "window_size_left" if left is not None and 0 <= left < max_k else "window_size_right"
    return causal_of(is_causal, left, right, max_k, name)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None):
    """Output and log-sum-exp of (batch, heads, seqlen, head_dim) q, k, v: `tunegen.attention`'s
    eager body, its fast path included (the same launch keys)."""
    key = (launcher.key_of(q, k, v), causal, True)
    fast = dispatch.fast_calls.get(key)
    if fast is not None:
        return fast(q, k, v, scale)
    call = _checked(PrefillCall.dense, q, k, v, causal=causal, scale=scale, return_lse=True)
    return eager.run(call, key)


def _auxiliary(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rng state, the unused tensor and the debug mask flash ops return, without dropout."""
    device = query.device
    return (
        torch.zeros(2, dtype=torch.uint64, device=device),
        torch.zeros((), dtype=torch.uint64, device=device),
        torch.empty(0, dtype=query.dtype, device=device),
    )


def _forward_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal, scale) -> PrefillCall:
    """The prefill call of a flash op's (batch, seqlen, heads, head_dim) or packed operands, or
    Unserved. Packed offsets are read back to be checked only with TUNEGEN_CHECK=1 (PyTorch's own
    kernel reads none, and a read is a synchronization)."""
    if cum_seq_q is None:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return _checked(PrefillCall.dense, q, k, v, causal=causal, scale=scale, return_lse=True)
    require(cum_seq_k=cum_seq_k is not None)
    sizes = (cum_seq_q, cum_seq_k, max_q, max_k)
    flags = {"causal": causal, "scale": scale, "return_lse": True}
    read = checking(None) and not capturing(query)
    return _checked(PrefillCall.packed, query, key, value, *sizes, read_lengths=read, **flags)


def flash_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
    *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    block_table=None, num_splits=None, out=None,
):  # fmt: skip
    """aten::_flash_attention_forward: (batch, seqlen, heads, head_dim), or packed with offsets
    (with `out`, written there). A row that sees no key gets FlashAttention's log-sum-exp, +inf."""
    require(
        dropout_p=dropout_p == 0,
        return_debug_mask=not return_debug_mask,
        seqused_k=seqused_k is None,
        alibi_slopes=alibi_slopes is None,
        block_table=block_table is None,
        num_splits=num_splits is None or num_splits <= 1,
    )
    causal = _causal(is_causal, window_size_left, window_size_right, max_k)
    if cum_seq_q is None and out is None:
        result, lse = _dense(*(t.transpose(1, 2) for t in (query, key, value)), causal, scale)
        result = result.transpose(1, 2)
    else:
        call = _forward_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal, scale)
        target = out if out is None or cum_seq_q is not None else out.transpose(1, 2)
        result, lse = eager.run(call, out=target)
        result = result if cum_seq_q is not None else result.transpose(1, 2)
    if cum_seq_q is not None or (causal and query.shape[1] > key.shape[1]):
        flash_lse(lse, inplace=True)
    return (result, lse, *_auxiliary(query))


def flash_forward_into(
    out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
    *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    block_table=None, num_splits=None,
):  # fmt: skip
    """aten::_flash_attention_forward_no_dropout_inplace: the forward, written into `out`."""
    return flash_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
        scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
        seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits,
        out=out,
    )[1]  # fmt: skip


def _gradients(forward: PrefillCall, out, lse, grad_out) -> tuple[torch.Tensor, ...]:
    try:
        call = BackwardCall.checked(forward, out, lse, grad_out, None)
    except ValueError as exc:
        raise Unserved(str(exc)) from None
    return backward.gradients(call)


def flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
):  # fmt: skip
    """aten::_flash_attention_backward: dq, dk, dv in the forward's layout."""
    require(dropout_p=dropout_p == 0)
    causal = _causal(is_causal, window_size_left, window_size_right, max_k)
    forward = _forward_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal, scale)
    if cum_seq_q is not None:
        return _gradients(forward, out, logsumexp, grad_out)
    grads = _gradients(forward, out.transpose(1, 2), logsumexp, grad_out.transpose(1, 2))
    return tuple(g.transpose(1, 2) for g in grads)


def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention: SDPA's (batch, heads, seqlen, head_dim) layout."""
    require(dropout_p=dropout_p == 0, return_debug_mask=not return_debug_mask)
    out, lse = _dense(query, key, value, bool(is_causal), scale)
    rng, offset, debug = _auxiliary(query)
    return out, lse, None, None, query.shape[2], key.shape[2], rng, offset, debug


def _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """dq, dk, dv of an SDPA flash forward, (batch, heads, seqlen, head_dim)."""
    forward = _checked(PrefillCall.dense, query, key, value, causal=is_causal, scale=scale, return_lse=True)
    return _gradients(forward, out, logsumexp, grad_out)


def sdpa_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    is_causal, philox_seed, philox_offset, *, scale=None,
):  # fmt: skip
    """aten::_scaled_dot_product_flash_attention_backward: dq, dk, dv."""
    require(dropout_p=dropout_p == 0)
    return _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale)


def _cpu_checks(query, key, dropout_p, is_causal, attn_mask) -> None:
    """What CPU SDPA's flash op may ask that tunegen does not serve: dropout, a mask, and a causal
    mask of unequal lengths (SDPA aligns it top-left, tunegen bottom-right)."""
    top_left_ok = not is_causal or query.shape[2] == key.shape[2]
    require(dropout_p=dropout_p == 0, attn_mask=attn_mask is None, is_causal=top_left_ok)


def _laid_out(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """`t` copied into the memory order PyTorch's CPU flash op declares for its outputs (its meta
    function's), where compiled code may rely on their strides."""
    return torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device).copy_(t)


def cpu_sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """aten::_scaled_dot_product_flash_attention_for_cpu (interpreter only)."""
    _cpu_checks(query, key, dropout_p, is_causal, attn_mask)
    out, lse = _dense(query, key, value, bool(is_causal), scale)
    return out, _laid_out(lse, (0, 2, 1))


def cpu_sdpa_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    """aten::_scaled_dot_product_flash_attention_for_cpu_backward (interpreter only)."""
    _cpu_checks(query, key, dropout_p, is_causal, attn_mask)
    grads = _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return tuple(_laid_out(g, (0, 2, 1, 3)) for g in grads)


FLASH_OPS: dict[str, Callable[..., Any]] = {
    "_flash_attention_forward": flash_forward,
    "_flash_attention_forward_no_dropout_inplace": flash_forward_into,
    "_flash_attention_backward": flash_backward,
    "_scaled_dot_product_flash_attention": sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": sdpa_backward,
}
CPU_OPS: dict[str, Callable[..., Any]] = {
    "_scaled_dot_product_flash_attention_for_cpu": cpu_sdpa_forward,
    "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_sdpa_backward,
}


def _kernel(op: str, serve: Callable[..., Any], original: Any | None) -> Callable[..., Any]:
    """The kernel registered for `op`: tunegen's `serve`, or where it refuses, the kernel that was
    there before (PyTorch's own), counted either way. A keyword argument `serve` does not know (a
    later torch's) is served where it asks for nothing (None), else refused."""
    parameters = inspect.signature(serve).parameters.values()
    # None: `serve` passes its keywords on to a function that takes them by name.
    known = None if any(p.kind == p.VAR_KEYWORD for p in parameters) else {p.name for p in parameters}

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            named = kwargs
            if known is not None:
                unknown = [name for name, value in kwargs.items() if name not in known and value is not None]
                if unknown:
                    raise Unserved(f"{unknown[0]}: an argument of aten::{op} this tunegen does not know")
                named = {name: value for name, value in kwargs.items() if name in known}
            result = serve(*args, **named)
        except Unserved as unserved:
            reason = str(unserved)
            _count(op, reason)
            if strict_default():
                raise FallbackError(f"strict mode: aten::{op}: {reason}") from None
            if original is None:
                raise RuntimeError(f"aten::{op}: {reason}, and PyTorch has no kernel for it here") from None
            return original.call_boxed(keyset, *args, **kwargs)
        _count(op, None)
        return result

    return kernel


@dataclasses.dataclass
class Handle:
    """What activation changed, to be undone by `remove` (the registry calls it on restore): the
    libraries holding tunegen's kernels, and SDPA's priority order before and after."""

    libraries: list[torch.library.Library]
    priority: tuple[list[int], list[int]] | None = None

    def remove(self) -> None:
        for library in self.libraries:
            library._destroy()
        self.libraries = []
        if self.priority is not None:
            before, ours = self.priority
            # Changed since (another sdpa_kernel(set_priority=True) ended, say): that order stands.
            if list(torch._C._get_sdp_priority_order()) == ours:
                torch._C._set_sdp_priority_order(before)
            self.priority = None


def _original(op: str, key: str) -> Any | None:
    try:
        return torch.library.get_kernel(f"aten::{op}", key)
    except RuntimeError:  # no kernel of the op for this key (flash ops on CPU)
        return None


def _settle_priority() -> None:
    """PyTorch sets SDPA's priority order at its first CUDA SDPA call (cuDNN first on Hopper and
    Blackwell), over any order set before: have that happen now, so that the first call after
    activation does not put cuDNN back above the flash backend."""
    if torch.cuda.is_available() and hasattr(torch, "_fused_sdp_choice"):
        # A CUDA that cannot start here fails the first SDPA call as well: nothing to settle now.
        with contextlib.suppress(RuntimeError):
            t = torch.empty(1, 1, 1, 8, device="cuda", dtype=torch.float16)
            torch._fused_sdp_choice(t, t, t)


def activate() -> Handle:
    """Register tunegen's kernels for the flash ops (what `activate_flash_attention_impl` calls);
    if that fails midway, what was registered is removed again."""
    keys = {"CUDA": FLASH_OPS}
    if interpreting():
        keys["CPU"] = {**FLASH_OPS, **CPU_OPS}
    handle = Handle([])
    try:
        with warnings.catch_warnings():
            # Replacing a kernel is what a provider does; PyTorch warns of it once per process.
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for key, ops in keys.items():
                library = torch.library.Library("aten", "IMPL", key)
                handle.libraries.append(library)
                for op, serve in ops.items():
                    if hasattr(torch.ops.aten, op):
                        library.impl(op, _kernel(op, serve, _original(op, key)), key, with_keyset=True)
    except BaseException:
        handle.remove()
        raise
    if hasattr(torch._C, "_get_sdp_priority_order"):
        _settle_priority()
        before = list(torch._C._get_sdp_priority_order())
        flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        ours = [flash, *(b for b in before if b != flash)]
        torch._C._set_sdp_priority_order(ours)
        handle.priority = (before, list(torch._C._get_sdp_priority_order()))
    return handle


def register() -> bool:
    """Make "tunegen" a flash-attention implementation PyTorch can activate (never activated
    here); False where this torch has no such registry."""
    register_impl = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if register_impl is None:
        return False
    register_impl(NAME, register_fn=activate)
    return True
