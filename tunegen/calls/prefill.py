"""A checked call of the prefill family: `tunegen.attention` (16-bit or FP8) and
`tunegen.attention_varlen`, as every path that serves one sees it.

Each public entry point builds one `PrefillCall` from its arguments (the checks run there, once),
and everything else derives from it: the Problem key, the outputs, the kernel's launch arguments,
the PyTorch reference that serves where no Triton kernel runs, and `explain()`. The backward
(tunegen.calls.backward) starts from the forward's call.
"""

from __future__ import annotations

import dataclasses

import torch

from tunegen import checks
from tunegen.backends import backend_for, fallback_dtype, wants_grad
from tunegen.calls.local import NONE, Local, check_local
from tunegen.kernels import fp8
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import DTYPE_NAMES, Problem
from tunegen.kernels.reference import attention_reference, attention_varlen_reference, gather_pages


@dataclasses.dataclass(frozen=True)
class Varlen:
    """Packed sequences, in `flash_attn_varlen_func`'s terms: int32 offsets (batch + 1) of each
    sequence in the packed q and k, v, and bounds on their lengths.

    Paged keys (chunked prefill over a KV cache, FlashAttention-3's arguments): `block_table`
    (batch, max_pages) int32 names each sequence's pages of the caches k, v (num_pages, page_size,
    kv_heads, head_dim), key j in page block_table[b, j // page_size] at row j % page_size;
    `seqused_k` (batch,) int32 counts its keys; cu_seqlens_k is then None."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.block_table is not None


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """What a prefill call asks for, checked.

    q, k, v are what the kernel reads: (batch, heads, seqlen, head_dim), or packed (total_tokens,
    heads, head_dim) with `varlen` (k, v paged caches (num_pages, page_size, kv_heads, head_dim)
    where it is `paged`); float8 e4m3 with `descales` (q_descale, k_descale, v_descale)
    for FP8. `scale` is resolved; `return_lse` says whether the kernel writes the log-sum-exp (the
    caller asked for it, or autograd keeps it for the backward); `out_dtype` is what the caller
    gets back (FP8 kernels write bfloat16); `deterministic` asks for a backward whose gradients
    are the same bits on every run (as torch.use_deterministic_algorithms does for every call);
    `local`, the attention of current models it asks for (window, chunks, cap, sinks);
    `lengths`, a packed call's lengths on their way to the host to be checked, which every launch
    and the PyTorch path wait for (`checks.LengthsCheck`).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float
    return_lse: bool
    strict: bool | None = None
    varlen: Varlen | None = None
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    out_dtype: torch.dtype | None = None
    deterministic: bool = False
    local: Local = NONE
    lengths: checks.LengthsCheck | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def dense(
        cls,
        q: object,
        k: object,
        v: object,
        *,
        causal: object = False,
        scale: object = None,
        return_lse: object = False,
        strict: bool | None = None,
        deterministic: object = False,
        window_size: object = (-1, -1),
        attention_chunk: object = 0,
        softcap: object = 0.0,
        sinks: object = None,
    ) -> PrefillCall:
        """`tunegen.attention`'s 16-bit or float32 call, checked."""
        checks.check_attention(q, k, v)
        resolved = checks.check_scale(scale, q.shape[-1])
        local = check_local(q, window_size, attention_chunk, softcap, sinks)
        mask, local = (
            local.normalized(bool(causal), q.shape[2], k.shape[2], False)
            if local.any
            else (bool(causal), local)
        )
        flag = bool(deterministic)
        return cls(q, k, v, mask, resolved, bool(return_lse), strict, deterministic=flag, local=local)

    @classmethod
    def packed(
        cls,
        q: object,
        k: object,
        v: object,
        cu_seqlens_q: object,
        cu_seqlens_k: object,
        max_seqlen_q: object,
        max_seqlen_k: object,
        *,
        causal: object = False,
        scale: object = None,
        return_lse: object = False,
        strict: bool | None = None,
        read_lengths: bool = False,
        deterministic: object = False,
        window_size: object = (-1, -1),
        attention_chunk: object = 0,
        softcap: object = 0.0,
        sinks: object = None,
        seqused_k: object = None,
        block_table: object = None,
    ) -> PrefillCall:
        """`tunegen.attention_varlen`'s call, checked; with `read_lengths`, the offsets (or the
        paged keys' counts and pages) too, read back to the host (see checks.check_attention_varlen)
        while the call is dispatched, and checked before it runs (`lengths`).
        A paged call (`block_table`) takes no gradient: its keys are a cache, which nothing trains,
        and the backward kernels read packed keys only."""
        sizes = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        pages = {"seqused_k": seqused_k, "block_table": block_table}
        lengths = checks.check_attention_varlen(q, k, v, *sizes, read_lengths=read_lengths, **pages)
        resolved = checks.check_scale(scale, q.shape[-1])
        local = check_local(q, window_size, attention_chunk, softcap, sinks)
        if block_table is not None and wants_grad(q, k, v, local.sinks):
            raise ValueError(
                "block_table: paged calls take no gradient (the cache is no leaf to train); detach q, k, v "
                "and the sinks, or call under torch.no_grad()"
            )
        bounds = (int(max_seqlen_q), int(max_seqlen_k))
        mask, local = local.normalized(bool(causal), *bounds, True) if local.any else (bool(causal), local)
        flag = bool(deterministic)
        return cls(
            q,
            k,
            v,
            mask,
            resolved,
            bool(return_lse),
            strict,
            Varlen(*sizes, **pages),
            deterministic=flag,
            local=local,
            lengths=lengths,
        )

    @property
    def batch(self) -> int:
        return self.q.shape[0] if self.varlen is None else self.varlen.cu_seqlens_q.shape[0] - 1

    @property
    def seqlen_q(self) -> int:
        """The query length (with `varlen`, the bound on it)."""
        return self.q.shape[2] if self.varlen is None else self.varlen.max_seqlen_q

    @property
    def seqlen_k(self) -> int:
        return self.k.shape[2] if self.varlen is None else self.varlen.max_seqlen_k

    def backend(self) -> str:
        """Which path serves the call (tunegen.backends.backend_for)."""
        return backend_for(self.q.device, self.strict)

    def outputs(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output (`out`, else a fresh one like q; bfloat16 for FP8) and a fresh log-sum-exp
        (float32, or None unless kept)."""
        q = self.q
        if out is None:
            out = torch.empty_like(q) if self.descales is None else torch.empty_like(q, dtype=torch.bfloat16)
        if not self.return_lse:
            return out, None
        shape = q.shape[:3] if self.varlen is None else (q.shape[1], q.shape[0])
        return out, torch.empty(shape, device=q.device, dtype=torch.float32)

    def problem(self, out: torch.Tensor) -> Problem:
        """The Problem the call is dispatched under, writing into `out` (sizes bucketed)."""
        q, k, v = self.q, self.k, self.v
        if self.descales is not None and fp8.is_k_major(v):
            v = v.transpose(2, 3)
        paged = self.varlen is not None and self.varlen.paged
        return Problem.of(
            family="prefill",
            dtype=DTYPE_NAMES[out.dtype],
            head_dim=q.shape[-1],
            num_heads_q=q.shape[1],
            num_heads_kv=k.shape[2] if paged else k.shape[1],  # caches: (pages, page_size, heads, d)
            batch=self.batch,
            seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k,
            causal=self.causal,
            varlen=self.varlen is not None,
            paged=paged,
            page_size=k.shape[1] if paged else 0,
            fp8=self.descales is not None,
            return_lse=self.return_lse,
            aligned=checks.is_aligned16(q, k, v, out),
            **self.local.key(),
        )

    def args(self, out: torch.Tensor, lse: torch.Tensor | None) -> PrefillArgs:
        """The kernel's launch arguments, writing `out` and `lse`, once the lengths read back (if
        any) pass their checks: the last step before a launch, so the dispatch ran while they
        were on their way."""
        if self.lengths is not None:
            self.lengths.wait()
        args = PrefillArgs(
            self.q, self.k, self.v, out, lse, self.scale, softcap=self.local.softcap, sinks=self.local.sinks
        )
        if self.varlen is not None:
            args.cu_seqlens_q, args.cu_seqlens_k = self.varlen.cu_seqlens_q, self.varlen.cu_seqlens_k
            args.max_seqlen_q = self.varlen.max_seqlen_q
            args.seqused_k, args.block_table = self.varlen.seqused_k, self.varlen.block_table
        if self.descales is not None:
            args.q_descale, args.k_descale, args.v_descale = self.descales
        return args

    def reference(
        self, compute_dtype: torch.dtype = torch.float64, inputs: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's output and log-sum-exp by PyTorch in `compute_dtype` (float64: the golden
        reference), FP8 inputs dequantized first, paged keys gathered into packed ones first
        (`gather_pages`); `inputs` may stand in for the call's q, k, v (the same values, as
        autograd's leaves)."""
        q, k, v = (self.q, self.k, self.v) if inputs is None else inputs
        if self.descales is not None:
            q, k, v = (
                fp8.dequantize(t, s, compute_dtype) for t, s in zip((q, k, v), self.descales, strict=True)
            )
        local = self.local.reference_args()
        if self.varlen is None:
            return attention_reference(
                q, k, v, causal=self.causal, scale=self.scale, compute_dtype=compute_dtype, **local
            )
        cu_q, cu_k = self.varlen.cu_seqlens_q, self.varlen.cu_seqlens_k
        if self.varlen.paged:
            k, v, cu_k = gather_pages(k, v, self.varlen.block_table, self.varlen.seqused_k)
        return attention_varlen_reference(
            q, k, v, cu_q, cu_k, causal=self.causal, scale=self.scale, compute_dtype=compute_dtype, **local
        )

    def fallback(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch path: the reference in float32 (float64 for float64 inputs), the output in
        the caller's dtype and the log-sum-exp in float32, once the lengths read back (if any)
        pass their checks."""
        if self.lengths is not None:
            self.lengths.wait()
        out, lse = self.reference(fallback_dtype(self.q.dtype))
        return out.to(self.out_dtype or self.q.dtype), lse.float()

    def returned(self, out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool) -> object:
        """What the public function returns: the output in `out_dtype`, and the log-sum-exp if
        `return_lse`."""
        if self.out_dtype is not None and out.dtype != self.out_dtype:
            out = out.to(self.out_dtype)
        return (out, lse) if return_lse else out
