"""How a long run of one causal prefill call settles under the board's power limit: TFLOP/s in windows of
back-to-back calls beside the SM clock, board power and temperature nvidia-smi reports, for
tunegen's default and cuDNN, each after some idle seconds.

A benchmark's figure depends on where in this curve it times: a short burst runs at the full
clock, a long one where the power limit holds it (benchmarks/results/issue31_power_s6_h100.txt).

    python3 power_sustained.py [--head-dim 128 --heads 16 --seqlen 16384 --seconds 4 --idle 3]
                               [--also '{"pingpong": true}']

`--also` adds tunegen's default with those knobs changed, launched directly, as another call.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tunegen
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import gpu_of

QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"]
MARKS = (0.05, 0.3, 1.0, 2.0, 3.9)


def _poll(stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        reply = subprocess.run(QUERY, capture_output=True, text=True, check=False).stdout.strip()
        samples.append((time.perf_counter(), reply))
        time.sleep(0.05)


def _curve(call, flops: float, seconds: float, calls_per_window: int) -> tuple[list, list]:
    """(time, TFLOP/s) per window and (time, nvidia-smi reply) samples over `seconds` of calls."""
    stop, samples, windows = threading.Event(), [], []
    poller = threading.Thread(target=_poll, args=(stop, samples))
    poller.start()
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_window):
            call()
        end.record()
        end.synchronize()
        rate = flops * calls_per_window / (start.elapsed_time(end) * 1e-3) / 1e12
        windows.append((time.perf_counter() - t_start, rate))
    stop.set()
    poller.join()
    return windows, [(t - t_start, reply) for t, reply in samples]


def _held(windows: list, samples: list, after_s: float = 1.0) -> str:
    """The mean rate, clock and power past `after_s` (the held part of the curve), and their ratio."""
    rates = [rate for t, rate in windows if t >= after_s]
    replies = [
        [float(x) for x in reply.split(",")] for t, reply in samples if t >= after_s and reply.count(",") == 2
    ]
    if not rates or not replies:
        return ""
    rate, clock, watts = sum(rates) / len(rates), *(sum(r[i] for r in replies) / len(replies) for i in (0, 1))
    return f" || held {rate:.0f}TF {clock:.0f}MHz {watts:.0f}W {rate / watts:.3f}TF/W"


def _changed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, changes: dict):
    """A call of the default Variant with `changes`, built and launched as the dispatcher would."""
    call = PrefillCall(q, k, v, True, q.shape[-1] ** -0.5, return_lse=False)
    out = torch.empty_like(q)
    family, problem = get("prefill"), call.problem(out)
    variant = family.default_variant(problem, gpu_of(q.device)).replace(**changes)
    kernel = base.build(family, variant, problem, gpu_of(q.device))
    return lambda: kernel.launch(call.args(out, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--also", action="append", default=[], metavar="JSON", help="knobs changed from the default"
    )
    args = ap.parse_args()
    n, d, h = args.seqlen, args.head_dim, args.heads
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * h * n * n * d / 2

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    calls = {"tunegen": lambda: tunegen.attention(q, k, v, causal=True), "cudnn": cudnn}
    for number, changes in enumerate(args.also, 1):
        calls[f"also{number}"] = _changed(q, k, v, json.loads(changes))
        print(f"also{number}: {changes}")
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    for repeat in range(args.repeats):
        for name, call in calls.items():
            time.sleep(args.idle)
            windows, samples = _curve(call, flops, args.seconds, calls_per_window=25)
            cells = []
            for mark in MARKS:
                rate = min(windows, key=lambda w, m=mark: abs(w[0] - m))[1]
                reply = min(samples, key=lambda s, m=mark: abs(s[0] - m))[1] if samples else "-"
                cells.append(f"t={mark:.2f}s {rate:.0f}TF [{reply}]")
            print(f"{repeat} {name:8s} " + " | ".join(cells) + _held(windows, samples), flush=True)


if __name__ == "__main__":
    main()
