"""The backward family's tuning case: fresh random q, k, v and output gradient, the forward's output
and log-sum-exp from a float64 reference, the kernel's launch into gradients poisoned with NaN,
their float64 check, and as peers the backward of SDPA's backends and of FlexAttention (the
issue's yardstick for the backward). A Problem with the features of current models runs them as
the prefill case does (Gemma 2's cap, a random sink logit per head, whose gradient is checked
too) and has no peers: SDPA takes none of them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tunegen.kernels.families.base import Case, Kernel, case_features, generator, normal
from tunegen.kernels.launch_args import BackwardArgs
from tunegen.kernels.masks import local_mask
from tunegen.kernels.problem import TORCH_DTYPES, Problem

# dq, dk, dv, and with sinks their gradient.
Grads = tuple[torch.Tensor, ...]
CHUNK_ELEMENTS = 2**24  # score elements per float64 step of the reference


def reference_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Attention's output, log-sum-exp and gradients (dq, dk, dv, and the sinks' where there are
    sinks) over (B, H, N, D) tensors in float64, a few query rows at a time so that no
    B x H x Nq x Nk matrix is ever held; dk and dv are summed over each GQA group. The features
    are `attention_reference`'s: the gradient goes through the cap's tanh, and a sink, one more
    logit of each row's softmax with no value, gets −Σ exp(sink − lse)·rowsum(dO·O)."""
    batch, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    qd, dod = q.double(), dout.double()
    kd, vd = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    out, dq = torch.empty_like(qd), torch.empty_like(qd)
    lse = torch.empty(qd.shape[:3], dtype=torch.float64, device=q.device)
    dk, dv = torch.zeros_like(kd), torch.zeros_like(vd)
    sink = None if sinks is None else sinks.double()[:, None]
    dsinks = torch.zeros(hq, dtype=torch.float64, device=q.device)
    left, right = window_size
    sides = {"left": left, "right": right, "chunk": attention_chunk}
    local = causal or left >= 0 or right >= 0 or attention_chunk > 0
    keep = local_mask(nq, nk, causal=causal, device=q.device, **sides) if local else None
    rows = max(1, CHUNK_ELEMENTS // (batch * hq * nk))
    for r0 in range(0, nq, rows):
        r = slice(r0, r0 + rows)
        s = torch.matmul(qd[:, :, r], kd.transpose(-1, -2)) * scale
        if softcap > 0:
            tanh = torch.tanh(s / softcap)
            s = softcap * tanh
        if keep is not None:
            s.masked_fill_(~keep[r], float("-inf"))
        lse[:, :, r] = torch.logsumexp(s, dim=-1)
        if sink is not None:
            lse[:, :, r] = torch.logaddexp(lse[:, :, r], sink)
        p = torch.exp(s - lse[:, :, r, None]).nan_to_num_(0.0)
        out[:, :, r] = torch.matmul(p, vd)
        delta = (dod[:, :, r] * out[:, :, r]).sum(-1, keepdim=True)
        ds = p * (torch.matmul(dod[:, :, r], vd.transpose(-1, -2)) - delta)
        if softcap > 0:
            ds *= 1 - tanh**2
        if sink is not None:
            dsinks -= (torch.exp(sink - lse[:, :, r]).nan_to_num_(0.0) * delta[..., 0]).sum((0, 2))
        dq[:, :, r] = torch.matmul(ds, kd) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qd[:, :, r]) * scale
        dv += torch.matmul(p.transpose(-1, -2), dod[:, :, r])
    dk, dv = (t.view(batch, hkv, group, nk, d).sum(2) for t in (dk, dv))
    return (out, lse, dq, dk, dv) + (() if sinks is None else (dsinks,))


def grads_error(got: Grads, ref: Grads) -> float:
    """The largest relative error ‖g − ref‖/‖ref‖ of dq, dk, dv and the sinks' gradient (NaN when
    any was left unwritten)."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if torch.isnan(g).any():
            return float("nan")
        worst = max(worst, float((g.double() - r).norm() / r.norm().clamp_min(1e-300)))
    return worst


def backward_peer(
    make_forward: Callable[[], Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
) -> Callable[[], Grads]:
    """A call that runs only the backward of a peer's forward at (q, k, v) for the output gradient
    `dout`. The forward is made and run on the first call (so unused peers cost nothing), and its
    graph is kept for every later call."""
    graph: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def run() -> Grads:
        if not graph:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                graph.append((make_forward()(*leaves), leaves))
        out, leaves = graph[0]
        dq, dk, dv = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        return dq, dk, dv

    return run


def backward_case(problem: Problem, kernel: Kernel | None, device: torch.device, seed: int) -> Case:
    gen = generator(device, seed)
    dtype = TORCH_DTYPES[problem.dtype]
    b, nq, nk, d = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.head_dim
    hq, hkv = problem.num_heads_q, problem.num_heads_kv
    q, k, v, dout = (
        normal((b, h, n, d), gen, device).to(dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk), (hq, nq))
    )
    scale = d**-0.5
    local = case_features(problem, gen, device)
    sinks, softcap = local["sinks"], local["softcap"]
    if device.type == "meta":  # shapes only: the float64 reference costs seconds of CPU (1.9 s at 16k)
        out, lse, ref = torch.empty_like(q), torch.empty((b, hq, nq), device=device), []
    else:
        out64, lse64, *ref = reference_backward(q, k, v, dout, causal=problem.causal, scale=scale, **local)
        out, lse = out64.to(dtype), lse64.float()
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dsinks = None if sinks is None else torch.full_like(sinks, float("nan"))
    features = {"softcap": softcap, "sinks": sinks, "dsinks": dsinks}

    launch = None
    if kernel is not None and problem.varlen:
        pack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], d)
        packed = [pack(t) for t in (q, k, v, out, dout, *grads)]
        lse_packed = lse.transpose(0, 1).reshape(hq, b * nq)
        cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * nk, nk, dtype=torch.int32, device=device)
        args = BackwardArgs(
            *packed[:5],
            lse_packed,
            None,
            *packed[5:],
            scale,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=nq,
            max_seqlen_k=nk,
            **features,
        )
        launch = lambda: kernel.launch(args)
        grads = tuple(t.view(b, -1, t.shape[1], d).transpose(1, 2) for t in packed[5:])
    elif kernel is not None:
        args = BackwardArgs(q, k, v, out, dout, lse, None, *grads, scale, **features)
        launch = lambda: kernel.launch(args)
    if dsinks is not None:
        grads = (*grads, dsinks)

    peers = {}
    if device.type == "cuda" and not problem.varlen and not problem.model_features:
        from tunegen.kernels import peers as peer_impls

        makers = {
            name: lambda name=name: peer_impls.sdpa(name, problem.causal)
            for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
        }
        if "flex" in peer_impls.available():
            makers["flex"] = lambda: peer_impls.flex(problem.causal, (b, hq, nq, d), device)
        peers = {name: backward_peer(make, q, k, v, dout) for name, make in makers.items()}
    return Case(
        launch=launch,
        error=lambda: grads_error(grads, ref),
        peers=peers,
        peer_error=lambda got: grads_error(got, ref),
    )
