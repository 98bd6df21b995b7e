"""Model presets, their attention layer kinds, and the Problems a tuning run covers."""

from __future__ import annotations

import dataclasses

from tunegen.kernels import masks
from tunegen.kernels.problem import Problem


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of attention layer: the features of current models its Problems carry, named and
    read as `Problem` holds them (FlashAttention's conventions: `window_left` keys back and
    `window_right` ahead of each row's position, -1 unbounded, a right side of 0 making the layer
    causal whatever the run asks; chunks of `attention_chunk` keys, 0 none; scores capped by tanh;
    one sink logit per query head). Sides and chunks are checked as the public calls check them."""

    window_left: int = -1
    window_right: int = -1
    attention_chunk: int = 0
    softcap: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        masks.normalize_local(False, self.window_left, self.window_right, self.attention_chunk, 1, 1)

    def fields(self, causal: bool, seqlen_q: int, seqlen_k: int) -> dict[str, object]:
        """The Problem's causal flag and features for a layer of this kind called with these exact
        lengths: its mask in the canonical form the public calls key on (`normalize_local`), so
        that a window at least as long as the keys gives the plain Problem, as it does there."""
        causal, left, right, chunk = masks.normalize_local(
            causal, self.window_left, self.window_right, self.attention_chunk, seqlen_q, seqlen_k
        )
        features = {"window_left": left, "window_right": right, "attention_chunk": chunk}
        return {"causal": causal, **features, "softcap": self.softcap, "sinks": self.sinks}


FULL = LayerKind()


def sliding(window: int, **features: bool) -> LayerKind:
    """A causal sliding-window layer of transformers' `sliding_window` = `window`: each row sees
    `window` keys, its own included (its masks keep kv_idx > q_idx - window, and its flash path
    passes window_size (window - 1, window - 1) with causal=True): FlashAttention's (window - 1, 0)."""
    return LayerKind(window_left=window - 1, window_right=0, **features)


