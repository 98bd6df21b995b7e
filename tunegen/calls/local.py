"""The attention of current models in a prefill call: FlashAttention's `window_size` and
`attention_chunk`, the logit cap `softcap` and gpt-oss's `sinks`, checked once, and the canonical
form the Problem key stores (tunegen.kernels.masks.normalize_local)."""

from __future__ import annotations

import dataclasses

import torch

from tunegen.kernels import masks


@dataclasses.dataclass(frozen=True, eq=False)
class Local:
    """A call's window (`window_left` keys before each row's position and `window_right` after,
    -1 unbounded), chunks of `attention_chunk` keys (0: none), the cap (`softcap`: scores become
    softcap·tanh(s / softcap); 0: none) and one float32 logit per query head (`sinks`)."""

    window_left: int = -1
    window_right: int = -1
    attention_chunk: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        """Whether the call asks for any of them."""
        window = self.window_left != -1 or self.window_right != -1 or self.attention_chunk != 0
        return window or self.softcap != 0 or self.sinks is not None

    def reference_args(self) -> dict[str, object]:
        """The features as `attention_reference` takes them."""
        window = (self.window_left, self.window_right)
        return {
            "window_size": window,
            "attention_chunk": self.attention_chunk,
            "softcap": self.softcap,
            "sinks": self.sinks,
        }

    def normalized(self, causal: bool, seqlen_q: int, seqlen_k: int, varlen: bool) -> tuple[bool, Local]:
        """The same mask for a call of these lengths (with `varlen`, the bounds on them) in its
        canonical form (`normalize_local`): the causal flag (which a right side of 0 sets) and
        these features with every bound that excludes no key dropped, so that a window wider than
        the sequences is the plain call. A packed batch keeps a chunk wider than its keys unless
        causal: a sequence with more queries than keys may hold rows the chunk blinds."""
        causal, left, right, chunk = masks.normalize_local(
            causal, self.window_left, self.window_right, self.attention_chunk, seqlen_q, seqlen_k
        )
        if varlen and not causal and self.attention_chunk > 0 and chunk == 0:
            chunk = self.attention_chunk
        return causal, Local(left, right, chunk, self.softcap, self.sinks)

    def first_key(self, seqlen_k: int, seqlen_q: int) -> int:
        """The first key some row sees of a sequence of `seqlen_k` keys and `seqlen_q` queries
        (bottom-right aligned; `seqlen_k` where none does): decode reads from there on, so the
        pages before it may be free."""
        p_lo = seqlen_k - seqlen_q
        first = 0
        if self.window_left >= 0:
            first = max(first, p_lo - self.window_left)
        if self.attention_chunk > 0:
            first = max(first, max(p_lo, 0) // self.attention_chunk * self.attention_chunk)
        return min(first, seqlen_k)

    def key(self) -> dict[str, object]:
        """The Problem's fields for these (canonical) features."""
        return {
            "window_left": self.window_left,
            "window_right": self.window_right,
            "attention_chunk": self.attention_chunk,
            "softcap": self.softcap > 0,
            "sinks": self.sinks is not None,
        }


NONE = Local()
NO_WINDOW = (-1, -1)  # the public calls' default window: a call that leaves it passes this object


def check_local(
    q: torch.Tensor,
    window_size: object,
    attention_chunk: object,
    softcap: object,
    sinks: object,
    heads_dim: int = 1,
    differentiable: bool = True,
) -> Local:
    """The call's features, checked against q, whose dim `heads_dim` holds the query heads (1 for
    prefill calls, dense or packed; 2 for decode's (batch, nq, heads, head_dim)); each bad value
    gets a ValueError that names it. `sinks` is taken as float32 (contiguous); where the call is
    `differentiable` it keeps their autograd history (the backward gives the sinks' gradient, in
    their own dtype), elsewhere it is detached."""
    if (
        not isinstance(window_size, tuple | list)
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise ValueError(
            f"window_size: expected a pair of ints (left, right), -1 unbounded, got {window_size!r}"
        )
    if not isinstance(attention_chunk, int) or isinstance(attention_chunk, bool):
        raise ValueError(f"attention_chunk: expected an int >= 0 (0: no chunks), got {attention_chunk!r}")
    masks.normalize_local(False, window_size[0], window_size[1], attention_chunk, 1, 1)  # the ranges
    if (
        not isinstance(softcap, int | float)
        or isinstance(softcap, bool)
        or not softcap - softcap == 0  # finite (math.isfinite takes no float torch.compile traces)
        or softcap < 0
    ):
        raise ValueError(f"softcap: expected a finite float >= 0 (0: no cap), got {softcap!r}")
    heads = q.shape[heads_dim]
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError(f"sinks: expected a floating-point tensor of shape ({heads},), got {sinks!r}")
        if tuple(sinks.shape) != (heads,):
            raise ValueError(
                f"sinks: expected shape ({heads},), one logit per query head, got {tuple(sinks.shape)}"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks: expected device {q.device} like q, got {sinks.device}")
        sinks = (sinks if differentiable else sinks.detach()).to(torch.float32).contiguous()
    return Local(window_size[0], window_size[1], attention_chunk, float(softcap), sinks)


def local_arguments(
    window_size: object, attention_chunk: object, softcap: object, sinks: object
) -> list[str]:
    """The names of the features a public call passed off their defaults, before any check (a
    value of the wrong type counts as passed: `check_local` names it). A call that leaves them all
    (the signature's own default objects) costs a few identity tests: it is on the fast path."""
    if (
        window_size is NO_WINDOW
        and sinks is None
        and type(attention_chunk) is int
        and not attention_chunk
        and type(softcap) is float
        and not softcap
    ):
        return []
    default_window = isinstance(window_size, tuple | list) and [type(w) for w in window_size] == [int, int]
    default_window = default_window and list(window_size) == [-1, -1]
    passed = {
        "window_size": not default_window,
        "attention_chunk": not (type(attention_chunk) is int and attention_chunk == 0),
        "softcap": not (type(softcap) in (int, float) and softcap == 0),
        "sinks": sinks is not None,
    }
    return [name for name, on in passed.items() if on]
