"""Two versions of the backward's Hopper template, side by side: render the default Variant of
each (head dim 64 and 128, causal and not) from a template file into modules here (no GPU needed),
then, on the GPU, check every module's gradients against cuDNN's on the same inputs and time them
with cuDNN's backward in rounds, each in its own order (`tunegen.tuning.rounds.round_order`; CUDA
events, 6 rounds of a few calls each, the median).

A version is a template file (an older one from git: `git show REV:templates/_attention_bwd_ws.j2
> old.j2`) and knobs changed from the default Variant, under a tag:

    python benchmarks/backward_ab.py render old old.j2
    python benchmarks/backward_ab.py render new templates/_attention_bwd_ws.j2 '{"num_stages": 3}'
    python benchmarks/backward_ab.py time old,new --seqlens 1024,4096,16384 -o ab.json

With `--sustain SECONDS`, each version (and cuDNN) then runs back to back for that long at the
longest length, twice in turn (forward order, then reversed), while NVML's energy counter is read:
the speed a power-capped GPU holds and the joules a call spends.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import shutil
import tempfile

MODULES = pathlib.Path(__file__).with_name("ab_modules")
TEMPLATE = "_attention_bwd_ws.j2"


def _problems():
    from tunegen.kernels.problem import Problem

    for d in (128, 64):
        for causal in (False, True):
            name = f"d{d}_{'c' if causal else 'nc'}"
            yield name, Problem("backward", "bfloat16", d, causal, 2048 // d, 2048 // d, 4, 4096, 4096)


@contextlib.contextmanager
def _templates(folder: pathlib.Path):
    """Render from `folder` instead of the package's templates, in this process only."""
    from tunegen.kernels import render

    original = render.template_dir
    render.template_dir = lambda: folder
    render._environment.cache_clear()
    render.template_hash.cache_clear()
    try:
        yield
    finally:
        render.template_dir = original
        render._environment.cache_clear()
        render.template_hash.cache_clear()


def render_version(tag: str, template_file: str, changes: dict) -> None:
    """Render the default Variants of `template_file` (with `changes`) as MODULES/TAG_*.py, from a
    copy of the package's templates with that file in place of the Hopper backward's."""
    import triton

    from tunegen.kernels import render
    from tunegen.kernels.families import backward
    from tunegen.kernels.gpu import Gpu

    gpu = Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda")
    MODULES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        shutil.copytree(render.template_dir(), folder, dirs_exist_ok=True)
        (pathlib.Path(folder) / TEMPLATE).write_text(pathlib.Path(template_file).read_text())
        with _templates(pathlib.Path(folder)):
            for name, problem in _problems():
                variant = backward.FAMILY.default_variant(problem, gpu).replace(**changes)
                features = backward.FAMILY.features(problem, gpu)
                rendered = render.render(backward.FAMILY.template, "backward", variant, features)
                (MODULES / f"{tag}_{name}.py").write_text(rendered.source)


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms_of(fn, reps: int) -> list[float]:
    import torch

    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _energy_reader():
    """A function returning the GPU's energy counter in joules (NVML), or None where NVML is absent."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle = ctypes.c_void_p()
        if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)):
            return None
    except OSError:
        return None

    def read() -> float:
        mj = ctypes.c_ulonglong()
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj))
        return mj.value / 1000

    return read


def _sustain(calls: dict, flops: float, seconds: float) -> dict:
    """Each call back to back for `seconds`, in order then reversed: sustained TFLOP/s, joules per
    call and mean watts per name, over both turns."""
    import time

    import torch

    energy = _energy_reader()
    totals = {t: [0, 0.0, 0.0] for t in calls}
    for names in (list(calls), list(calls)[::-1]):
        for t in names:
            calls[t]()
            torch.cuda.synchronize()
            j0 = energy() if energy else 0.0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0, count = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                for _ in range(4):
                    calls[t]()
                count += 4
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            totals[t][0] += count
            totals[t][1] += start.elapsed_time(end)
            totals[t][2] += (energy() - j0) if energy else float("nan")
    return {
        t: {"tflops": flops * c / ms / 1e9, "joules_per_call": j / c, "watts": j / ms * 1e3}
        for t, (c, ms, j) in totals.items()
    }


def _lse(q, k, causal: bool, scale: float):
    """The forward's natural-log log-sum-exp in float32, by chunks of rows."""
    import torch

    b, h, n, _ = q.shape
    lse = torch.empty(b, h, n, device=q.device)
    for r0 in range(0, n, 2048):
        s = (q[:, :, r0 : r0 + 2048].float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(r0, min(r0 + 2048, n), device=q.device)[:, None]
            s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > rows, float("-inf"))
        lse[:, :, r0 : r0 + 2048] = torch.logsumexp(s, -1)
    return lse


