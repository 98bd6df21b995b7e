"""The cost of reaching tunegen through PyTorch's flash-attention registry and FlashAttention's
functions (issue 35's target: within 3% of calling `tunegen.attention` directly), with cuDNN's
SDPA beside them as the peer the registry displaces on Hopper.

Per shape, forward and forward + backward, in interleaved rounds (tunegen.tuning.timing.interleaved_ms):
- tunegen: `tunegen.attention` on (batch, heads, seqlen, head_dim);
- sdpa-flash: `scaled_dot_product_attention` on the same tensors with tunegen activated as the
  flash provider (SDPA's flash backend pinned around the timing, as for any SDPA peer);
- flash_attn: `tunegen.flash_attn.flash_attn_func` on (batch, seqlen, heads, head_dim);
- sdpa-cudnn: SDPA's cuDNN backend (untouched by the provider).
Each path is checked against `tunegen.attention` first, and the provider's counters must show
it served the SDPA calls.

    python benchmarks/flash_provider.py [-o results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
import triton

import tunegen
import tunegen.flash_attn as fa2
from tunegen.kernels import peers
from tunegen.tuning.timing import interleaved_ms

# (batch, query heads, kv heads, seqlen, head_dim, causal): 16k tokens per batch, Llama-3 8B's heads.
SHAPES = [(16, 32, 8, 1024, 128, True), (4, 32, 8, 4096, 128, True), (1, 32, 8, 16384, 128, False)]
TARGET = 1.03


def _calls(shape, backward: bool) -> dict[str, object]:
    batch, hq, hkv, n, d, causal = shape

    def randn(h: int) -> torch.Tensor:
        return torch.randn(batch, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)

    q, k, v = randn(hq), randn(hkv), randn(hkv)
    qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_(backward) for t in (q, k, v))
    dout = torch.randn_like(q)
    forward = {
        "tunegen": lambda: tunegen.attention(q, k, v, causal=causal),
        "sdpa-flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
        "flash_attn": lambda: fa2.flash_attn_func(qb, kb, vb, causal=causal),
        "sdpa-cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
    }
    if not backward:
        return forward
    grads = {name: dout.transpose(1, 2) if name == "flash_attn" else dout for name in forward}
    return {name: (lambda f=f, g=grads[name]: f().backward(g)) for name, f in forward.items()}


def _check(shape) -> None:
    """Every path computes what tunegen.attention does, and SDPA's flash path ran tunegen."""
    calls = _calls(shape, backward=False)
    ref = calls["tunegen"]().float()
    before = tunegen.explain()["served"].get("_scaled_dot_product_flash_attention", 0)
    for name, call in calls.items():
        with peers.pinned(name):
            out = call().float()
        out = out.transpose(1, 2) if name == "flash_attn" else out
        err = float((out - ref).norm() / ref.norm())
        if not err < 2e-2:
            raise AssertionError(f"{name} on {shape}: relative error {err:.3g} against tunegen.attention")
    served = tunegen.explain()["served"].get("_scaled_dot_product_flash_attention", 0)
    if served != before + 1:
        raise AssertionError("SDPA's flash backend did not run tunegen")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-o", "--output", help="JSON file for the results")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.nn.attention.activate_flash_attention_impl("tunegen")
    rows = []
    try:
        for shape in SHAPES:
            _check(shape)
            batch, hq, _, n, d, causal = shape
            flops = 4 * batch * hq * n * n * d * (0.5 if causal else 1.0)
            for backward in (False, True):
                times = interleaved_ms(_calls(shape, backward), rounds=args.rounds)
                work = flops * (3.5 if backward else 1.0)
                rows.append(
                    {
                        "shape": shape,
                        "pass": "fwd+bwd" if backward else "fwd",
                        "ms": times,
                        "tflops": {name: work / ms / 1e9 for name, ms in times.items()},
                        "vs_tunegen": {name: ms / times["tunegen"] for name, ms in times.items()},
                    }
                )
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "target": f"sdpa-flash and flash_attn within {TARGET:.2f}x of tunegen",
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date']}")
    others = ("sdpa-flash", "flash_attn", "sdpa-cudnn")
    print("| shape (B, Hq, Hkv, N, D, causal) | pass | tunegen TFLOP/s | " + " | ".join(others) + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        t, r = row["tflops"], row["vs_tunegen"]
        cells = [f"{t[name]:.0f} ({r[name]:.3f}x time)" for name in others]
        print(f"| {row['shape']} | {row['pass']} | {t['tunegen']:.0f} | " + " | ".join(cells) + " |")
    worst = max(max(row["vs_tunegen"]["sdpa-flash"], row["vs_tunegen"]["flash_attn"]) for row in rows)
    print(f"worst time ratio to tunegen.attention: {worst:.3f} (target <= {TARGET})")


if __name__ == "__main__":
    main()
