"""The public attention functions: SDPA's layout, FlashAttention's varlen conventions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from tunegen import eager, flash_provider, fp8_attention, ops
from tunegen.backends import capturing, wants_grad
from tunegen.backward import AttentionFunction
from tunegen.calls.local import NO_WINDOW, local_arguments
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch, launcher
from tunegen.kernels.families import get
from tunegen.kernels.families.base import applicable
from tunegen.kernels.gpu import gpu_of


def _bound(q: object, k: object, v: object, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable, dict]:
    """The public function a call with these arguments is, and its arguments by name (defaults
    filled in), as Python would bind them: an argument it does not take is a ValueError."""
    varlen = isinstance(q, torch.Tensor) and q.dim() == 3
    target = attention_varlen if varlen else attention
    signature = inspect.signature(target)
    unknown = sorted(set(kwargs) - set(signature.parameters))
    if unknown:
        raise ValueError(
            f"{unknown[0]}: tunegen.{target.__name__} takes no such argument "
            f"(it takes {', '.join(signature.parameters)})"
        )
    try:
        call = signature.bind(q, k, v, *args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"explain: {exc}, as tunegen.{target.__name__}{signature} would be") from None
    call.apply_defaults()
    return target, call.arguments


def explain(
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> dict[str, Any]:
    """Which kernel a call with these arguments runs, and why: the Problem, the Gpu, the source
    ("winner", "nearest" bucket, "default", or "torch" for the PyTorch fallback), the Variant's
    knobs that apply to the Problem on that Gpu (`base.applicable`; the others keep their
    defaults) and the Winner's provenance. Takes the arguments of `attention` (FP8 ones too), or
    of `attention_varlen` when q is packed (3-D), and refuses any other; explains the forward
    kernel that call runs (with its log-sum-exp where autograd records, as the call keeps it for
    the backward). Builds the kernel if this is the first call for the Problem; runs none.

    Without arguments: what tunegen as PyTorch's flash-attention provider served and refused so
    far, by aten op and reason (`tunegen.flash_provider.routing`)."""
    if q is None and k is None and v is None and not args and not kwargs:
        return flash_provider.routing()
    target, a = _bound(q, k, v, args, kwargs)
    common = {"causal": a["causal"], "scale": a["scale"], "strict": a["strict"]}
    local = {n: a[n] for n in ("window_size", "attention_chunk", "softcap", "sinks")}
    passed = local_arguments(**local)
    keep_lse = bool(a["return_lse"]) or wants_grad(q, k, v, a["sinks"])
    if target is attention_varlen:
        sizes = [a[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
        pages = {"seqused_k": a["seqused_k"], "block_table": a["block_table"]}
        call = PrefillCall.packed(q, k, v, *sizes, return_lse=keep_lse, **common, **local, **pages)
    elif fp8_attention.requested(
        q, a["precision"], a["hadamard"], [a[n] for n in fp8_attention.DESCALE_NAMES]
    ):
        if passed:
            raise ValueError(
                f"{passed[0]}: FP8 attention takes none of window_size, attention_chunk, softcap, sinks"
            )
        call = fp8_attention.fp8_call(
            q,
            k,
            v,
            return_lse=a["return_lse"],
            precision=a["precision"],
            hadamard=a["hadamard"],
            descales=[a[n] for n in fp8_attention.DESCALE_NAMES],
            quantize_now=False,
            **common,
        )
    else:
        call = PrefillCall.dense(q, k, v, return_lse=keep_lse, **common, **local)
    problem = call.problem(call.outputs()[0])
    backend = call.backend()
    if backend == "torch":
        return {
            "problem": problem.as_dict(),
            "gpu": None,
            "source": "torch",
            "variant": None,
            "winner": None,
            "reason": f"no Triton kernel runs on {q.device.type} tensors without TRITON_INTERPRET=1",
        }
    gpu = gpu_of(q.device)
    choice = dispatch.choice_for(problem, gpu)
    winner = None
    if choice.winner is not None:
        w = choice.winner
        winner = {
            "gpu": w.gpu.name,
            "median_ms": w.median_ms,
            "tflops": w.tflops,
            "rel_err": w.rel_err,
            "peer": w.peer_name,
            "peer_ms": w.peer_ms,
            "triton_version": w.triton_version,
            "created_at": w.created_at.isoformat(),
            "problem": w.problem,
        }
    return {
        "problem": problem.as_dict(),
        "gpu": gpu.name,
        "source": choice.source,
        "variant": applicable(get(problem.family), choice.kernel.variant, problem, gpu),
        "winner": winner,
        "stale": choice.stale,
        "reason": choice.reason,
    }


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
    deterministic: bool = False,
    precision: str | None = None,
    hadamard: bool | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention over (batch, heads, seqlen, head_dim) tensors.

    The layout and meaning of `torch.nn.functional.scaled_dot_product_attention`; k and v may
    have fewer heads than q (GQA/MQA, the query head count a multiple of theirs). `causal`
    aligns the mask bottom-right when the lengths differ, as FlashAttention does. `scale`
    defaults to 1/sqrt(head_dim). With `return_lse`, also returns the natural-log
    log-sum-exp (batch, heads, seqlen_q) in float32. `strict` (default: TUNEGEN_STRICT)
    makes any path other than a Triton kernel an error. Under torch.compile the call is the
    custom op `torch.ops.tunegen.attention`. Differentiable: when autograd records and q, k, v or
    the sinks require grad, the backward family's kernels give their gradients (and the log-sum-exp's);
    with `deterministic`, the same bits on every run (what torch.use_deterministic_algorithms
    asks of every call, asked of this one).

    FP8 (not differentiable): `precision="fp8"` quantizes float16/bfloat16 q, k, v to float8
    e4m3 with per-block scales, first rotating q and k by a Walsh-Hadamard matrix along head_dim
    (`hadamard`, default True: QKᵀ is unchanged and outlier features spread out), and returns the
    inputs' dtype. float8_e4m3fn q, k, v run as given, with FlashAttention-3's float32
    `q_descale`, `k_descale`, `v_descale` (batch, kv_heads), None meaning 1 (q and k may also
    take one per 128 rows, see `tunegen.quantize_fp8`), and return bfloat16.

    The attention of current models, in FlashAttention's conventions (16-bit and float32, and
    differentiable, the sinks too): `window_size=(left, right)`, each row at position p (aligned
    bottom-right) sees keys p - left to p + right, -1 unbounded (Mistral, Gemma 2 and 3, gpt-oss);
    `attention_chunk`, each row sees only the keys of its own chunk of that many (Llama 4);
    `softcap`, scores become softcap·tanh(score / softcap) (Gemma 2); `sinks`, one logit per query
    head (num_heads,) joins each row's softmax and sends nothing to the output (gpt-oss); a sinks
    tensor that requires grad gets its gradient, in its own dtype. Rows that see no key give zeros
    (and a log-sum-exp of -inf, or of the sink).
    """
    local = local_arguments(window_size, attention_chunk, softcap, sinks)
    descales = (q_descale, k_descale, v_descale)
    if fp8_attention.requested(q, precision, hadamard, descales):
        if local:
            raise ValueError(
                f"{local[0]}: FP8 attention takes none of window_size, attention_chunk, softcap, sinks"
            )
        call = fp8_attention.fp8_call(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            return_lse=return_lse,
            strict=strict,
            precision=precision,
            hadamard=hadamard,
            descales=descales,
        )
        return call.returned(*eager.run(call), return_lse)
    grad = wants_grad(q, k, v, sinks)
    key = None
    if not local and not grad and not torch.compiler.is_compiling():
        # The launch key (see eager.run); here rather than in a function, which costs a call.
        try:
            key = (launcher.key_of(q, k, v), bool(causal), bool(return_lse))
            fast = dispatch.fast_calls.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what is wrong
            key = fast = None
        if fast is not None:
            return fast(q, k, v, scale)
    keep_lse = bool(return_lse) or grad
    features = {"window_size": window_size, "attention_chunk": attention_chunk, "softcap": softcap}
    call = PrefillCall.dense(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        return_lse=keep_lse,
        strict=strict,
        deterministic=deterministic,
        sinks=sinks,
        **features,
    )
    return _serve(call, bool(return_lse), grad, key)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    strict: bool | None = None,
    deterministic: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed (total_tokens, heads, head_dim) sequences, as `flash_attn_varlen_func`.

    `cu_seqlens_q`/`cu_seqlens_k` are int32 offsets (batch + 1) of each sequence in the packed
    tensors; `max_seqlen_q`/`max_seqlen_k` bound their lengths. The offsets are read once to be
    checked (a device-to-host copy on GPU, which the launch waits for while the dispatch runs),
    except while a CUDA graph is being captured. With
    `return_lse`, also returns the log-sum-exp (heads, total_q) in float32. Under torch.compile
    the call is the custom op `torch.ops.tunegen.attention_varlen`. Differentiable, as `attention`.
    `window_size`, `attention_chunk`, `softcap` and `sinks` as `attention`'s, per sequence.

    Chunked prefill over a paged KV cache, as serving engines call FlashAttention-3: with
    `block_table` (batch, max_pages) and `seqused_k` (batch,), both int32 on q's device and given
    together, k and v are the caches (num_pages, page_size, kv_heads, head_dim) that
    `decode_attention` reads (page_size a multiple of 16), cu_seqlens_k is None, and sequence b
    attends to its first seqused_k[b] keys, key j in page block_table[b, j // page_size] at row
    j % page_size; max_seqlen_k bounds seqused_k and at most fills a row of pages. The causal mask
    aligns each sequence's queries with the end of its keys, so a new chunk sees the cached
    prompt and itself. The counts and the pages a sequence uses are checked as the offsets are.
    Not differentiable: the keys are a cache, not a leaf anyone trains.
    """
    grad = wants_grad(q, k, v, sinks)
    features = {"window_size": window_size, "attention_chunk": attention_chunk, "softcap": softcap}
    compiling = torch.compiler.is_compiling()
    sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    call = PrefillCall.packed(
        q,
        k,
        v,
        *sizes,
        causal=causal,
        scale=scale,
        return_lse=bool(return_lse) or grad,
        strict=strict,
        read_lengths=not (compiling or capturing(q)),
        deterministic=deterministic,
        sinks=sinks,
        seqused_k=seqused_k,
        block_table=block_table,
        **features,
    )
    return _serve(call, bool(return_lse), grad, None)


def _serve(
    call: PrefillCall, return_lse: bool, grad: bool, key: tuple | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a checked prefill call on its path: its custom op while torch.compile traces, the autograd
    Function where autograd records (`grad`), the eager body otherwise (keeping the fast path under
    `key`, see eager.run)."""
    if torch.compiler.is_compiling():
        out, lse = ops.through_op(call)
    elif grad:
        out, lse = AttentionFunction.apply(call.q, call.k, call.v, call.local.sinks, call)
    else:
        out, lse = eager.run(call, key)
    return call.returned(out, lse, return_lse)