def time_versions(tags: list[str], seqlens: list[int], sustain: float = 0.0) -> list[dict]:
    """Check and time every tag's modules beside cuDNN, per suite shape; one record per shape,
    with `sustain` > 0 the sustained speed and energy at the longest length too."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tunegen.kernels.launch_args import BackwardArgs
    from tunegen.tuning.rounds import round_order

    rows = []
    for name, problem in _problems():
        d, causal = problem.head_dim, problem.causal
        modules = {
            tag: _load(MODULES / f"{tag}_{name}.py")
            for tag in tags
            if (MODULES / f"{tag}_{name}.py").exists()
        }
        if not modules:
            continue
        for n in seqlens:
            b, h = 16384 // n, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, dout = (
                torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4)
            )
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            scale = d**-0.5
            lse = _lse(q, k, causal, scale)
            ref = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            calls = {
                "cudnn": lambda out=out, leaves=leaves, dout=dout: torch.autograd.grad(
                    out, leaves, dout, retain_graph=True
                )
            }
            errs = {}
            for tag, module in modules.items():
                grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                args = BackwardArgs(q, k, v, out.detach(), dout, lse, None, *grads, scale)
                module.launch(args)
                torch.cuda.synchronize()
                pairs = zip(grads, ref, strict=True)
                errs[tag] = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in pairs)
                calls[tag] = lambda module=module, args=args: module.launch(args)
            flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            reps = max(3, min(20, int(2e12 / flops * 20)))
            names = list(calls)
            for call in calls.values():
                call()
            torch.cuda.synchronize()
            times = {t: [] for t in names}
            for r in range(6):
                for t in (names[k] for k in round_order(len(names), r, 6)):
                    times[t] += _ms_of(calls[t], reps)
            median = {t: sorted(x)[len(x) // 2] for t, x in times.items()}
            tflops = {t: flops / median[t] / 1e9 for t in median}
            spread = {
                t: (sorted(x)[len(x) * 3 // 4] - sorted(x)[len(x) // 4]) / median[t] for t, x in times.items()
            }
            rows.append({"d": d, "causal": causal, "n": n, "tflops": tflops, "err": errs, "spread": spread})
            if sustain > 0 and n == max(seqlens):
                rows[-1]["sustained"] = held = _sustain(calls, flops, sustain)
                shown = (
                    f"{t}={x['tflops']:4.0f} ({x['joules_per_call']:.3f} J, {x['watts']:3.0f} W)"
                    for t, x in held.items()
                )
                print("  sustained " + " ".join(shown), flush=True)
            print(
                f"D{d} {'c ' if causal else 'nc'} N={n:5d} "
                + " ".join(f"{t}={tflops[t]:4.0f}" for t in names)
                + "  err "
                + " ".join(f"{t}={e:.1e}" for t, e in errs.items()),
                flush=True,
            )
            del q, k, v, dout, out, leaves, ref, calls, lse
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render a version's modules (CPU)")
    r.add_argument("tag")
    r.add_argument("template")
    r.add_argument("changes", nargs="?", default="{}", help="knobs changed from the default Variant, as JSON")
    t = sub.add_parser("time", help="check and time rendered versions beside cuDNN (GPU)")
    t.add_argument("tags")
    t.add_argument("--seqlens", default="1024,4096,16384")
    t.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls per version")
    t.add_argument("-o", "--output")
    args = ap.parse_args()
    if args.command == "render":
        render_version(args.tag, args.template, json.loads(args.changes))
        return
    rows = time_versions(args.tags.split(","), [int(n) for n in args.seqlens.split(",")], args.sustain)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
