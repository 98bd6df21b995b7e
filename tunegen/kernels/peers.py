"""The implementations tunegen is measured against, on the same GPU in the same run:
each of PyTorch's scaled_dot_product_attention backends, and FlexAttention."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
_pinned: str | None = None  # the SDPA peer whose backend `pinned` has chosen, inside it


def sdpa(backend: str, causal: bool) -> Attention:
    """SDPA pinned to one backend; raises at call time when the backend refuses the inputs.

    Inside `pinned(backend)`, where every timing harness calls it, a call is the bare
    `F.scaled_dot_product_attention` a model makes, the backend chosen once outside it; anywhere
    else the call enters that choice itself (about 21 µs of host time a call on the H100
    machine's CPU, which tunegen's calls do not pay), so it never runs another backend."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if _pinned != backend:
            with pinned(backend):
                return run(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


@contextlib.contextmanager
def pinned(impl: str | None) -> Iterator[None]:
    """Inside this, implementation `impl`'s calls run as a model makes them: an SDPA peer's with
    SDPA's backend chosen once, on entry (`torch.nn.attention.sdpa_kernel`), not by each call;
    tunegen's, FlexAttention's (or None's) as they are. The timing harness
    (`tunegen.tuning.timing`) enters it once around all of one implementation's timed calls, so
    that every implementation is timed the same way."""
    global _pinned
    if impl not in SDPA_BACKENDS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outer = _pinned
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])):
        _pinned = impl
        try:
            yield
        finally:
            _pinned = outer


def flex(causal: bool, shape: tuple[int, int, int, int], device: torch.device) -> Attention:
    """FlexAttention compiled by torch.compile, with a causal block mask when asked."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # A fresh compile per shape: past dynamo's recompile limit, flex_attention would silently
    # run eagerly (materializing the scores) and be timed as if it were FlexAttention.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    batch, _heads, seqlen, _ = shape
    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, batch, None, seqlen, seqlen, device=device
        )

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return run


# What PyTorch appends to the warnings its C++ code gives.
INTERNAL = re.compile(r"\s*\(Triggered internally at [^)]*\)\s*$")


@contextlib.contextmanager
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    """Collect, rather than print, the warnings PyTorch gives while a peer's first call finds out
    whether it can run the inputs (SDPA explains each backend it rules out); `refusal` reads
    them. Only the first call needs it: a call that ran once runs again without a word."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def refusal(exc: BaseException, caught: list[warnings.WarningMessage]) -> str:
    """Why a peer could not run, in a line: PyTorch's most specific explanation among the warnings
    `caught` while it tried (not its "... not used because:" headings, nor the backends it was
    told to skip), else the error's first line."""
    said = [" ".join(INTERNAL.sub("", str(w.message)).split()) for w in caught]
    specific = [m for m in said if m and not m.endswith(":") and "runtime disabled" not in m]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = specific[0] if specific else first
    return reason if len(reason) <= 160 else reason[:157] + "..."


def available() -> list[str]:
    """Names of the peers this machine can try (each may still refuse a given shape)."""
    names = list(SDPA_BACKENDS)
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        names.append("flex")
    except ImportError:
        pass
    return names
