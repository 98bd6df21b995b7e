"""Input checks for the public entry points: each bad input gets a ValueError that names the
argument and says what was expected, before any kernel runs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence

import torch

from tunegen.kernels.problem import DTYPE_NAMES

MAX_HEAD_DIM = 256
FLOAT32_TINY = 2.0**-126  # float32's smallest normal number


def tensor_arg(
    name: str,
    t: object,
    rank: int,
    layout: str,
    dtypes: Collection[torch.dtype] = tuple(DTYPE_NAMES),
    *,
    k_major: bool = False,
) -> torch.Tensor:
    """`t` if it is a non-empty tensor of one of `dtypes` (default: the floating ones kernels
    take) with `rank` dims and a unit last stride, or with `k_major` a unit stride on the dim
    before it (seqlen: V as `tunegen.quantize_fp8` writes it)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected {rank} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ValueError(f"{name}: expected dtype {expected}, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name}: every dimension must be non-zero, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and not (k_major and t.stride(-2) == 1):
        either = " or seqlen (K-major)" if k_major else ""
        raise ValueError(
            f"{name}: the last dimension (head_dim){either} must have stride 1, got strides "
            f"{tuple(t.stride())}; call .contiguous() on it"
        )
    return t


def same_as_q(q: torch.Tensor, others: dict[str, torch.Tensor], *, dtype: bool = True) -> None:
    """Each named tensor has q's device, dtype (unless `dtype` is False) and head_dim; head_dim is
    at most 256."""
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {t.device}")
        if dtype and t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} like q, got {t.dtype}")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name}: expected head_dim {q.shape[-1]} like q, got {t.shape[-1]}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be at most {MAX_HEAD_DIM}, got {q.shape[-1]}")


def heads(hq: int, hk: int, hv: int, *, k_name: str = "k", v_name: str = "v") -> None:
    """Values have as many heads as keys, and query heads are a multiple of them (GQA)."""
    if hv != hk:
        raise ValueError(f"{v_name}: expected {hk} heads like {k_name}, got {hv}")
    if hq % hk != 0:
        raise ValueError(
            f"{k_name}: the number of query heads ({hq}) must be a multiple of the number of "
            f"key/value heads, got {hk}"
        )


