"""Pick the default prefill Variants for this GPU class: verify and time hand-chosen Variants of
either schedule per (head dim, causal) on the bf16 suite, beside cuDNN and FlashAttention-2 (SDPA's
backends) in the same run.

Compiles every Variant in parallel worker processes first, each checked there against float64 at a
ragged size (GQA, lengths no tile divides, outputs poisoned); Triton's cache is shared on disk, so
the timing process reuses those builds. Then, on the GPU, each Variant is checked again on sampled
rows of each suite shape, and the shape's Variants and peers that passed are timed together in
interleaved rounds (sweep.py). A kernel that hangs in its check stops the run after `--hang-s` seconds
with what was measured so far written out.

    python benchmarks/prefill_defaults.py --seqlens 1024,4096,16384 --schedules ws -o ws.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import faulthandler
import functools
import json
import multiprocessing as mp
import sys

import torch
from prefill_candidates import candidates
from sweep import time_in_rounds

from tunegen.kernels import peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.reference import TOLERANCE, attention_reference, sampled_error
from tunegen.measure.suites import Shape, prefill_suite

PEERS = ("sdpa-cudnn", "sdpa-flash")


def _sized(shape: Shape, seqlen: int) -> Shape:
    """The suite's shape at another length: 16k tokens per batch."""
    return Shape(max(1, 16384 // seqlen), shape.heads, shape.kv_heads, seqlen, shape.head_dim, shape.causal)


def _inputs(shape: Shape, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(shape.batch, h, shape.seqlen, shape.head_dim, generator=gen).cuda().bfloat16()
    return mk(shape.heads), mk(shape.kv_heads), mk(shape.kv_heads), gen


def _compile_and_check(args: tuple[Shape, str]) -> str | None:
    """Build the Variant for the shape's Problem, then check it against float64 at a ragged size
    with the same features; None when right, else why not."""
    shape, variant_json = args
    variant = prefill.PrefillVariant.from_json(variant_json)
    try:
        gpu = cuda_gpu(0)
        kernel = base.build(prefill.FAMILY, variant, shape.problem("bfloat16"), gpu)
        gen = torch.Generator().manual_seed(1)
        mk = lambda h, n: torch.randn(2, h, n, shape.head_dim, generator=gen).cuda().bfloat16()
        group = shape.heads // shape.kv_heads
        q, k, v = mk(2 * group, 333), mk(2, 333), mk(2, 333)
        out = torch.full_like(q, float("nan"))
        kernel.launch(PrefillArgs(q, k, v, out, None, 0.3))
        ref, _ = attention_reference(q, k, v, causal=shape.causal, scale=0.3)
        err = float((out.double() - ref).norm() / ref.norm()) if not out.isnan().any() else float("nan")
        return (
            None if err < TOLERANCE["bfloat16"] else f"wrong at 2x{2 * group}x333: relative error {err:.2e}"
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def check_in_workers(check, jobs: list, workers: int, hang_s: float) -> list[str | None]:
    """`check(job)` for every job in fresh spawned processes (none of them ever interpreted a
    kernel), in order; a job that outlasts 3 x `hang_s` counts as hung, and the pool's processes
    are killed at the end so that a hung kernel cannot hold the run."""
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(check, job) for job in jobs]
        checked = []
        for future in futures:
            try:
                checked.append(future.result(timeout=hang_s * 3))
            except cf.TimeoutError:
                checked.append("hung in the build-and-check worker")
        for process in list(pool._processes.values()):
            process.kill()
    return checked


def checked_launch(kernel, rec: dict, shape: Shape, tensors: tuple, timed: list) -> None:
    """Launch `kernel` once into a poisoned output and check sampled rows against float64: its
    error into `rec`, and (rec, launch) onto `timed` if right, else why not into rec["note"]."""
    q, k, v, out, gen = tensors
    scale = shape.head_dim**-0.5
    out.fill_(float("nan"))
    launch = functools.partial(kernel.launch, PrefillArgs(q, k, v, out, None, scale))
    launch()
    rec["err"] = sampled_error(out, q, k, v, causal=shape.causal, scale=scale, generator=gen)
    if rec["err"] < TOLERANCE["bfloat16"]:
        timed.append((rec, launch))
    else:
        rec["note"] = f"wrong: relative error {rec['err']:.2e}"


def _label(v: dict) -> str:
    if v["schedule"] == "ws":
        pp = "pp" if v["pingpong"] else ""
        ov = " ov" if v["overlap"] else ""
        x2 = "x2" if v.get("ctas_per_sm", 1) == 2 else ""
        text = f"ws {v['block_m']}x{v['block_n']} c{v['consumers']}{x2}{pp}{ov} s{v['num_stages']}"
        text += (" dynamic" if v.get("dynamic") else " persistent") if v["persistent"] else ""
        text += {"slot": "", "q_slot": " o-q", "registers": " o-regs"}[v.get("o_store", "slot")]
        text += " q2" if v.get("q_stages", 1) == 2 else ""
        text += " branch" if v.get("mask_branch") else ""
    else:
        text = f"fa2 {v['load']} {v['block_m']}x{v['block_n']} w{v['num_warps']} s{v['num_stages']}"
    order = {"m_inner": "", "head_inner": " heads", "grouped": " grouped"}[v["order"]]
    return text + order + (" rev" if v["reverse_m"] else "")


def _check_peers(shape: Shape, q, k, v, gen, results: list[dict]) -> list[tuple[dict, functools.partial]]:
    """Each peer's record (in `results`) and call, for those that run the shape and are right."""
    timed = []
    for name in PEERS:
        rec = {"shape": shape.__dict__, "impl": name, "ms": None, "tflops": None}
        results.append(rec)
        fn = functools.partial(peers.sdpa(name, shape.causal), q, k, v)
        try:
            out = fn()
            err = sampled_error(out, q, k, v, causal=shape.causal, scale=shape.head_dim**-0.5, generator=gen)
        except RuntimeError:
            continue
        if err < TOLERANCE["bfloat16"]:
            timed.append((rec, fn))
    return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ap.add_argument("--schedules", default="fa2", help="fa2, ws, or fa2,ws")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--hang-s", type=float, default=120.0, help="give up on a kernel that runs this long")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    seqlens = [int(x) for x in args.seqlens.split(",")]
    dims = [int(x) for x in args.head_dims.split(",")]
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    schedules = args.schedules.split(",")
    gpu = cuda_gpu(0)
    provenance = {
        "gpu": gpu.name,
        "triton": gpu.triton_version,
        "torch": gpu.torch_version,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    groups = prefill_suite(seqlens[:1], dims, causal)
    jobs = []
    for shape in groups:
        problem = shape.problem("bfloat16")
        # Each length's default, and FlashAttention-2's loop as the family would run it there.
        sized = [_sized(shape, n).problem("bfloat16") for n in seqlens]
        defaults = [prefill.FAMILY.default_variant(p, gpu) for p in sized]
        defaults += [prefill.fa2_default(p, gpu) for p in sized]
        for v in dict.fromkeys(defaults + candidates(shape.head_dim, shape.causal, schedules)):
            if prefill.FAMILY.constraint(v, problem, gpu) is None:
                jobs.append((shape, v.to_json()))
    print(f"{len(jobs)} kernels to build and check", flush=True)
    checked = check_in_workers(_compile_and_check, jobs, args.workers, args.hang_s)
    results: list[dict] = []

    def write() -> None:
        if args.output:
            with open(args.output, "w") as fh:
                json.dump({**provenance, "results": results}, fh, indent=1)

    for (shape0, vj), note in zip(jobs, checked, strict=True):
        if note:
            results.append({"shape": shape0.__dict__, "variant": json.loads(vj), "ms": None, "note": note})
            print("FAILED", _label(json.loads(vj)), shape0.head_dim, shape0.causal, note, flush=True)
    for shape0 in groups:
        for n in seqlens:
            shape = _sized(shape0, n)
            problem = shape.problem("bfloat16")
            flops = shape.flops()
            q, k, v, gen = _inputs(shape)
            out = torch.empty_like(q)
            timed = _check_peers(shape, q, k, v, gen, results)
            for (s0, vj), note in zip(jobs, checked, strict=True):
                if s0 != shape0 or note:
                    continue
                variant = prefill.PrefillVariant.from_json(vj)
                rec = {
                    "shape": shape.__dict__,
                    "variant": variant.as_dict(),
                    "ms": None,
                    "tflops": None,
                    "note": "",
                }
                faulthandler.dump_traceback_later(args.hang_s, exit=True)
                try:
                    kernel = base.build(prefill.FAMILY, variant, problem, gpu)
                    checked_launch(kernel, rec, shape, (q, k, v, out, gen), timed)
                except Exception as exc:
                    rec["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                faulthandler.cancel_dump_traceback_later()
                results.append(rec)
            time_in_rounds(timed)
            for rec, _ in timed:
                rec["tflops"] = flops / rec["ms"] / 1e9
            write()
            del q, k, v, out, timed
            torch.cuda.empty_cache()
    write()
    _print_table(results, groups, seqlens)


def _print_table(results: list[dict], groups: list[Shape], seqlens: list[int]) -> None:
    """Per (head dim, causal) and length: cuDNN, FA2, the default, the best of each schedule."""
    for shape0 in groups:
        print(f"\nD={shape0.head_dim} causal={shape0.causal} (TFLOP/s; ratio to cuDNN)")
        for n in seqlens:
            rows = [
                r
                for r in results
                if r["shape"]["head_dim"] == shape0.head_dim
                and r["shape"]["causal"] == shape0.causal
                and r["shape"]["seqlen"] == n
                and r.get("tflops")
            ]
            cudnn = next((r["tflops"] for r in rows if r.get("impl") == "sdpa-cudnn"), None)
            flash = next((r["tflops"] for r in rows if r.get("impl") == "sdpa-flash"), None)
            line = f"  N={n:5d} cudnn {cudnn or 0:4.0f} flash {flash or 0:4.0f}"
            for schedule in ("fa2", "ws"):
                mine = sorted(
                    (r for r in rows if r.get("variant", {}).get("schedule") == schedule),
                    key=lambda r: -r["tflops"],
                )
                if mine:
                    ratio = mine[0]["tflops"] / cudnn if cudnn else float("nan")
                    line += (
                        f" | {schedule} {mine[0]['tflops']:4.0f} ({ratio:.2f}) {_label(mine[0]['variant'])}"
                    )
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
