"""Where windowed decode's time goes: the loads' streaming or DRAM itself (issue 32).

Window 4096 over a 32k-token cache, B=8, 32 query / 8 KV heads, D=128, bf16: the shipped kernel
beside a stripped decode loop (the same window, pack_gqa and splits; no merge, no masks) whose K/V
tiles arrive by pointer loads (Triton's cp.async ring) or by TMA descriptor loads at several ring
depths, and copies of the window's bytes and of the same traffic. Each is timed after two kinds of
L2 flush, in rotated rounds (medians of 40 runs a round):
  dirty  do_bench's flush (a 256 MB zero_), which leaves the L2 full of dirty lines that the timed
         kernel's reads must evict, writing them back to DRAM inside its time;
  clean  the same, then a 256 MB read, so that the L2 holds clean lines only.
GB/s are of the window's bytes (the copies': read plus written), against a 2 GiB copy's rate.

    python benchmarks/decode_dram_floor.py -o floor.json

`--ncu-driver` launches the shipped kernel after each flush kind, for Nsight Compute to count
DRAM bytes (`ncu --cache-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,...`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tunegen.kernels import dispatch
from tunegen.kernels.families import get
from tunegen.kernels.gpu import cuda_gpu
from tunegen.measure.bench import credited
from tunegen.measure.suites import decode_suite

B, S, HKV, GROUP, D, WINDOW = 8, 32768, 8, 4, 128, 4096
LOG2E = 1.4426950408889634
# (TMA loads, key tile, ring stages, splits)
LOOPS = (
    (False, 128, 3, 2), (False, 128, 4, 2), (False, 64, 4, 2), (False, 64, 6, 2), (False, 128, 3, 1),
    (True, 128, 2, 2), (True, 128, 3, 2), (True, 128, 4, 2), (True, 64, 4, 2), (True, 64, 6, 2),
    (True, 64, 6, 4), (True, 128, 3, 1),
)  # fmt: skip


@triton.jit
def stripped_decode(
    Q, K, V, K_DESC, V_DESC, Out, seqlen, qk_scale, slots,
    HKV: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """One split of one KV head's window for its GROUP query heads; partial output, unnormalized
    by the other splits, in Out (program, BLOCK_M, D)."""
    pid = tl.program_id(0)
    split = pid % SPLITS
    hkv = (pid // SPLITS) % HKV
    b = pid // (SPLITS * HKV)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    d = tl.arange(0, D)
    q = tl.load(
        Q + ((b * HKV + hkv) * GROUP + rows)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0
    )
    per = WINDOW // SPLITS
    lo = seqlen - WINDOW + split * per
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, lo + per, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        row0 = b.to(tl.int64) * slots + start
        if USE_TMA:
            k = K_DESC.load([(b * slots + start).to(tl.int32), hkv, 0]).reshape(BLOCK_N, D)
        else:
            k = tl.load(K + ((row0 + n) * HKV + hkv)[:, None] * D + d[None, :])
        qk = tl.dot(q, k.T) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = V_DESC.load([(b * slots + start).to(tl.int32), hkv, 0]).reshape(BLOCK_N, D)
        else:
            v = tl.load(V + ((row0 + n) * HKV + hkv)[:, None] * D + d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    tl.store(Out + (pid * BLOCK_M + rows)[:, None] * D + d[None, :], acc / l_i[:, None], mask=row_ok[:, None])


def stripped_loop(
    q, k, v, tma: bool, block_n: int, stages: int, splits: int
) -> tuple[Callable[[], None], float]:
    """A launch of the stripped loop and its error against float32 softmax over each split's keys."""
    o = torch.empty(B * HKV * splits * 16, D, device="cuda")
    descs = [
        TensorDescriptor(t.view(B * S, HKV, D), [B * S, HKV, D], [HKV * D, D, 1], [block_n, 1, D])
        for t in (k, v)
    ]

    def launch():
        stripped_decode[(B * HKV * splits,)](
            q, k, v, *descs, o, S, D**-0.5 * LOG2E, S, HKV=HKV, GROUP=GROUP, SPLITS=splits, WINDOW=WINDOW,
            BLOCK_N=block_n, D=D, BLOCK_M=16, USE_TMA=tma, num_warps=4, num_stages=stages,
        )  # fmt: skip

    o.fill_(float("nan"))
    launch()
    keys = k[:, S - WINDOW :].float().repeat_interleave(GROUP, 2)
    values = v[:, S - WINDOW :].float().repeat_interleave(GROUP, 2)
    scores = torch.einsum("bhd,bnhd->bhn", q[:, 0].float(), keys) * D**-0.5
    got = (
        o.view(B, HKV, splits, 16, D)[:, :, :, :GROUP]
        .permute(0, 2, 1, 3, 4)
        .reshape(B, splits, HKV * GROUP, D)
    )
    per, err = WINDOW // splits, 0.0
    for s in range(splits):
        keys_of = slice(s * per, (s + 1) * per)
        ref = torch.einsum("bhn,bnhd->bhd", torch.softmax(scores[:, :, keys_of], -1), values[:, keys_of])
        err = max(err, float((got[:, s] - ref).norm() / ref.norm()))
    return launch, err


