"""tunegen: attention kernels generated from templates, tuned per GPU, served through one import.

import tunegen
out = tunegen.attention(q, k, v, causal=True)            # (batch, heads, seqlen, head_dim)
out = tunegen.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)   # packed sequences
out = tunegen.attention(q, k, v, precision="fp8")        # FP8 with the Hadamard rotation
"""

import tunegen.source_tree  # first: a clone run without installing finds its rooms

# isort: split
import tunegen.ops  # noqa: F401  (registers torch.ops.tunegen.*)
from tunegen import flash_provider
from tunegen.api import attention, attention_varlen, explain
from tunegen.backends import FallbackError
from tunegen.decode import decode_attention
from tunegen.fp8_quantize import quantize_fp8
from tunegen.kernels.releases import warn_if_unchecked
from tunegen.kvcache import KVCache
from tunegen.version import __version__

warn_if_unchecked()
flash_provider.register()  # activated only by torch.nn.attention.activate_flash_attention_impl("tunegen")

__all__ = [
    "FallbackError",
    "KVCache",
    "__version__",
    "attention",
    "attention_varlen",
    "decode_attention",
    "explain",
    "quantize_fp8",
]
