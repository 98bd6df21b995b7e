"""Hugging Face transformers integration: `attn_implementation="tunegen"`.

    import tunegen.huggingface
    tunegen.huggingface.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="tunegen")

transformers builds no mask when the pattern is purely causal (SDPA's mask rules, registered for
"tunegen" too), and tunegen's causal mask is bottom-right aligned, so prefill and cached decode
steps both run mask-free. A real mask (padded batches) is refused: pack such batches and call
`tunegen.attention_varlen`, or use another implementation for them.
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
    for name in ("softcap", "sliding_window", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by tunegen's attention")
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: tunegen runs causal or full attention without a mask; this batch needs one "
            "(padding?). Pack it and use tunegen.attention_varlen, or another attn_implementation"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = tunegen.attention(query, key, value, causal=bool(causal), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` run tunegen in every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
