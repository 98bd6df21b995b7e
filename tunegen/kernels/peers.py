"""The implementations tunegen is measured against, on the same GPU in the same run:
each of PyTorch's scaled_dot_product_attention backends, and FlexAttention."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}


def sdpa(backend: str, causal: bool) -> Attention:
    """SDPA pinned to one backend; raises at call time when the backend refuses the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
            )

    return run


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


def available() -> list[str]:
    """Names of the peers this machine can try (each may still refuse a given shape)."""
    names = list(SDPA_BACKENDS)
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        names.append("flex")
    except ImportError:
        pass
    return names
