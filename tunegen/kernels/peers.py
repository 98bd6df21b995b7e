"""The implementations tunegen is measured against, on the same GPU in the same run:
each of PyTorch's scaled_dot_product_attention backends, and FlexAttention (which also takes
the attention of current models: sliding window, chunks, logit cap and sinks)."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from tunegen.kernels.masks import normalize_local

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


def flex_mask_mod(
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
) -> Callable | None:
    """FlashAttention's mask (tunegen.kernels.masks: bottom-right aligned, window, chunk) as a
    FlexAttention mask_mod, in canonical form (`normalize_local`: bounds that exclude no key are
    dropped, as tunegen drops them); None when no key is masked."""
    causal, left, right, chunk = normalize_local(causal, *window_size, attention_chunk, seqlen_q, seqlen_k)
    if not (causal or left >= 0 or right >= 0 or chunk > 0):
        return None
    diag = seqlen_k - seqlen_q

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        pos = q_idx + diag
        keep = kv_idx <= pos if causal else kv_idx >= 0
        if left >= 0:
            keep = keep & (kv_idx >= pos - left)
        if right >= 0:
            keep = keep & (kv_idx <= pos + right)
        if chunk > 0:  # floor division: rows at negative positions share no chunk with any key
            keep = keep & (torch.div(pos, chunk, rounding_mode="floor") == kv_idx // chunk)
        return keep

    return mask_mod


def flex_score_mod(softcap: float) -> Callable | None:
    """Gemma 2's logit cap as a FlexAttention score_mod (on the scaled score, before the mask, as
    tunegen and FlashAttention cap); None without a cap."""
    if softcap <= 0:
        return None

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)

    return score_mod


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """FlexAttention's output renormalized for one sink logit per query head: the row's softmax
    over its keys and the sink gives each key exp(s)/(e^lse + e^sink), Flex's probability times
    e^lse/(e^lse + e^sink) = sigmoid(lse - sink), with lse Flex's natural-log log-sum-exp of the
    scaled (capped) scores; a row that sees no key (lse -inf) stays zero."""
    keep = torch.sigmoid(lse - sinks.to(lse.dtype)[:, None])
    wide = torch.promote_types(out.dtype, keep.dtype)  # float32 at least (bf16 outputs)
    return (out.to(wide) * keep[..., None]).to(out.dtype)


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: object,
    score_mod: Callable | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One FlexAttention call with the features: what `flex` compiles (the renormalization for
    sinks fuses into one pass over the output)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
    out, aux = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return with_sinks(out, aux.lse, sinks)


def flex(
    causal: bool,
    shape: tuple[int, int, int, int],
    device: torch.device,
    *,
    seqlen_k: int | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> Attention:
    """FlexAttention compiled by torch.compile for queries of `shape` (batch, heads, seqlen_q,
    head_dim) and `seqlen_k` keys (default: as many), with tunegen's features in FlashAttention's
    conventions: a block mask for causal, window and chunk (`flex_mask_mod`, built once, here), a
    score_mod for the cap (`flex_score_mod`) and `sinks` (heads,) through the log-sum-exp
    (`with_sinks`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    # A fresh compile per shape: past dynamo's recompile limit, flex_attention would silently
    # run eagerly (materializing the scores) and be timed as if it were FlexAttention.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attend, dynamic=False)
    seqlen_q = shape[2]
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    mask_mod = flex_mask_mod(causal, seqlen_q, seqlen_k, window_size, attention_chunk)
    block_mask = None
    if mask_mod is not None:  # the mask holds for every batch entry and head: one to broadcast
        block_mask = create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k, device=device)
    score_mod = flex_score_mod(softcap)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask, score_mod, sinks)

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