def flushes() -> dict[str, Callable[[], None]]:
    dirty = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    clean = torch.randn(64 << 20, device="cuda")
    return {"dirty": dirty.zero_, "clean": lambda: (dirty.zero_(), clean.sum())}


def event_us(fn: Callable[[], object], flush: Callable[[], object], reps: int = 40) -> float:
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", help="JSON file for every row")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--ncu-driver", action="store_true", help="launch the shipped kernel after each flush"
    )
    args = parser.parse_args()
    gpu = cuda_gpu(0)
    fam = get("decode")
    problem = decode_suite((B,), (S,), HKV * GROUP, HKV, D, (0,), window_size=(WINDOW - 1, 0))[0]
    kernel = dispatch.kernel_for(problem, gpu)
    case = fam.case(problem, kernel, torch.device("cuda"), 0)
    case.launch()
    flush = flushes()
    if args.ncu_driver:
        for kind in ("dirty", "clean", "dirty", "clean"):
            flush[kind]()
            case.launch()
        torch.cuda.synchronize()
        return
    print(f"shipped {kernel.variant.to_json()}: error {case.error():.1e}", flush=True)
    nbytes = int(credited(fam, problem, "tunegen"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, 1, HKV * GROUP, D, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    calls: dict[str, Callable[[], object]] = {"shipped": case.launch}
    for tma, block_n, stages, splits in LOOPS:
        name = f"{'tma' if tma else 'pointer'} loop, tile {block_n}, {stages} stages, {splits} splits"
        launch, err = stripped_loop(q, k, v, tma, block_n, stages, splits)
        print(f"{name}: error {err:.1e}", flush=True)
        if err < 2e-2:
            calls[name] = launch
    src, half = torch.randn(nbytes // 4, device="cuda"), torch.randn(nbytes // 8, device="cuda")
    dst, half_dst = torch.empty_like(src), torch.empty_like(half)
    calls["copy of the window's bytes"] = lambda: dst.copy_(src)
    calls["copy of the same traffic"] = lambda: half_dst.copy_(half)
    traffic = {"copy of the window's bytes": 2 * nbytes}
    names = list(calls)
    times: dict[tuple[str, str], list[float]] = {(n, f): [] for n in names for f in flush}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            for kind, fl in flush.items():
                times[(name, kind)].append(event_us(calls[name], fl))
    big = torch.randn(1 << 29, device="cuda")
    big_dst = torch.empty_like(big)
    big_us = statistics.median(event_us(lambda: big_dst.copy_(big), flush["dirty"], 10) for _ in range(3))
    ceiling = 2 * big.numel() * 4 / big_us / 1e3
    rows = []
    print(f"2 GiB copy: {ceiling:.0f} GB/s (read + write)")
    print(f"{'case':48s} {'dirty us':>9s} {'/copy':>6s} {'clean us':>9s} {'/copy':>6s}")
    for name in names:
        row, line = {"case": name}, f"{name:48s}"
        for kind in flush:
            us = statistics.median(times[(name, kind)])
            gbps = traffic.get(name, nbytes) / us / 1e3
            rounds = times[(name, kind)]
            row[kind] = {"us": us, "gbps": gbps, "of_2gib_copy": gbps / ceiling, "rounds_us": rounds}
            line += f" {us:9.1f} {gbps / ceiling:6.3f}"
        rows.append(row)
        print(line)
    if args.output:
        record = {
            "gpu": gpu.name, "triton": triton.__version__, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "shipped": kernel.variant.to_json(),
            "window_bytes": nbytes, "copy_2gib_gbps": ceiling, "rows": rows,
        }  # fmt: skip
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
