"""Issue 32's targets, measured in one GPU run: tunegen with the attention of current models against
FlexAttention (its block mask, score_mod and sinks through its log-sum-exp: tunegen.kernels.peers),
each beside tunegen on the same inputs without the features (plain causal), which shows what
skipping the keys out of sight saves.

    a  window 4096 (left 4095, causal), N=16384, 32/8 heads, D=128, B=1: tunegen <= 1600 us
    b  gpt-oss: window 128 (left 127, causal) + sinks, D=64, 64/8 heads, N 4096 and 16384, 16k tokens
       a batch: tunegen >= 1.3x Flex
    c  Gemma 2 cap 50, causal, N 4096 and 8192, 16k tokens a batch, 9B (16/8 heads, D=256) and 27B
       (32/16, D=128): with the cap <= 1.10x the time without; with window 4096 + cap (N=8192: at 4096
       the window holds every key) beside Flex
    d  decode, window 4096 (left 4095) over a 32k-token cache, B=8, 32/8 heads, D=128, contiguous and
       paged (64): GB/s of the window's K and V >= 0.90 of a device copy of those bytes, same run
    e  Llama 4: chunks of 8192, causal, N=16384, 40/8 heads, D=128, B=1: tunegen against Flex
    f  the backward (dq, dk, dv and the sinks' gradient) of a, b at N=4096, c's 27B cap at N=4096 and
       e: tunegen >= Flex on the same masks; each checked against Flex's gradients (relative error
       of the worst of them), then timed together, beside tunegen's backward of the plain call

Every call is checked against float64 on sampled rows before it is timed, then a case's calls are
timed together in the bench's interleaved rounds (tunegen.measure.rows.check_then_time, as `tunegen
bench` times): tunegen through its public call, Flex through its compiled call; decode through
`tunegen bench decode`'s path (kernel with L2 flushed, then the public call eager and replayed in a
CUDA graph). tunegen's and Flex's outputs are also compared with each other (max abs difference).
Writes OUT/local_features.json (after each case) and OUT/local_features.md; prints a table last.

    python3 benchmarks/local_features.py -o OUT [--parts a,b,c,d,e,f]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
from pathlib import Path

import torch

from tunegen.kernels.families import get
from tunegen.kernels.families.base import SOFTCAP
from tunegen.kernels.gpu import cuda_gpu
from tunegen.measure.bench import bench_cases, credited, prefill_calls, prefill_inputs
from tunegen.measure.ceilings import copy_gbps
from tunegen.measure.rows import Row, check_then_time
from tunegen.measure.suites import Shape, decode_suite

WINDOW = (4095, 0)  # 4096 keys a row, the row's own included (Mistral's and Gemma's 4096)


@dataclasses.dataclass(frozen=True)
class Case:
    """One prefill comparison: `shape` (with its features) by tunegen and Flex, and tunegen on the
    same inputs without the features (`plain`)."""

    part: str
    name: str
    shape: Shape

    @property
    def plain(self) -> Shape:
        return Shape(*dataclasses.astuple(self.shape)[:5], causal=True)


def prefill_cases() -> list[Case]:
    """Parts a, b, c and e: the shapes issue 32 names."""
    cases = [Case("a", "window 4096 N=16384", Shape(1, 32, 8, 16384, 128, True).featured(WINDOW))]
    for n in (4096, 16384):
        gpt_oss = Shape(16384 // n, 64, 8, n, 64, True).featured((127, 0), sinks=True)
        cases.append(Case("b", f"gpt-oss window 128 + sinks N={n}", gpt_oss))
    for model, heads, kv_heads, d in (("9B", 16, 8, 256), ("27B", 32, 16, 128)):
        for n in (4096, 8192):
            base = Shape(16384 // n, heads, kv_heads, n, d, True)
            cases.append(Case("c", f"Gemma 2 {model} cap N={n}", base.featured(softcap=SOFTCAP)))
            both = base.featured(WINDOW, softcap=SOFTCAP)
            if both.window_left >= 0:  # at N=4096 the window holds every key: the cap alone
                cases.append(Case("c", f"Gemma 2 {model} window 4096 + cap N={n}", both))
    llama4 = Shape(1, 40, 8, 16384, 128, True).featured(attention_chunk=8192)
    cases.append(Case("e", "Llama 4 chunk 8192 N=16384", llama4))
    return cases


def backward_cases() -> list[Case]:
    """Part f: the backward of the window, gpt-oss's layer, Gemma 2 27B's cap and Llama 4's chunks."""
    return [
        Case("f", "backward window 4096 N=16384", Shape(1, 32, 8, 16384, 128, True).featured(WINDOW)),
        Case(
            "f",
            "backward gpt-oss window 128 + sinks N=4096",
            Shape(4, 64, 8, 4096, 64, True).featured((127, 0), sinks=True),
        ),
        Case(
            "f",
            "backward Gemma 2 27B cap N=4096",
            Shape(4, 32, 16, 4096, 128, True).featured(softcap=SOFTCAP),
        ),
        Case(
            "f",
            "backward Llama 4 chunk 8192 N=16384",
            Shape(1, 40, 8, 16384, 128, True).featured(attention_chunk=8192),
        ),
    ]


