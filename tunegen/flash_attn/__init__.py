"""FlashAttention-2's Python interface (flash_attn 2.8), served by tunegen's kernels:

    import tunegen.flash_attn as flash_attn          # was: import flash_attn
    from tunegen.flash_attn import flash_attn_func   # was: from flash_attn import flash_attn_func
    from tunegen.flash_attn.flash_attn_interface import flash_attn_func   # as flash_attn's own

Each function has FlashAttention's name, parameters (order and defaults), layouts, causal
alignment (bottom-right), return values and gradients. An argument tunegen does not serve
(dropout, sliding windows, softcap, ALiBi, rotary embeddings, cache indirections) is a ValueError
that names it when its value asks for the feature, never ignored; the README's table says what
each argument does here. FlashAttention-3's interface is `tunegen.flash_attn_interface`.
"""

from tunegen.flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