def check_attention(
    q: object,
    k: object,
    v: object,
    dtypes: Collection[torch.dtype] = tuple(DTYPE_NAMES),
    *,
    k_major_v: bool = False,
) -> None:
    """Check (batch, heads, seqlen, head_dim) inputs in scaled_dot_product_attention's layout; with
    `k_major_v`, v may also be K-major (seqlen contiguous)."""
    layout = "(batch, heads, seqlen, head_dim)"
    q, k, v = (
        tensor_arg(n, t, 4, layout, dtypes, k_major=n == "v" and k_major_v)
        for n, t in (("q", q), ("k", k), ("v", v))
    )
    same_as_q(q, {"k": k, "v": v})
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: expected batch {q.shape[0]} like q, got {t.shape[0]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v: expected seqlen {k.shape[2]} like k, got {v.shape[2]}")
    heads(q.shape[1], k.shape[1], v.shape[1])


def check_attention_varlen(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    *,
    read_lengths: bool,
    seqused_k: object = None,
    block_table: object = None,
) -> LengthsCheck | None:
    """Check packed (total_tokens, heads, head_dim) inputs and their cumulative lengths; with
    `block_table` and `seqused_k` (FlashAttention's paged keys, cu_seqlens_k then None), k and v
    are paged caches (num_pages, page_size, kv_heads, head_dim) instead (see `check_pages`).

    With `read_lengths`, the lengths themselves are read to check they start at 0, never
    decrease, end at the token count and fit the stated maxima, and the pages each sequence uses
    lie in the cache: returns their `LengthsCheck`, whose copy to the host has started and whose
    `wait` raises what they fail.
    """
    paged = block_table is not None or seqused_k is not None
    layout = "(total_tokens, heads, head_dim)"
    q = tensor_arg("q", q, 3, layout)
    if paged:
        cu_q = offsets_arg("cu_seqlens_q", cu_seqlens_q, q.device)
        k, v = check_pages(q, k, v, cu_q.shape[0] - 1, cu_seqlens_k, seqused_k, block_table)
    else:
        if cu_seqlens_k is None:
            raise ValueError(
                "cu_seqlens_k: expected a 1-D int32 tensor of batch + 1 offsets, or None with block_table "
                "and seqused_k (paged keys), got None"
            )
        k, v = (tensor_arg(n, t, 3, layout) for n, t in (("k", k), ("v", v)))
        same_as_q(q, {"k": k, "v": v})
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"v: expected {k.shape[0]} tokens like k, got {v.shape[0]}")
        heads(q.shape[1], k.shape[1], v.shape[1])
        cu_q = offsets_arg("cu_seqlens_q", cu_seqlens_q, q.device)
        cu_k = offsets_arg("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_q.shape[0] != cu_k.shape[0]:
            raise ValueError(
                f"cu_seqlens_k: expected {cu_q.shape[0]} offsets like cu_seqlens_q, got {cu_k.shape[0]}"
            )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    if paged and max_seqlen_k > block_table.shape[1] * k.shape[1]:
        raise ValueError(
            f"max_seqlen_k: expected at most the {block_table.shape[1] * k.shape[1]} keys a block_table row "
            f"names ({block_table.shape[1]} pages of {k.shape[1]}), got {max_seqlen_k}"
        )
    if not read_lengths:
        return None
    total_q, total_k = q.shape[0], k.shape[0]  # paged: k.shape[0] counts the cache's pages

    def check_packed(offsets_q: list[int], offsets_k: list[int]) -> None:
        _check_offsets("cu_seqlens_q", offsets_q, total_q, "max_seqlen_q", max_seqlen_q)
        _check_offsets("cu_seqlens_k", offsets_k, total_k, "max_seqlen_k", max_seqlen_k)

    def check_paged(offsets_q: list[int], used: list[int], outside: list[int]) -> None:
        _check_offsets("cu_seqlens_q", offsets_q, total_q, "max_seqlen_q", max_seqlen_q)
        _check_used_pages(total_k, used, outside, block_table, max_seqlen_k)

    if paged:
        outside = _outside_pages(k.shape[0], k.shape[1], seqused_k, block_table)
        return LengthsCheck((cu_q, seqused_k, outside.reshape(-1)), check_paged)
    return LengthsCheck((cu_q, cu_k), check_packed)


class LengthsCheck:
    """A packed call's lengths on their way to the host, and the checks they take there.

    The copy starts as the call is checked: the 1-D integer `tensors` (one device) in one
    device-to-host copy, on a GPU into pinned memory behind the work already queued. `wait` blocks
    until they arrive and raises what `check` (their host lists, in order) finds wrong. A call
    waits as the last step before its launch: the GPU then idles only for the copy, the check and
    the launch, where a read at the start of the call left it idle for the whole dispatch too."""

    def __init__(self, tensors: Sequence[torch.Tensor], check: Callable[..., None]) -> None:
        flat = torch.cat([t.to(torch.int32) for t in tensors])
        self._cuts = list(itertools.accumulate(t.shape[0] for t in tensors))
        self._check: Callable[..., None] | None = check
        self._arrived: torch.cuda.Event | None = None
        self._host = flat
        if flat.is_cuda:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._arrived = torch.cuda.Event()
            self._arrived.record(torch.cuda.current_stream(flat.device))

    def wait(self) -> None:
        """Block until the lengths are on the host and raise the ValueError they earn; passed
        once, later calls return at once."""
        if self._check is None:
            return
        if self._arrived is not None:
            self._arrived.synchronize()
        flat = self._host.tolist()
        self._check(*(flat[a:b] for a, b in itertools.pairwise([0, *self._cuts])))
        self._check = None


def check_pages(
    q: torch.Tensor,
    k: object,
    v: object,
    batch: int,
    cu_seqlens_k: object,
    seqused_k: object,
    block_table: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check paged keys for packed queries of `batch` sequences: k, v caches (num_pages, page_size,
    kv_heads, head_dim) of one shape, q's dtype, device and head_dim, pages a positive multiple of
    16 rows (as decode's); `block_table` (batch, max_pages) and `seqused_k` (batch,) int32 on q's
    device, passed together, with cu_seqlens_k None (seqused_k gives each sequence's keys)."""
    if block_table is None:
        raise ValueError(
            "block_table: expected a (batch, max_pages) int32 tensor with seqused_k (paged keys), got None; "
            "without pages, pass cu_seqlens_k and no seqused_k"
        )
    if seqused_k is None:
        raise ValueError(
            "seqused_k: expected a (batch,) int32 tensor of each sequence's number of keys with block_table, "
            "got None"
        )
    if cu_seqlens_k is not None:
        raise ValueError(
            "cu_seqlens_k: expected None with block_table (seqused_k gives each sequence's keys), got "
            f"{type(cu_seqlens_k).__name__}"
        )
    layout = "(num_pages, page_size, kv_heads, head_dim)"
    k, v = (tensor_arg(n, t, 4, layout) for n, t in (("k", k), ("v", v)))
    same_as_q(q, {"k": k, "v": v})
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} like k, got {tuple(v.shape)}")
    heads(q.shape[1], k.shape[2], v.shape[2])
    block_table_arg(block_table, batch, "k", k)
    used = int32_arg("seqused_k", seqused_k, 1, f"({batch},)", q.device)
    if used.shape[0] != batch:
        raise ValueError(f"seqused_k: expected {batch} lengths (one per sequence), got {used.shape[0]}")
    return k, v


def block_table_arg(block_table: object, batch: int, cache_name: str, cache: torch.Tensor) -> torch.Tensor:
    """`block_table` if it is a (batch, max_pages) int32 tensor on the cache's device, for pages
    (`cache`'s dimension 1) of a positive multiple of 16 rows, as the paged kernels read them."""
    page = cache.shape[1]
    if page % 16:
        raise ValueError(
            f"{cache_name}: the page size (dimension 1) must be a positive multiple of 16, got {page}"
        )
    table = int32_arg("block_table", block_table, 2, f"({batch}, max_pages)", cache.device)
    if table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (one per sequence), got {table.shape[0]}")
    return table


def int32_arg(name: str, t: object, rank: int, shape: str, device: torch.device) -> torch.Tensor:
    """`t` if it is a `rank`-D int32 tensor on `device` with a unit last stride."""
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype != torch.int32:
        got = (
            f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        )
        raise ValueError(f"{name}: expected a {rank}-D int32 tensor {shape}, got {got}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like q, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit last stride; call .contiguous() on it")
    return t


def offsets_arg(name: str, cu: object, device: torch.device) -> torch.Tensor:
    """`cu` if it is a contiguous 1-D int32 tensor of at least 2 offsets on `device`."""
    cu = int32_arg(name, cu, 1, "of batch + 1 offsets", device)
    if cu.shape[0] < 2:
        raise ValueError(f"{name}: expected at least 2 offsets (batch + 1), got {cu.shape[0]}")
    return cu


def _check_offsets(name: str, offsets: list[int], total: int, max_name: str, maximum: int) -> None:
    """The offsets, read back: from 0, never decreasing, to `total`, no length above `maximum`."""
    if offsets[0] != 0:
        raise ValueError(f"{name}: expected the first offset to be 0, got {offsets[0]}")
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if min(lengths) < 0:
        raise ValueError(f"{name}: offsets must not decrease, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(
            f"{name}: expected the last offset to equal the token count {total}, got {offsets[-1]}"
        )
    if max(lengths) > maximum:
        raise ValueError(f"{max_name}: a sequence has {max(lengths)} tokens, more than {maximum}")


def _outside_pages(
    num_pages: int, page: int, seqused_k: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """Per entry of `block_table`, on its device, whether its sequence uses it (the first
    ceil(count / page) of its row; the rest is never read) and it lies outside the cache."""
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    used = columns[None, :] < (seqused_k[:, None] + page - 1) // page
    return used & ((block_table < 0) | (block_table >= num_pages))


def _check_used_pages(
    num_pages: int, used: list[int], outside: list[int], block_table: torch.Tensor, maximum: int
) -> None:
    """Each sequence's key count, read back, in [0, `maximum`], and none of the pages it uses
    outside the cache (`outside`: `_outside_pages`, flattened and read back)."""
    for b, n in enumerate(used):
        if not 0 <= n <= maximum:
            raise ValueError(f"seqused_k: sequence {b} has {n} keys, expected 0 to max_seqlen_k ({maximum})")
    if any(outside):
        b = outside.index(1) // block_table.shape[1]
        row = outside[b * block_table.shape[1] : (b + 1) * block_table.shape[1]]
        pages = [p for p, bad in zip(block_table[b].tolist(), row, strict=True) if bad]
        raise ValueError(
            f"block_table: sequence {b} names pages {pages}, outside the cache's pages 0..{num_pages - 1}"
        )


def descale_arg(
    name: str, t: object, shapes: Collection[tuple[int, ...]], device: torch.device
) -> torch.Tensor:
    """`t` if it is a float32 tensor of descale factors with one of `shapes`, on `device`."""
    expected = " or ".join(str(s) for s in shapes)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a float32 tensor of shape {expected}, got {got}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like q, got {t.device}")
    return t


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: None means 1/sqrt(head_dim); otherwise a positive finite number that
    float32, the kernels' arithmetic, holds as a normal number (a scale flushed to 0 would turn
    masked scores, -inf, into NaN)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale: expected None or a positive finite float, got {scale!r}")
    if scale < FLOAT32_TINY:
        raise ValueError(
            f"scale: expected None or a positive finite float of at least 2**-126 (float32's smallest "
            f"normal), got {scale!r}"
        )
    return float(scale)


def is_aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every base address and every non-unit stride is a multiple of 16 bytes (TMA's rule)."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True