def decode_problems() -> list:
    """Part d: the windowed decode Problems (contiguous, paged by 64), then the same without it."""
    sizes = ((8,), (32768,), 32, 8, 128, (0, 64))
    return decode_suite(*sizes, window_size=WINDOW) + decode_suite(*sizes)


def run_prefill(case: Case, seed: int) -> list[dict]:
    """Check, then time together: tunegen and Flex on the case's shape, tunegen on the plain one."""
    inputs = prefill_inputs(case.shape, torch.bfloat16, torch.device("cuda"), seed)
    calls = prefill_calls(case.shape, ["tunegen", "flex"], inputs)
    calls["tunegen plain"] = prefill_calls(case.plain, ["tunegen"], inputs)["tunegen"]
    results = check_then_time(calls)
    diff = None
    if all(results[name][0] is not None for name in ("tunegen", "flex")):
        diff = float((calls["tunegen"][0]().float() - calls["flex"][0]().float()).abs().max())
    gpu, today = cuda_gpu(torch.cuda.current_device()).name, datetime.date.today().isoformat()
    records = []
    for name, (ms, err, note) in results.items():
        shape = case.plain if name == "tunegen plain" else case.shape
        tflops = shape.flops() / ms / 1e9 if ms else None
        row = dataclasses.asdict(Row.of(name, "bf16", shape, ms, tflops, err, note, gpu, today))
        records.append({"part": case.part, "case": case.name, "us": ms * 1e3 if ms else None, **row})
    records[0]["max_abs_diff_vs_flex"] = diff
    del inputs, calls
    torch.cuda.empty_cache()
    return records


def run_backward(case: Case, seed: int) -> list[dict]:
    """Time the gradients of one forward call per implementation, repeated (`retain_graph`): of q,
    k, v and the sinks; checked against Flex's first. TFLOP/s count 2.5 times the forward's work."""
    inputs = prefill_inputs(case.shape, torch.bfloat16, torch.device("cuda"), seed)
    q, k, v, sinks, _ = inputs
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    dout = torch.randn_like(q)
    forward = {
        name: call for name, (call, _, _) in prefill_calls(case.shape, ["tunegen", "flex"], inputs).items()
    }
    forward["tunegen plain"] = prefill_calls(case.plain, ["tunegen"], inputs)["tunegen"][0]
    grads = {}
    for name, call in forward.items():
        out = call()
        wrt = leaves if name != "tunegen plain" else leaves[:3]
        grads[name] = functools.partial(torch.autograd.grad, out, wrt, dout, retain_graph=True)
    ref = [g.float() for g in grads["flex"]()]

    def error(got: tuple) -> float:
        return max(float((g.float() - r).norm() / r.norm()) for g, r in zip(got, ref, strict=False))

    calls = {name: (fn, error, 2e-2) for name, fn in grads.items()}
    calls["tunegen plain"] = (grads["tunegen plain"], lambda _: 0.0, 1.0)  # another function: unchecked
    results = check_then_time(calls)
    gpu, today = cuda_gpu(torch.cuda.current_device()).name, datetime.date.today().isoformat()
    records = []
    for name, (ms, err, note) in results.items():
        shape = case.plain if name == "tunegen plain" else case.shape
        tflops = 2.5 * shape.flops() / ms / 1e9 if ms else None
        row = dataclasses.asdict(Row.of(name, "bf16", shape, ms, tflops, err, note, gpu, today))
        records.append({"part": case.part, "case": case.name, "us": ms * 1e3 if ms else None, **row})
    del inputs, leaves, grads, forward
    torch.cuda.empty_cache()
    return records


