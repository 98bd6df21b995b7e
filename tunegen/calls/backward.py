"""A checked call of the backward family: the gradients of a prefill call (tunegen.calls.prefill),
from its output and log-sum-exp and the gradients that flow into them: dq, dk, dv, and where the
call has sinks, theirs."""

from __future__ import annotations

import dataclasses

import torch

from tunegen import checks
from tunegen.backends import fallback_dtype
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.launch_args import BackwardArgs
from tunegen.kernels.problem import DTYPE_NAMES, Problem

# dq, dk, dv, and the sinks' gradient (float32, (heads,)) where the forward had sinks.
Grads = tuple[torch.Tensor, ...]


def descriptor_ready(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors (TMA) can read `tensors` row by row: 16-byte aligned bases and
    strides, and no stride of zero (a broadcast dout) but the last."""
    return checks.is_aligned16(*tensors) and all(0 not in t.stride()[:-1] for t in tensors)


@dataclasses.dataclass(frozen=True)
class BackwardCall:
    """The backward of `forward`: its output `out` and log-sum-exp `lse` (float32, as the forward
    wrote them), the gradient of the output `dout` (like out, unit last stride) and of the
    log-sum-exp `dlse` (or None)."""

    forward: PrefillCall
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    dlse: torch.Tensor | None

    @classmethod
    def checked(
        cls, forward: PrefillCall, out: torch.Tensor, lse: torch.Tensor, dout: object, dlse: object
    ) -> BackwardCall:
        """The backward of `forward`, its incoming gradients checked: dout like the output (None:
        zeros, when only the log-sum-exp was used), dlse like the log-sum-exp or None."""
        if dout is None:
            dout = torch.zeros_like(out)
        if not isinstance(dout, torch.Tensor) or dout.shape != out.shape or dout.device != out.device:
            what = (
                f"shape {tuple(dout.shape)} on {dout.device}"
                if isinstance(dout, torch.Tensor)
                else type(dout)
            )
            raise ValueError(
                f"dout: expected the output's shape {tuple(out.shape)} on {out.device}, got {what}"
            )
        expected = tuple(out.shape[:3]) if out.dim() == 4 else (out.shape[1], out.shape[0])
        if lse.shape != expected:
            raise ValueError(
                f"lse: expected the forward's log-sum-exp, shape {expected}, got {tuple(lse.shape)}"
            )
        if dlse is not None and (not isinstance(dlse, torch.Tensor) or dlse.shape != lse.shape):
            raise ValueError(f"dlse: expected None or a tensor of the log-sum-exp's shape {tuple(lse.shape)}")
        dout = dout.to(out.dtype)
        # The kernels read each row of the log-sum-exp as consecutive floats, and address dlse and
        # their scratch (the sinks' rows) with its strides, which `empty_like` keeps only for a
        # dense tensor: a permuted one (as PyTorch's CPU flash op writes it) or a padded view is
        # copied first.
        lse = lse if lse.is_contiguous() else lse.contiguous()
        return cls(forward, out, lse, dout if dout.stride(-1) == 1 else dout.contiguous(), dlse)

    def problem(self) -> Problem:
        """The backward Problem: the forward's sizes, mask and features of current models (whether it
        returned its log-sum-exp leaves it unchanged), aligned where descriptors can read q, k, v
        and dout."""
        f = self.forward
        return Problem.of(
            family="backward",
            dtype=DTYPE_NAMES[f.q.dtype],
            head_dim=f.q.shape[-1],
            causal=f.causal,
            num_heads_q=f.q.shape[1],
            num_heads_kv=f.k.shape[1],
            batch=f.batch,
            seqlen_q=f.seqlen_q,
            seqlen_k=f.seqlen_k,
            varlen=f.varlen is not None,
            aligned=descriptor_ready(f.q, f.k, f.v, self.dout),
            **f.local.key(),
        )

    def outputs(self) -> Grads:
        """Fresh dq, dk, dv, and for sinks a float32 (heads,) gradient."""
        f = self.forward
        grads = (torch.empty_like(f.q), torch.empty_like(f.k), torch.empty_like(f.v))
        if f.local.sinks is None:
            return grads
        return (*grads, torch.empty(f.local.sinks.shape, device=f.q.device, dtype=torch.float32))

    def args(
        self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dsinks: torch.Tensor | None = None
    ) -> BackwardArgs:
        """The kernels' launch arguments, writing dq, dk, dv (and the sinks' gradient into dsinks)."""
        f = self.forward
        args = BackwardArgs(f.q, f.k, f.v, self.out, self.dout, self.lse, self.dlse, dq, dk, dv, f.scale)
        args.softcap, args.sinks, args.dsinks = f.local.softcap, f.local.sinks, dsinks
        if f.varlen is not None:
            args.cu_seqlens_q, args.cu_seqlens_k = f.varlen.cu_seqlens_q, f.varlen.cu_seqlens_k
            args.max_seqlen_q, args.max_seqlen_k = f.varlen.max_seqlen_q, f.varlen.max_seqlen_k
        return args

    def fallback(self) -> Grads:
        """The PyTorch path: autograd through the forward's reference (float32 compute; float64
        for float64 inputs), the sinks too."""
        f = self.forward
        sinks = f.local.sinks
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_() for t in (f.q, f.k, f.v))
            if sinks is not None:
                sinks = sinks.detach().requires_grad_()
                f = dataclasses.replace(f, local=dataclasses.replace(f.local, sinks=sinks))
            out, lse = f.reference(fallback_dtype(f.q.dtype), leaves)
            pairs = [
                (o, g) for o, g in ((out.to(f.q.dtype), self.dout), (lse.float(), self.dlse)) if g is not None
            ]
            inputs = leaves if sinks is None else (*leaves, sinks)
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs])
        return grads
