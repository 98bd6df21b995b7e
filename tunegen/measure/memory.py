"""The memory calculator: KV cache per token and per sequence, the GQA/MQA savings, and the
N x N score matrix standard attention materializes against tiled attention's O(N) state."""

from __future__ import annotations

import dataclasses

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class Model:
    """What the memory of attention depends on."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


MODELS = {
    m.name: m
    for m in (
        Model("llama2-70b", 80, 64, 8, 128),
        Model("llama2-7b", 32, 32, 32, 128),
        Model("llama3-8b", 32, 32, 8, 128),
        Model("llama3-70b", 80, 64, 8, 128),
        Model("mistral-7b", 32, 32, 8, 128),
        Model("qwen2.5-7b", 28, 28, 4, 128),
        Model("gpt2", 12, 12, 12, 64),
    )
}


@dataclasses.dataclass(frozen=True)
class Report:
    """Bytes, per kind of attention (kv_heads = heads: MHA; the model's; 1: MQA)."""

    model: Model
    dtype: str
    seqlen: int
    batch: int
    kv_bytes_per_token_per_layer: dict[str, int]
    kv_bytes_per_sequence: dict[str, int]
    kv_bytes_batch: dict[str, int]
    scores_bytes_per_layer: int
    tiled_state_bytes_per_layer: int


def report(model: Model, *, seqlen: int, batch: int = 1, dtype: str = "fp16") -> Report:
    """KV-cache and attention-state sizes for `batch` sequences of `seqlen` tokens."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    for name, value in (("seqlen", seqlen), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    size = DTYPE_BYTES[dtype]
    kinds = {"MHA": model.heads, f"model ({model.kv_heads} KV heads)": model.kv_heads, "MQA": 1}
    per_token = {kind: 2 * kv * model.head_dim * size for kind, kv in kinds.items()}
    per_sequence = {kind: b * model.layers * seqlen for kind, b in per_token.items()}
    return Report(
        model=model,
        dtype=dtype,
        seqlen=seqlen,
        batch=batch,
        kv_bytes_per_token_per_layer=per_token,
        kv_bytes_per_sequence=per_sequence,
        kv_bytes_batch={kind: b * batch for kind, b in per_sequence.items()},
        # Standard attention holds every head's seqlen x seqlen scores of a layer at once.
        scores_bytes_per_layer=batch * model.heads * seqlen * seqlen * size,
        # Tiled attention keeps only a float32 log-sum-exp per query row and head.
        tiled_state_bytes_per_layer=batch * model.heads * seqlen * 4,
    )


def human(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def render_text(r: Report) -> str:
    m = r.model
    lines = [
        f"{m.name}: {m.layers} layers, {m.heads} heads ({m.kv_heads} KV), head dim {m.head_dim}, {r.dtype}, "
        f"{r.seqlen} tokens x batch {r.batch}",
        f"{'KV cache':28} {'per token per layer':>20} {'per sequence':>14} {'batch':>12}",
    ]
    for kind in r.kv_bytes_per_token_per_layer:
        lines.append(
            f"  {kind:26} {human(r.kv_bytes_per_token_per_layer[kind]):>20} "
            f"{human(r.kv_bytes_per_sequence[kind]):>14} {human(r.kv_bytes_batch[kind]):>12}"
        )
    lines.append(
        f"attention per layer: standard N x N scores {human(r.scores_bytes_per_layer)}, "
        f"tiled (tunegen) {human(r.tiled_state_bytes_per_layer)} of log-sum-exp"
    )
    return "\n".join(lines)