def run_decode(problems: list, seed: int) -> list[dict]:
    """`tunegen bench decode`'s rows for `problems` (GB/s of the window's bytes), each with the GB/s
    of a device copy of the bytes it credits tunegen with (read + written: twice the traffic), and
    of a copy of half of them (whose traffic, read + written, is those bytes, as the kernel's is),
    measured right before it."""
    records = []
    for problem in problems:
        nbytes = credited(get("decode"), problem, "tunegen")
        copy, same = copy_gbps(int(nbytes)), copy_gbps(int(nbytes) // 2)
        layout = f"paged {problem.page_size}" if problem.paged else "contiguous"
        window = "window 4096" if problem.local else "whole cache"
        for row in bench_cases([problem], seed=seed):
            us = row["ms"] * 1e3 if row["ms"] else None
            case = f"decode {window} B={problem.batch} {layout}"
            extra = {"bytes": nbytes, "copy_gbps": copy, "copy_same_traffic_gbps": same}
            records.append({"part": "d", "case": case, "us": us, **extra, **row})
    return records


def targets(records: list[dict]) -> list[dict]:
    """Each figure of issue 32 that `records` hold the numbers for: its value, its bound where the
    issue sets one, and whether the bound was met (None: no bound; a missing value misses it)."""
    us = {(r["case"], r["impl"]): r["us"] for r in records}
    out = []

    def add(r: dict, what: str, value: float | None, low: float | None = None, high: float | None = None):
        bound, met = "", None
        if low is not None or high is not None:
            bound = f">= {low}" if low is not None else f"<= {high}"
            met = value is not None and (low is None or value >= low) and (high is None or value <= high)
        out.append({"part": r["part"], "case": r["case"], "what": what, "value": value})
        out[-1].update(bound=bound, met=met)

    for r in records:
        if r["part"] == "d":
            if r["impl"] == "tunegen" and r.get("window_left", -1) >= 0:
                add(r, "GB/s / copy GB/s", r["rate"] / r["copy_gbps"] if r["rate"] else None, low=0.9)
                same = r["rate"] / r["copy_same_traffic_gbps"] if r["rate"] else None
                add(r, "GB/s / GB/s of a copy of the same traffic", same)
            continue
        if r["impl"] != "tunegen":
            continue
        mine, flex, plain = (us.get((r["case"], impl)) for impl in ("tunegen", "flex", "tunegen plain"))
        if r["part"] == "a":
            add(r, "tunegen us", mine, high=1600)
        speedup = flex / mine if mine and flex else None
        add(r, "Flex / tunegen", speedup, low={"b": 1.3, "f": 1.0}.get(r["part"]))
        cost = mine / plain if mine and plain else None
        capped_only = r["part"] == "c" and r.get("window_left", -1) < 0  # Gemma 2's cap alone
        add(r, "tunegen / plain causal", cost, high=1.1 if capped_only else None)
    return out


def markdown(records: list[dict], goals: list[dict], provenance: dict) -> str:
    """The run as markdown: provenance, every measurement, then the targets."""
    lines = [
        "# Issue 32: the attention of current models, tunegen against FlexAttention",
        "",
        ", ".join(f"{k} {v}" for k, v in provenance.items()),
        "",
        "| part | case | impl | us | TFLOP/s or GB/s | rel. err | max abs diff vs Flex | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        rate = r.get("tflops") if r["part"] != "d" else r.get("rate")
        diff = r.get("max_abs_diff_vs_flex")
        cells = [r["part"], r["case"], r["impl"], _fmt(r["us"], ".0f"), _fmt(rate, ".0f")]
        cells += [_fmt(r.get("rel_err"), ".1e"), _fmt(diff, ".1e"), r.get("note") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| part | case | measured | value | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in goals:
        met = {True: "yes", False: "NO", None: ""}[g["met"]]
        cells = [g["part"], g["case"], g["what"], _fmt(g["value"], ".3g"), g["bound"], met]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, required=True, help="folder for the .json and .md")
    ap.add_argument("--parts", default="a,b,c,d,e,f", help="which of the parts a to f to run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("local_features.py times on a CUDA GPU")
    parts = set(args.parts.split(","))
    gpu = cuda_gpu(torch.cuda.current_device())
    provenance = {"gpu": gpu.name, "triton": gpu.triton_version, "torch": gpu.torch_version}
    provenance["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    args.output.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def save() -> list[dict]:
        goals = targets(records)
        data = {**provenance, "records": records, "targets": goals}
        (args.output / "local_features.json").write_text(json.dumps(data, indent=1))
        (args.output / "local_features.md").write_text(markdown(records, goals, provenance))
        return goals

    for case in (c for c in prefill_cases() + backward_cases() if c.part in parts):
        print(f"{case.part}: {case.name}", flush=True)
        try:
            new = (run_backward if case.part == "f" else run_prefill)(case, args.seed)
        except Exception as exc:  # one case that fails is a result, not the run's end
            note = f"{type(exc).__name__}: {str(exc)[:300]}"
            new = [{"part": case.part, "case": case.name, "impl": "tunegen", "us": None, "note": note}]
        records += new
        print(f"  max abs diff tunegen vs Flex: {new[0].get('max_abs_diff_vs_flex')}", flush=True)
        save()
    if "d" in parts:
        print("d: decode", flush=True)
        records += run_decode(decode_problems(), args.seed)
    goals = save()
    print(markdown(records, goals, provenance).split("\n\n")[-1], flush=True)


if __name__ == "__main__":
    main()
