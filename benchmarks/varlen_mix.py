"""Packed variable-length prefill (`tunegen.attention_varlen`) on mixes of prompt lengths, beside
PyTorch's own varlen attention, and an equal-length batch as varlen beside the same batch dense.

A server's prefill packs prompts of many lengths into one call: the tile grid is ragged (short
sequences leave part-filled tiles, a causal mask makes each one's tiles uneven), which the dense
suite never shows. Rows (bf16, 32 query heads over 8 KV heads, self-attention prompts): "mix16", 16
lengths uniform in [200, 4000]; "mix64", 64 in [64, 1024] (seed 0: the same every run); "equal",
8 x 2048, also timed dense (batch 8): varlen / dense is what packing costs.

Per row: tunegen's default Variant for the row's varlen Problem and FlashAttention-2's loop
(`prefill.fa2_default`), launched directly; the Variants in `--variants FILE.json` (a JSON list of
PrefillVariant fields), each first checked in a worker process (one that fails gets a note); the
public call, dispatch included; `torch.nn.attention.varlen.varlen_attn` where torch has it; on
"equal" the dense default and cuDNN (SDPA). Each is checked once, into a NaN-poisoned output where
it takes one, against float64 on every sequence (whole up to 1024 tokens, else 128 sampled rows);
those right are timed together in interleaved rounds (sweep.py).

    python benchmarks/varlen_mix.py --rows mix16,mix64,equal --non-causal --variants ws.json -o varlen.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import inspect
import itertools
import json
import pathlib
import sys
from collections.abc import Callable

import torch
import triton
from prefill_defaults import check_in_workers
from sweep import ROUNDS, time_in_rounds

import tunegen
from tunegen.checks import is_aligned16
from tunegen.kernels import peers
from tunegen.kernels.families import base, prefill
from tunegen.kernels.gpu import Gpu, gpu_of
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import TOLERANCE, attention_reference, sampled_error

ROWS = {"mix16": (16, 200, 4000), "mix64": (64, 64, 1024), "equal": (8, 2048, 2048)}  # count, lo, hi
HEADS = (32, 8)
DEVICE = "cuda"
FULL_CHECK = 1024  # sequences up to this many tokens are checked whole, longer ones on sampled rows
HANG_S = 120.0
PRECHECK_LENGTHS = [333, 77, 1000, 1]  # --variants' Variants first run these, in worker processes


def lengths_of(row: str) -> list[int]:
    """The row's sequence lengths: uniform in [lo, hi], seed 0, the same every run."""
    count, lo, hi = ROWS[row]
    return torch.randint(lo, hi + 1, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def packed_inputs(lengths: list[int], head_dim: int) -> tuple[tuple, list[int], torch.Tensor]:
    """Packed bf16 q, k, v (total, heads, head_dim) of sequences of `lengths` (seed 0), the offsets
    of the sequences, and those as int32 on the device."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    gen = torch.Generator(DEVICE).manual_seed(0)
    qkv = tuple(
        torch.randn(bounds[-1], h, head_dim, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        for h in (*HEADS, HEADS[1])
    )
    return qkv, bounds, torch.tensor(bounds, dtype=torch.int32, device=DEVICE)


def problem_of(lengths: list[int], head_dim: int, causal: bool, varlen: bool, aligned: bool) -> Problem:
    """The Problem the public call dispatches the packed (or dense) batch under."""
    n = max(lengths)
    heads = {"num_heads_q": HEADS[0], "num_heads_kv": HEADS[1]}
    features = {"dtype": "bfloat16", "head_dim": head_dim, "causal": causal, "aligned": aligned, **heads}
    return Problem.of(family="prefill", batch=len(lengths), seqlen_q=n, seqlen_k=n, varlen=varlen, **features)


def flops_of(problem: Problem, lengths: list[int]) -> float:
    """Sum over sequences of `Problem.flops` at its exact length (4·Hq·n·n·D, halved for causal)."""
    return sum(problem.flops(seqlen_q=n, seqlen_k=n, batch=1) for n in lengths)


def error_of(out: torch.Tensor, qkv: tuple, bounds: list[int], causal: bool, scale: float) -> float:
    """The worst relative error against float64 over the sequences of a packed (total, H, D) output
    (NaN if any element is NaN): whole up to FULL_CHECK tokens, else on 128 sampled rows."""
    if out.isnan().any():
        return float("nan")
    gen, worst = torch.Generator().manual_seed(1), 0.0
    for a, b in itertools.pairwise(bounds):
        o, q, k, v = (t[a:b].transpose(0, 1)[None] for t in (out, *qkv))
        if b - a <= FULL_CHECK:
            ref, _ = attention_reference(q, k, v, causal=causal, scale=scale)
            err = float((o.double() - ref).norm() / ref.norm())
        else:
            err = sampled_error(o, q, k, v, causal=causal, scale=scale, rows=128, generator=gen)
        worst = max(worst, err)
    return worst


def check(rec: dict, run: Callable[[], torch.Tensor], packed: Callable, ctx: dict, timed: list) -> None:
    """Call `run` once (its output put in packed layout by `packed`) and check it: the error into
    `rec`, and (rec, run) onto `timed` if right, else why not into rec["note"]."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        with peers.quiet() as caught:
            out = packed(run())
            ctx["keep"].append(out)
            rec["err"] = error_of(out, ctx["qkv"], ctx["bounds"], ctx["causal"], ctx["scale"])
    except Exception as exc:
        rec["note"] = f"{type(exc).__name__}: {peers.refusal(exc, caught)}"
    finally:
        faulthandler.cancel_dump_traceback_later()
    if rec.get("err") is not None and rec["err"] < TOLERANCE["bfloat16"]:
        timed.append((rec, run))
    elif not rec.get("note"):
        rec["note"] = f"wrong: relative error {rec['err']:.2e}"
    err = float("nan") if rec.get("err") is None else rec["err"]
    print(f"  {rec['impl']:46s} err {err:.1e} {rec.get('note', '')}", flush=True)


def kernel_call(variant: prefill.PrefillVariant, problem: Problem, gpu: Gpu, args: PrefillArgs) -> Callable:
    """The built Variant's launch into `args.out`, returning it (raises where it does not build)."""
    kernel = base.build(prefill.FAMILY, variant, problem, gpu)
    return lambda: (kernel.launch(args), args.out)[1]


def precheck(job: tuple[str, int, bool]) -> str | None:
    """Build a Variant (JSON) for ragged PRECHECK_LENGTHS and check it, in a worker process where a
    kernel that faults or hangs cannot take the timing process with it; None when right."""
    variant_json, head_dim, causal = job
    try:
        qkv, bounds, cu = packed_inputs(PRECHECK_LENGTHS, head_dim)
        out, scale = torch.full_like(qkv[0], float("nan")), head_dim**-0.5
        problem = problem_of(PRECHECK_LENGTHS, head_dim, causal, True, is_aligned16(*qkv, out))
        n = max(PRECHECK_LENGTHS)
        args = PrefillArgs(*qkv, out, None, scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n)
        run = kernel_call(prefill.PrefillVariant.from_json(variant_json), problem, gpu_of(out.device), args)
        err = error_of(run(), qkv, bounds, causal, scale)
        return None if err < TOLERANCE["bfloat16"] else f"wrong at {PRECHECK_LENGTHS}: error {err:.2e}"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def torch_varlen(qkv: tuple, cu: torch.Tensor, n: int, causal: bool, scale: float) -> tuple[str, Callable]:
    """PyTorch's varlen attention (`varlen_attn`: `is_causal` up to torch 2.10, a window (-1, 0)
    after, `enable_gqa` from 2.12) under its label, K/V heads expanded here where it takes no GQA;
    raises ImportError where this torch has none."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = qkv
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        kw["window_size"] = (-1, 0)
    label = "torch varlen_attn"
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        label += " (K/V expanded)"
    return label, lambda: varlen_attn(q, k, v, cu, cu, n, n, **kw)


def variants_for(problem: Problem, gpu: Gpu, extra: list) -> list[tuple[str, object]]:
    """(label, Variant or why none) per tunegen kernel launched directly: the default, FA2's loop
    (both always, a stable table even where they are one Variant), each of `extra` (field dicts)."""
    out: list[tuple[str, object]] = [("tunegen default", prefill.FAMILY.default_variant(problem, gpu))]
    out.append(("fa2 default", prefill.fa2_default(problem, gpu)))
    for i, fields in enumerate(extra):
        try:
            out.append((f"variant {i}", prefill.PrefillVariant.from_json(fields)))
        except (TypeError, ValueError) as exc:
            out.append((f"variant {i}", f"not a PrefillVariant: {exc}"))
    return out


def run_row(row: str, causal: bool, opts: argparse.Namespace, pre: dict, results: list) -> None:
    """Check and time every implementation of one row, appending their records to `results`;
    `pre` holds why each of `opts.extra` failed its precheck (by its JSON and the mask)."""
    head_dim, lengths = opts.head_dim, lengths_of(row)
    print(f"\n{row} causal={causal} lengths {lengths}", flush=True)
    qkv, bounds, cu = packed_inputs(lengths, head_dim)
    n, total, scale = max(lengths), bounds[-1], head_dim**-0.5
    out = torch.empty_like(qkv[0])
    problem = problem_of(lengths, head_dim, causal, True, is_aligned16(*qkv, out))
    gpu, flops = gpu_of(out.device), flops_of(problem, lengths)
    ctx = {"qkv": qkv, "bounds": bounds, "causal": causal, "scale": scale, "keep": []}
    base_rec = {"row": row, "causal": causal, "head_dim": head_dim, "ms": None, "tflops": None, "err": None}
    timed: list = []
    same = lambda t: t

    def add(impl: str, run: Callable | None, packed: Callable = same, note: str = "", **more: object) -> None:
        results.append({**base_rec, "impl": impl, "note": note, **more})
        if run is not None:
            check(results[-1], run, packed, ctx, timed)
        else:
            print(f"  {impl:46s} not run: {note}", flush=True)

    def add_kernel(label: str, variant: object, p: Problem, a: PrefillArgs, pack: Callable = same) -> None:
        if not isinstance(variant, prefill.PrefillVariant):  # a note: the fields made no Variant
            return add(label, None, note=str(variant))
        print(f"  {label}: {variant.to_json()}", flush=True)
        note, run = pre.get((variant.to_json(), causal)), None
        try:
            run = None if note else kernel_call(variant, p, gpu, a)
        except Exception as exc:
            note = f"build: {exc}"[:400]
        a.out.fill_(float("nan"))
        add(label, run, pack, note=note or "", variant=variant.as_dict())

    args = PrefillArgs(*qkv, out, None, scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n)
    for label, variant in variants_for(problem, gpu, opts.extra):
        add_kernel(label, variant, problem, args)
    add("tunegen (public)", lambda: tunegen.attention_varlen(*qkv, cu, cu, n, n, causal=causal))
    try:
        add(*torch_varlen(qkv, cu, n, causal, scale))
    except ImportError as exc:
        add("torch varlen_attn", None, note=f"not in torch {torch.__version__}: {exc}")
    if row == "equal":  # the same values as a dense (batch, heads, seqlen, head_dim) batch
        dense = tuple(t.view(len(lengths), n, -1, head_dim).transpose(1, 2).contiguous() for t in qkv)
        unpack = lambda o: o.transpose(1, 2).reshape(total, -1, head_dim)
        dense_args = PrefillArgs(*dense, torch.empty_like(dense[0]), None, scale)
        dense_problem = problem_of(lengths, head_dim, causal, False, is_aligned16(*dense, dense_args.out))
        default = prefill.FAMILY.default_variant(dense_problem, gpu)
        add_kernel("tunegen default (dense)", default, dense_problem, dense_args, unpack)
        for i, fields in enumerate(opts.dense_extra):  # what the dense call gains from each knob
            add_kernel(
                f"dense variant {i}",
                prefill.PrefillVariant.from_json(fields),
                dense_problem,
                dense_args,
                unpack,
            )
        cudnn = peers.sdpa("sdpa-cudnn", causal)
        add("sdpa-cudnn", lambda: cudnn(*dense), unpack)
    ctx["keep"].clear()  # the outputs checked, each kept apart until now (no stale right answers)
    if timed:
        time_in_rounds(timed, opts.rounds)
    for rec, _ in timed:
        rec["tflops"] = flops / rec["ms"] / 1e9
    torch.cuda.empty_cache()  # a no-op where CUDA never started


def print_table(results: list[dict], rows: list[tuple[str, bool]]) -> None:
    """TFLOP/s per implementation (lines) and row (columns), then on "equal" varlen / dense."""
    cols = [f"{row} {'causal' if c else 'full'}" for row, c in rows]
    print(f"\n{'TFLOP/s (median)':46s}" + "".join(f"{c:>15s}" for c in cols))
    for impl in dict.fromkeys(r["impl"] for r in results):
        line = f"{impl[:46]:46s}"
        for row, c in rows:
            rec = next((r for r in results if (r["impl"], r["row"], r["causal"]) == (impl, row, c)), None)
            cell = "-" if rec is None else "x" if rec["tflops"] is None else f"{rec['tflops']:.0f}"
            line += f"{cell:>15s}"
        print(line)
    for row, c in rows:
        got = {r["impl"]: r["tflops"] for r in results if (r["row"], r["causal"]) == (row, c) and r["tflops"]}
        dense = got.pop("tunegen default (dense)", None) if row == "equal" else None
        got.pop("sdpa-cudnn", None)
        for impl, t in got.items() if dense else ():
            print(f"{row} {'causal' if c else 'full'}: {impl} / tunegen default (dense) = {t / dense:.3f}")
    print("(x: not timed, see its note; -: not run in that row)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="mix16,mix64,equal", help=f"some of {','.join(ROWS)}")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--non-causal", action="store_true", help="also the rows without a causal mask")
    ap.add_argument("--variants", default=None, help="JSON file: a list of dicts of PrefillVariant fields")
    ap.add_argument("--dense-variants", default=None, help="JSON file: Variants also timed dense on 'equal'")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    names = args.rows.split(",")
    if set(names) - set(ROWS):
        ap.error(f"--rows: unknown {sorted(set(names) - set(ROWS))}; expected some of {list(ROWS)}")
    args.extra = json.loads(pathlib.Path(args.variants).read_text()) if args.variants else []
    args.dense_extra = (
        json.loads(pathlib.Path(args.dense_variants).read_text()) if args.dense_variants else []
    )
    rows = [(row, c) for c in ((True, False) if args.non_causal else (True,)) for row in names]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else DEVICE, "measured_at": now}
    meta |= {"torch": torch.__version__, "triton": triton.__version__, "argv": sys.argv[1:], "heads": HEADS}
    meta["lengths"] = {row: lengths_of(row) for row in names}
    jobs = []
    for fields, causal in itertools.product(args.extra, sorted({c for _, c in rows})):
        with contextlib.suppress(TypeError, ValueError):  # those that make no Variant: variants_for
            jobs.append((prefill.PrefillVariant.from_json(fields).to_json(), args.head_dim, causal))
    notes = check_in_workers(precheck, jobs, min(len(jobs), 8), HANG_S) if jobs else []
    pre = {(vj, causal): note for (vj, _, causal), note in zip(jobs, notes, strict=True) if note}
    results: list[dict] = []
    for row, causal in rows:
        run_row(row, causal, args, pre, results)
        if args.output:  # after every row: a hang or a crash later keeps what was measured
            with open(args.output, "w") as fh:
                json.dump({**meta, "results": results}, fh, indent=1)
    print_table(results, rows)


if __name__ == "__main__":
    sys.exit(main())
