"""Model presets and the Problems a tuning run covers."""

from __future__ import annotations

import dataclasses

from tunegen.kernels.problem import Problem


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """The attention shape of a model family: query heads, key/value heads, head dim."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int


PRESETS = {
    p.name: p
    for p in (
        ModelPreset("llama3-8b", 32, 8, 128),
        ModelPreset("llama3-70b", 64, 8, 128),
        ModelPreset("mistral-7b", 32, 8, 128),
        ModelPreset("qwen2.5-7b", 28, 4, 128),
        ModelPreset("gpt2", 12, 12, 64),
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


def parse_shape(text: str) -> ModelPreset:
    """`HEADS,KV_HEADS,HEAD_DIM` (e.g. 32,8,128) as an unnamed preset."""
    try:
        heads, kv_heads, head_dim = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"shape: expected HEADS,KV_HEADS,HEAD_DIM such as 32,8,128, got {text!r}") from None
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim > 256:
        raise ValueError(
            f"shape: heads must be a multiple of kv_heads and head_dim at most 256, got {text!r}"
        )
    return ModelPreset(text, heads, kv_heads, head_dim)


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
    """Prefill Problems for each model, causal setting and sequence length, `tokens` per batch;
    or decode Problems (one query token) for each model, batch size and cache length (paged with
    `page_size` tokens a page, a multiple of 16; 0: contiguous). With `fp8`: FP8 prefill (bfloat16
    output, whatever `dtype` says) or an FP8 KV cache."""
    for name, values in (("seqlens", seqlens), ("batches", batches), ("tokens", (tokens,))):
        if not values or min(values) < 1:
            raise ValueError(f"{name}: expected positive integers, got {values!r}")
    if page_size < 0 or page_size % 16:
        raise ValueError(f"page_size: expected 0 or a positive multiple of 16, got {page_size!r}")
    out = []
    if family == "decode":
        for model in models:
            for b in batches:
                for n in seqlens:
                    out.append(
                        Problem.of(
                            family="decode",
                            dtype=dtype,
                            head_dim=model.head_dim,
                            causal=True,
                            num_heads_q=model.heads,
                            num_heads_kv=model.kv_heads,
                            batch=b,
                            seqlen_q=1,
                            seqlen_k=n,
                            paged=page_size > 0,
                            page_size=page_size,
                            fp8=fp8,
                        )
                    )
        return list(dict.fromkeys(out))
    for model in models:
        for c in causal:
            for n in seqlens:
                b = max(1, tokens // n)
                out.append(
                    Problem.of(
                        family=family,
                        dtype="bfloat16" if fp8 else dtype,
                        head_dim=model.head_dim,
                        causal=c,
                        num_heads_q=model.heads,
                        num_heads_kv=model.kv_heads,
                        batch=b,
                        seqlen_q=n,
                        seqlen_k=n,
                        fp8=fp8,
                    )
                )
    return list(dict.fromkeys(out))


def dry_run(problem: Problem) -> Problem:
    """The same features on a tiny shape the interpreter gets through in seconds."""
    group = problem.num_heads_q // problem.num_heads_kv
    if problem.family == "decode":
        return dataclasses.replace(
            problem, num_heads_q=group, num_heads_kv=1, batch=2, seqlen_k=max(64, 2 * problem.page_size)
        )
    return dataclasses.replace(problem, num_heads_q=group, num_heads_kv=1, batch=1, seqlen_q=32, seqlen_k=32)
