"""Hugging Face transformers integration: `attn_implementation="tunegen"`.

    import tunegen.huggingface
    tunegen.huggingface.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="tunegen")

transformers builds no mask where a layer's pattern is causal or a causal sliding window and the
batch is not padded (FlashAttention's mask rules, registered for "tunegen"; any other pattern,
packed sequences, prefix or image-token masks and their like, gets SDPA's real mask, which the
attention refuses), and tunegen's masks are bottom-right aligned, so prefill and cached decode
steps both run without one. Sliding
windows (Mistral, Gemma 2 and 3, gpt-oss: `sliding_window` keys back, as transformers' flash
path reads it), Gemma 2's logit cap (`softcap`) and gpt-oss's sinks (`s_aux`) run in tunegen's
kernels, forward and backward (the sinks get their gradient). A real mask (padded batches) is
refused: pack such batches and call `tunegen.attention_varlen`, or use another implementation
for them. So are Llama 4's chunked layers, whose chunks transformers passes only as a mask.
"""

from __future__ import annotations

from typing import Any

import torch

import tunegen

NAME = "tunegen"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, N, D) in, (B, N, H, D) out."""
    if dropout:
        raise ValueError(
            f"dropout: tunegen's attention applies no dropout, got {dropout}; evaluate with model.eval()"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias: not supported by tunegen's attention")
    if _layer_type(module) == "chunked_attention":
        raise ValueError(
            "attention_chunk: transformers passes chunked layers' chunks (Llama 4) only as a mask, which "
            "tunegen's integration does not read; call tunegen.attention(attention_chunk=...) directly"
        )
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: tunegen runs causal or full attention without a mask; this batch needs one "
            "(padding?). Pack it and use tunegen.attention_varlen, or another attn_implementation"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = _window(module, kwargs.get("sliding_window"))
    out = tunegen.attention(
        query,
        key,
        value,
        causal=bool(causal),
        scale=scaling,
        window_size=(-1, -1) if window is None else (window - 1, window - 1),
        softcap=kwargs.get("softcap") or 0.0,
        sinks=kwargs.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None


def _window(module: torch.nn.Module, passed: int | None) -> int | None:
    """The layer's sliding window: as transformers passes it, else as the layer or its config
    holds it for a sliding layer; a config that names a window but no layer kinds, or a layer
    kind other than full or sliding attention, is refused rather than guessed."""
    if passed is not None:
        return passed
    kind = _layer_type(module)
    config = getattr(module, "config", None)
    if kind not in (None, "full_attention", "sliding_attention"):
        raise ValueError(
            f"layer_types: tunegen's integration runs full and sliding attention layers, not {kind!r}"
        )
    window = getattr(module, "sliding_window", None)
    if window is None and kind == "sliding_attention":
        window = getattr(config, "sliding_window", None)
    if window is None and kind is None and getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            "sliding_window: this model's config names a window that its layers do not pass to the "
            "attention function; tunegen's integration cannot tell which layers slide"
        )
    return window


def _mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' mask for a layer kind: none where the pattern is causal (or a causal sliding
    window, which `attention_forward` reads from the layer) and no token is padding, as for
    FlashAttention; SDPA's real mask wherever transformers may not skip it (packed sequences, prefix
    or image-token overlays, other deviations, a compiled cache's decode step), which the attention
    refuses rather than run unmasked."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if not kwargs.get("allow_is_causal_skip", True) or not kwargs.get("allow_is_bidirectional_skip", True):
        return sdpa_mask(**kwargs)
    return flash_attention_mask(**kwargs)


def _layer_type(module: torch.nn.Module) -> str | None:
    """The layer's kind in its model's config (`layer_types`: "full_attention", "sliding_attention",
    "chunked_attention"), or None where the config names none."""
    types = getattr(getattr(module, "config", None), "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types is None or index is None or index >= len(types):
        return None
    return types[index]


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` run tunegen in every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask)