def chunked(size: int) -> LayerKind:
    """A causal layer of chunked local attention (Llama 4's `attention_chunk_size`): a row sees the
    keys of its own chunk of `size` up to itself (transformers' chunked_overlay under causal)."""
    return LayerKind(window_right=0, attention_chunk=size)


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """The attention of a model: query heads, key/value heads, head dim, and the kinds of
    attention layer it has (each tuned as Problems of their own)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[LayerKind, ...] = (FULL,)


# Head counts, head dims, windows and layer patterns as transformers 5.24 configures each model:
# src/transformers/models/<model>/configuration_<model>.py (the defaults describe gemma2-2b,
# gpt-oss-120b, Llama 4 Scout's text model and Mistral-7B-v0.1) and the per-size configs of
# gemma2/convert_gemma2_weights_to_hf.py and gemma3/convert_gemma3_weights.py; gpt-oss-20b from
# its Hub config.json (24 layers, the 120b's attention). Layers are listed in the order the
# first ones come.
# Gemma 2: every other layer slides over 4096 keys, the first one included; every layer caps its
# scores at 50 (attn_logit_softcapping).
GEMMA2 = (sliding(4096, softcap=True), LayerKind(softcap=True))
# Gemma 3: five sliding layers to one global (sliding_window_pattern 6), no cap (QK norm instead).
GEMMA3_SMALL, GEMMA3 = (sliding(512), FULL), (sliding(1024), FULL)
# gpt-oss: sliding (128) and full layers alternate, each with a learned sink per head (s_aux).
GPT_OSS = (sliding(128, sinks=True), LayerKind(sinks=True))
PRESETS = {
    p.name: p
    for p in (
        ModelPreset("llama3-8b", 32, 8, 128),
        ModelPreset("llama3-70b", 64, 8, 128),
        # Mistral 7B v0.2 and v0.3, full attention (their configs set no sliding_window); v0.1 slid.
        ModelPreset("mistral-7b", 32, 8, 128),
        ModelPreset("mistral-7b-v0.1", 32, 8, 128, (sliding(4096),)),
        ModelPreset("qwen2.5-7b", 28, 4, 128),
        ModelPreset("gpt2", 12, 12, 64),
        ModelPreset("gemma2-2b", 8, 4, 256, GEMMA2),
        ModelPreset("gemma2-9b", 16, 8, 256, GEMMA2),
        ModelPreset("gemma2-27b", 32, 16, 128, GEMMA2),
        ModelPreset("gemma3-1b", 4, 1, 256, GEMMA3_SMALL),
        ModelPreset("gemma3-4b", 8, 4, 256, GEMMA3),
        ModelPreset("gemma3-12b", 16, 8, 256, GEMMA3),
        ModelPreset("gemma3-27b", 32, 16, 128, GEMMA3),
        ModelPreset("gpt-oss-20b", 64, 8, 64, GPT_OSS),
        ModelPreset("gpt-oss-120b", 64, 8, 64, GPT_OSS),
        # Three layers in four attend within chunks of 8192 keys; every fourth (NoPE) is global.
        ModelPreset("llama4-scout", 40, 8, 128, (chunked(8192), FULL)),
    )
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Variants a dry run evaluates per Problem at most: it checks the machinery, it finds no Winner.
DRY_RUN_TRIALS = 4


def preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}") from None


def parse_shape(text: str, layer: LayerKind = FULL) -> ModelPreset:
    """`HEADS,KV_HEADS,HEAD_DIM` (e.g. 32,8,128) as an unnamed preset of one layer kind."""
    try:
        heads, kv_heads, head_dim = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"shape: expected HEADS,KV_HEADS,HEAD_DIM such as 32,8,128, got {text!r}") from None
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim > 256:
        raise ValueError(
            f"shape: heads must be a multiple of kv_heads and head_dim at most 256, got {text!r}"
        )
    return ModelPreset(text, heads, kv_heads, head_dim, (layer,))


def problems(
    models: list[ModelPreset],
    *,
    dtype: str = "bfloat16",
    causal: tuple[bool, ...] = (True,),
    seqlens: tuple[int, ...] = (1024, 4096, 16384),
    tokens: int = 16384,
    family: str = "prefill",
    batches: tuple[int, ...] = (1, 16, 64),
    page_size: int = 0,
    fp8: bool = False,
) -> list[Problem]:
    """Prefill (or backward) Problems for each model's layer kinds, causal setting and sequence
    length, `tokens` per batch; or decode Problems (one query token) for each layer kind, batch
    size and cache length (paged with `page_size` tokens a page, a multiple of 16; 0: contiguous).
    With `fp8`: FP8 prefill (bfloat16 output, whatever `dtype` says) or an FP8 KV cache. A layer's
    window or chunk stays in its Problem only at lengths where it leaves keys out (`LayerKind.
    fields`): elsewhere the layer is the plain one. Duplicates are dropped, the first kept."""
    for name, values in (("seqlens", seqlens), ("batches", batches), ("tokens", (tokens,))):
        if not values or min(values) < 1:
            raise ValueError(f"{name}: expected positive integers, got {values!r}")
    if page_size < 0 or page_size % 16:
        raise ValueError(f"page_size: expected 0 or a positive multiple of 16, got {page_size!r}")
    out = []
    for model in models:
        heads = {"head_dim": model.head_dim, "num_heads_q": model.heads, "num_heads_kv": model.kv_heads}
        for layer in model.layers:
            if family == "decode":
                out += [
                    Problem.of(
                        family="decode",
                        dtype=dtype,
                        **heads,
                        batch=b,
                        seqlen_q=1,
                        seqlen_k=n,
                        paged=page_size > 0,
                        page_size=page_size,
                        fp8=fp8,
                        **layer.fields(True, 1, n),
                    )
                    for b in batches
                    for n in seqlens
                ]
                continue
            out += [
                Problem.of(
                    family=family,
                    dtype="bfloat16" if fp8 else dtype,
                    **heads,
                    batch=max(1, tokens // n),
                    seqlen_q=n,
                    seqlen_k=n,
                    fp8=fp8,
                    **layer.fields(c, n, n),
                )
                for c in causal
                for n in seqlens
            ]
    return list(dict.fromkeys(out))


def dry_run(problem: Problem) -> Problem:
    """The same features on a tiny shape the interpreter gets through in seconds: a window's sides
    shrunk to a quarter of its keys at most and a chunk to half, so that they still leave keys
    out (and skip blocks), in the canonical form."""
    group = problem.num_heads_q // problem.num_heads_kv
    if problem.family == "decode":
        tiny = dataclasses.replace(
            problem, num_heads_q=group, num_heads_kv=1, batch=2, seqlen_k=max(64, 2 * problem.page_size)
        )
    else:
        tiny = dataclasses.replace(
            problem, num_heads_q=group, num_heads_kv=1, batch=1, seqlen_q=32, seqlen_k=32
        )
    if not tiny.local:
        return tiny
    side, chunk = tiny.seqlen_k // 4, tiny.seqlen_k // 2
    left, right = (w if w < 0 else min(w, side) for w in (tiny.window_left, tiny.window_right))
    layer = LayerKind(left, right, min(tiny.attention_chunk, chunk), tiny.softcap, tiny.sinks)
    return dataclasses.replace(tiny, **layer.fields(tiny.causal, tiny.seqlen_q, tiny.seqlen_k))
