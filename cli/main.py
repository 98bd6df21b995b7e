"""`tunegen`: the command line. Each command parses, calls the library and prints."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import click

import tunegen


def _parse_ints(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tunegen.__version__, prog_name="tunegen")
def main() -> None:
    """Autotuned Triton attention kernels: render, benchmark and (soon) tune them."""


@main.command()
@click.argument("family", type=click.Choice(["prefill", "backward"]))
@click.option("--head-dim", type=int, default=128, show_default=True, help="Head dimension D.")
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="bfloat16", show_default=True
)
@click.option("--heads", type=int, default=32, show_default=True, help="Query heads.")
@click.option("--kv-heads", type=int, default=None, help="Key/value heads (default: --heads).")
@click.option("--varlen", is_flag=True, help="Packed sequences with cu_seqlens.")
@click.option("--return-lse", is_flag=True, help="Also store the log-sum-exp.")
@click.option("--unaligned", is_flag=True, help="Inputs whose strides are not 16-byte multiples.")
@click.option(
    "--gpu",
    "gpu_kind",
    type=click.Choice(["auto", "hopper", "ampere", "interpreter"]),
    default="auto",
    show_default=True,
    help="GPU class whose default Variant to start from.",
)
@click.option(
    "--variant", "variant_json", default=None, help="Knobs to override, as JSON: '{\"block_m\": 64}'."
)
def render(
    family: str,
    head_dim: int,
    causal: bool,
    dtype: str,
    heads: int,
    kv_heads: int | None,
    varlen: bool,
    return_lse: bool,
    unaligned: bool,
    gpu_kind: str,
    variant_json: str | None,
) -> None:
    """Print the Triton source a Variant of FAMILY renders to."""
    import torch

    from tunegen.kernels import families
    from tunegen.kernels import render as rendering
    from tunegen.kernels.gpu import Gpu, gpu_of
    from tunegen.kernels.problem import Problem

    if gpu_kind == "auto":
        gpu = gpu_of(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        capability = {"hopper": (9, 0), "ampere": (8, 0), "interpreter": (0, 0)}[gpu_kind]
        backend = "interpreter" if gpu_kind == "interpreter" else "cuda"
        gpu = Gpu(gpu_kind, capability, 1, 0, "", "", backend)
    problem = Problem(
        family=family,
        dtype=dtype,
        head_dim=head_dim,
        causal=causal,
        num_heads_q=heads,
        num_heads_kv=kv_heads or heads,
        batch=1,
        seqlen_q=1,
        seqlen_k=1,
        varlen=varlen,
        return_lse=return_lse,
        aligned=not unaligned,
    )
    fam = families.get(family)
    variant = fam.default_variant(problem, gpu)
    try:
        if variant_json:
            variant = variant.replace(**json.loads(variant_json))
        fam.check_variant(variant, problem, gpu)
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--variant") from None
    click.echo(rendering.render(fam.template, family, variant, fam.features(problem, gpu)).source, nl=False)


@main.group()
def bench() -> None:
    """Time tunegen against its peers (SDPA backends, FlexAttention) on this GPU."""


_SUITE_OPTIONS = (
    click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True),
    click.option(
        "--seqlens", callback=_parse_ints, default="512,1024,2048,4096,8192,16384", show_default=True
    ),
    click.option("--head-dims", callback=_parse_ints, default="64,128,256", show_default=True),
    click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True),
    click.option(
        "--tokens", type=int, default=16384, show_default=True, help="Tokens per batch: B = tokens / N."
    ),
    click.option("--hidden", type=int, default=2048, show_default=True, help="Hidden size: H = hidden / D."),
    click.option(
        "--kv-heads", type=int, default=None, help="Key/value heads (default: as many as query heads)."
    ),
)


def _suite_options(command):
    """The FlashAttention papers' benchmark suite as options: dtype, lengths, head dims, causal,
    tokens per batch, hidden size and KV heads (`tunegen.measure.bench.prefill_suite`'s arguments)."""
    for option in reversed(_SUITE_OPTIONS):
        command = option(command)
    return command


@bench.command("prefill")
@_suite_options
@click.option(
    "--impl",
    "impls",
    default=None,
    help="Comma-separated implementations (default: tunegen and every peer available).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write every row to this .csv or .json file.",
)
def bench_prefill(
    dtype: str,
    seqlens: tuple[int, ...],
    head_dims: tuple[int, ...],
    causal: str,
    tokens: int,
    hidden: int,
    kv_heads: int | None,
    impls: str | None,
    output: Path | None,
) -> None:
    """Prefill forward: TFLOP/s per implementation on the FlashAttention papers' suite."""
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tunegen.kernels import peers
    from tunegen.measure import bench as benchmarks

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    names = [s.strip() for s in impls.split(",")] if impls else ["tunegen", *peers.available()]
    shapes = benchmarks.prefill_suite(
        seqlens,
        head_dims,
        {"both": (False, True), "yes": (True,), "no": (False,)}[causal],
        tokens,
        hidden,
        kv_heads,
    )
    with Progress(transient=True) as progress:
        task = progress.add_task("bench prefill", total=len(shapes) * len(names))
        rows = benchmarks.bench_prefill(shapes, names, dtype=dtype, on_row=lambda _: progress.advance(task))
    if output is not None:
        benchmarks.write_rows(rows, output)
    table = Table(title=f"prefill {dtype}, TFLOP/s ({rows[0].gpu if rows else ''})")
    for col in ("D", "causal", "N", "B", "H", *names):
        table.add_column(col, justify="right")
    by_shape: dict[tuple, dict[str, str]] = {}
    for r in rows:
        cell = f"{r.tflops:.0f}" if r.tflops is not None else ("wrong" if r.note.startswith("wrong") else "-")
        by_shape.setdefault((r.head_dim, r.causal, r.seqlen, r.batch, r.heads), {})[r.impl] = cell
    for key, cells in by_shape.items():
        table.add_row(*(str(x) for x in key), *(cells.get(n, "") for n in names))
    Console(width=200).print(table)


def _db_option(command):
    return click.option(
        "--db",
        "db_url",
        default=None,
        metavar="URL",
        help="SQLAlchemy URL of the tuning database (default: TUNEGEN_DB, else the user's SQLite file).",
    )(command)


@contextlib.contextmanager
def _store(db_url, *, readonly):
    """Open the store; its errors and invalid input become clean command-line errors."""
    from tunegen.kernels.database import open_store
    from tunegen.tuning_db import TuningDbError

    try:
        with open_store(db_url, readonly=readonly) as store:
            yield store
    except (TuningDbError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _problem_text(problem: dict) -> str:
    heads = f"{problem.get('num_heads_q')}/{problem.get('num_heads_kv')}"
    flags = [name for name in ("causal", "varlen", "paged", "fp8", "return_lse") if problem.get(name)]
    sizes = f"B{problem.get('batch')} {problem.get('seqlen_q')}x{problem.get('seqlen_k')}"
    return f"{problem.get('dtype')} D{problem.get('head_dim')} H{heads} {sizes} {' '.join(flags)}".strip()


def _speed(w, ms: float | None = None) -> str:
    """A winner's speed (or, given `ms`, the speed at that time) in its family's unit."""
    scale = w.median_ms / ms if ms else 1.0
    if w.tflops:
        return f"{w.tflops * scale:.0f} TFLOP/s"
    if w.gbps:
        return f"{w.gbps * scale:.0f} GB/s"
    return "-"


def _variant_text(variant: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(variant.items()))


@bench.command("decode")
@click.option("--batches", callback=_parse_ints, default="1,16,64", show_default=True)
@click.option("--cache-lengths", callback=_parse_ints, default="4096,32768", show_default=True)
@click.option("--heads", type=int, default=32, show_default=True)
@click.option("--kv-heads", type=int, default=8, show_default=True)
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option(
    "--page-sizes",
    callback=_parse_ints,
    default="0,64",
    show_default=True,
    help="Cache layouts: 0 is contiguous, others paged with that many tokens a page.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_decode(batches, cache_lengths, heads, kv_heads, head_dim, page_sizes, output) -> None:
    """Decode over a KV cache: GB/s of K and V read, tunegen against SDPA's backends."""
    import torch
    from rich.progress import Progress

    from tunegen.measure import bench as benchmarks

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    problems = benchmarks.decode_suite(batches, cache_lengths, heads, kv_heads, head_dim, page_sizes)
    with Progress(transient=True) as progress:
        task = progress.add_task("bench decode", total=None)
        rows = benchmarks.bench_cases(problems, on_row=lambda _: progress.advance(task))
    if output is not None:
        benchmarks.write_rows(rows, output)
    _print_cases(
        rows,
        "decode bf16, GB/s of K/V read: kernel (L2 flushed) / eager call, host included / CUDA graph",
        {
            "B": lambda r: r["batch"],
            "cache": lambda r: r["seqlen_k"],
            "layout": lambda r: f"paged {r['page_size']}" if r["paged"] else "contiguous",
        },
    )


def _print_cases(rows: list[dict], title: str, columns: dict) -> None:
    """A table of `bench_cases` rows: one line per Problem (its `columns`, each a function of a
    row), one column per implementation with its rate, "wrong" or "-" (refused)."""
    from rich.console import Console
    from rich.table import Table

    names = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title=f"{title} ({rows[0]['gpu'] if rows else ''})")
    for col in (*columns, *names):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, str]] = {}
    for r in rows:
        key = tuple(column(r) for column in columns.values())
        cell = f"{r['rate']:.0f}" if r["rate"] else ("wrong" if "wrong" in r["note"] else "-")
        if r["rate"] and "eager_rate" in r:
            cell += "".join(f" / {r[k]:.0f}" if r[k] else " / -" for k in ("eager_rate", "graph_rate"))
        cells.setdefault(key, {})[r["impl"]] = cell
    for key, row in cells.items():
        table.add_row(*(str(x) for x in key), *(row.get(n, "") for n in names))
    Console(width=200).print(table)


@bench.command("backward")
@_suite_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_backward(dtype, seqlens, head_dims, causal, tokens, hidden, kv_heads, output) -> None:
    """Backward (dQ, dK, dV): TFLOP/s, counted as 2.5x the forward's FLOPs, on the prefill suite;
    tunegen against the backward of SDPA's backends and of FlexAttention."""
    from operator import itemgetter

    import torch
    from rich.progress import Progress

    from tunegen.measure import bench as benchmarks
    from tunegen.tuning.presets import DTYPES

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    problems = benchmarks.backward_suite(
        seqlens, head_dims, causal_values, tokens, hidden, kv_heads, DTYPES[dtype]
    )
    with Progress(transient=True) as progress:
        task = progress.add_task("bench backward", total=None)
        rows = benchmarks.bench_cases(problems, on_row=lambda _: progress.advance(task))
    if output is not None:
        benchmarks.write_rows(rows, output)
    _print_cases(
        rows,
        f"backward {dtype}, TFLOP/s (2.5x forward FLOPs)",
        {
            "D": itemgetter("head_dim"),
            "causal": itemgetter("causal"),
            "N": itemgetter("seqlen_q"),
            "B": itemgetter("batch"),
            "H": itemgetter("num_heads_q"),
        },
    )


@bench.command("fp8")
@click.option("--seqlens", callback=_parse_ints, default="1024,2048,4096,8192,16384", show_default=True)
@click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True)
@click.option(
    "--tokens", type=int, default=16384, show_default=True, help="Prefill tokens per batch: B = tokens / N."
)
@click.option(
    "--hidden", type=int, default=2048, show_default=True, help="Prefill hidden size: H = hidden / 128."
)
@click.option(
    "--batches", callback=_parse_ints, default="1,16,64", show_default=True, help="Decode batch sizes."
)
@click.option("--cache-lengths", callback=_parse_ints, default="4096,32768", show_default=True)
@click.option(
    "--page-sizes",
    callback=_parse_ints,
    default="0,64",
    show_default=True,
    help="Decode cache layouts: 0 is contiguous, others paged with that many tokens a page.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the prefill rows, decode rows and speedups to this .json file.",
)
def bench_fp8(seqlens, causal, tokens, hidden, batches, cache_lengths, page_sizes, output) -> None:
    """FP8 against bf16: D=128 prefill in TFLOP/s (tunegen bf16; FP8 on e4m3 inputs; FP8 from bf16
    with the Hadamard rotation and quantization timed in; SDPA), and decode over an FP8 KV cache
    against a bf16 one (32 query heads, 8 KV heads), each checked against float64 first."""
    import dataclasses

    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tunegen.measure import bench as benchmarks

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    shapes = benchmarks.prefill_suite(seqlens, (128,), causal_values, tokens, hidden)
    with Progress(transient=True) as progress:
        task = progress.add_task("bench fp8", total=None)
        prefill_rows = benchmarks.bench_fp8_prefill(shapes, on_row=lambda _: progress.advance(task))
        decode_rows = benchmarks.bench_cases(
            benchmarks.fp8_decode_suite(batches, cache_lengths, page_sizes),
            on_row=lambda _: progress.advance(task),
        )
    speedups = benchmarks.fp8_speedups(prefill_rows, decode_rows)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "prefill": [dataclasses.asdict(r) for r in prefill_rows],
            "decode": decode_rows,
            "speedups": speedups,
        }
        output.write_text(json.dumps(document, indent=1) + "\n")
    console = Console(width=200)
    names = list(dict.fromkeys(r.impl for r in prefill_rows))
    table = Table(title=f"prefill D=128, TFLOP/s ({prefill_rows[0].gpu if prefill_rows else ''})")
    for col in ("causal", "N", "B", "H", *names):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, str]] = {}
    for r in prefill_rows:
        if r.tflops is not None:
            cell = f"{r.tflops:.0f}"
        elif r.ms is not None:  # the quantize step: no FLOPs of its own
            cell = f"{r.ms * 1e3:.0f} us"
        else:
            cell = "wrong" if r.note.startswith("wrong") else "-"
        cells.setdefault((r.causal, r.seqlen, r.batch, r.heads), {})[r.impl] = cell
    for key, row in cells.items():
        table.add_row(*(str(x) for x in key), *(row.get(n, "") for n in names))
    console.print(table)
    table = Table(
        title="FP8 against bf16 (prefill: tunegen-fp8 / tunegen-bf16, end to end from bf16 with the "
        "quantize step, that step's time over the FP8 kernel's; decode: time of bf16 / FP8 cache)"
    )
    numbers = ("fp8", "bf16", "speedup", "end_to_end", "quantize_share")
    for col in ("family", "shape", "fp8", "bf16", "unit", "speedup", "end to end", "quantize / kernel"):
        table.add_column(col, justify="right")
    for s in speedups:
        fp8, bf16, speedup, whole, share = (f"{s[n]:.4g}" if s[n] is not None else "-" for n in numbers)
        table.add_row(s["family"], s["shape"], fp8, bf16, s["unit"], speedup, whole, share)
    console.print(table)


@main.command()
@click.option(
    "--preset",
    "preset_names",
    multiple=True,
    help="Model family to tune for (repeatable): llama3-8b, llama3-70b, mistral-7b, qwen2.5-7b, gpt2.",
)
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    metavar="HEADS,KV_HEADS,HEAD_DIM",
    help="An explicit attention shape (repeatable), e.g. 32,8,128.",
)
@click.option(
    "--family", type=click.Choice(["prefill", "decode", "backward"]), default="prefill", show_default=True
)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="yes", show_default=True)
@click.option(
    "--batches",
    callback=_parse_ints,
    default="1,16,64",
    show_default=True,
    help="Decode: batch sizes to sweep.",
)
@click.option(
    "--page-size",
    type=int,
    default=0,
    show_default=True,
    help="Decode: tokens per page of a paged cache (0: contiguous).",
)
@click.option(
    "--seqlens",
    callback=_parse_ints,
    default="1024,4096,16384",
    show_default=True,
    help="Sequence lengths to sweep.",
)
@click.option(
    "--tokens", type=int, default=16384, show_default=True, help="Tokens per batch: B = tokens / N."
)
@click.option("--trials", type=int, default=40, show_default=True, help="Variants evaluated per Problem.")
@click.option("--timeout", type=float, default=None, help="Seconds per Problem at most.")
@click.option(
    "--sampler", type=click.Choice(["tpe", "random", "grid", "cmaes", "gp"]), default="tpe", show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--workers", type=int, default=None, help="Compile processes (default: CPU count, at most 16).")
@click.option(
    "--trial-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="Seconds before a compile or a timing run counts as hung.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Tiny shapes under Triton's interpreter (the default without a GPU): checks the machinery.",
)
@click.option(
    "--fp8",
    is_flag=True,
    help="FP8 Problems: prefill on e4m3 inputs (bf16 output), or decode over an e4m3 cache.",
)
@_db_option
def tune(
    preset_names,
    shapes,
    family,
    dtype,
    causal,
    batches,
    page_size,
    seqlens,
    tokens,
    trials,
    timeout,
    sampler,
    seed,
    workers,
    trial_timeout,
    dry_run,
    fp8,
    db_url,
) -> None:
    """Find the fastest correct Variant for each Problem on this GPU and record it as the Winner."""
    import os

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Table

    from tunegen.kernels.gpu import cuda_gpu, interpreter_gpu
    from tunegen.tuning import presets
    from tunegen.tuning.tuner import TuneOptions, Tuner
    from tunegen.tuning_db import TuningDbError

    try:
        models = [presets.preset(n) for n in preset_names] + [presets.parse_shape(s) for s in shapes]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not models:
        models = [presets.preset("llama3-8b")]
    interpret = dry_run or not torch.cuda.is_available()
    if fp8 and family not in ("prefill", "decode"):
        raise click.BadParameter(f"FP8 applies to prefill and decode, not {family}", param_hint="--fp8")
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    todo = presets.problems(
        models,
        dtype=presets.DTYPES[dtype],
        causal=causal_values,
        seqlens=seqlens,
        tokens=tokens,
        family=family,
        batches=batches,
        page_size=page_size,
        fp8=fp8,
    )
    console = Console(width=200)
    if interpret:
        todo = list(dict.fromkeys(presets.dry_run(p) for p in todo))
        trials = min(trials, 4)
        console.print(
            "[yellow]No GPU (or --dry-run): tuning tiny shapes under Triton's interpreter; "
            "stored as backend 'interpreter', never used on a GPU.[/yellow]"
        )
    gpu = interpreter_gpu() if interpret else cuda_gpu(torch.cuda.current_device())
    options = TuneOptions(
        trials=trials,
        timeout=timeout,
        sampler=sampler,
        seed=seed,
        workers=workers or min(16, os.cpu_count() or 1),
        trial_timeout=trial_timeout,
        url=db_url,
    )
    outcomes = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} trials"),
        TextColumn("{task.fields[best]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    try:
        with Tuner(gpu, options) as tuner, Progress(*columns, console=console) as progress:
            for problem in todo:
                label = _problem_text(problem.as_dict())
                task = progress.add_task(label, total=options.trials, best="")

                def report(state, task=task):
                    best = f"best {state['best_rate']:.0f} {state['unit']}" if state["best_rate"] else ""
                    progress.update(task, completed=min(state["evaluated"], options.trials), best=best)

                outcomes.append(tuner.tune(problem, report))
    except (TuningDbError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    table = Table(title=f"tuned on {gpu.name} (Triton {gpu.triton_version})")
    for col in (
        "problem",
        "winner",
        "speed",
        "best peer",
        "speedup",
        "trials",
        "failed",
        "recorded",
        "time",
    ):
        table.add_column(col)
    for o in outcomes:
        w = o.winner
        table.add_row(
            _problem_text(o.problem.as_dict()),
            _variant_text(w.variant) if w else "none found",
            _speed(w) if w else "-",
            f"{w.peer_name} {_speed(w, w.peer_ms)}" if w and w.peer_ms else "-",
            f"{w.speedup:.2f}x" if w and w.speedup else "-",
            str(o.evaluated),
            str(o.failed),
            o.recorded or "-",
            f"{o.wall_s:.0f} s",
        )
    console.print(table)


@main.command()
@_db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def doctor(db_url: str | None, fmt: str) -> None:
    """The GPU, versions, database, winners for this GPU, stale ones, and dispatch's fallbacks."""
    from tunegen.measure.doctor import render_text, report

    result = report(db_url)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else render_text(result))


@main.command()
@click.option(
    "--preset",
    default="llama2-70b",
    show_default=True,
    help="llama2-70b, llama2-7b, llama3-8b, llama3-70b, mistral-7b, qwen2.5-7b, gpt2.",
)
@click.option("--layers", type=int, default=None)
@click.option("--heads", type=int, default=None)
@click.option("--kv-heads", type=int, default=None)
@click.option("--head-dim", type=int, default=None)
@click.option("--seqlen", type=int, default=4096, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["fp32", "fp16", "bf16", "fp8"]), default="fp16", show_default=True
)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def memory(preset, layers, heads, kv_heads, head_dim, seqlen, batch, dtype, fmt) -> None:
    """KV-cache and attention memory: per token, per sequence, GQA/MQA savings, N x N vs tiled."""
    import dataclasses

    from tunegen.measure import memory as calc

    if preset not in calc.MODELS:
        raise click.BadParameter(
            f"expected one of {sorted(calc.MODELS)}, got {preset!r}", param_hint="--preset"
        )
    base = calc.MODELS[preset]
    model = dataclasses.replace(
        base,
        layers=layers or base.layers,
        heads=heads or base.heads,
        kv_heads=kv_heads or base.kv_heads,
        head_dim=head_dim or base.head_dim,
    )
    try:
        result = calc.report(model, seqlen=seqlen, batch=batch, dtype=dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(
        json.dumps(dataclasses.asdict(result), indent=1) if fmt == "json" else calc.render_text(result)
    )


@bench.command("all")
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tunegen-bench"),
    show_default=True,
    help="Folder for every family's results, the ceilings and the report.",
)
def bench_all(output: Path) -> None:
    """Every family on its default suite against the peers on this GPU (prefill with the default
    Variants beside the served ones, decode, backward, FP8), then the ceilings and the report."""
    import torch

    from tunegen.kernels import peers

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    steps = [
        [
            "prefill",
            "--impl",
            ",".join(["tunegen", "tunegen-default", *peers.available()]),
            "-o",
            "prefill.csv",
        ],
        ["decode", "-o", "decode.csv"],
        ["backward", "-o", "backward.csv"],
        ["fp8", "-o", "fp8.json"],
        ["ceilings", "-o", "ceilings.json"],
    ]
    for i, (name, *args) in enumerate(steps, 1):
        click.secho(f"[{i}/{len(steps) + 1}] bench {name}", bold=True)
        args[-1] = str(output / args[-1])
        main.main(["bench", name, *args], standalone_mode=False)
    click.secho(f"[{len(steps) + 1}/{len(steps) + 1}] report", bold=True)
    results = [str(output / name) for name in ("prefill.csv", "decode.csv", "backward.csv", "fp8.json")]
    ceilings = ["--ceilings", str(output / "ceilings.json")]
    main.main(["report", *results, *ceilings, "-o", str(output / "report")], standalone_mode=False)


@bench.command("ceilings")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_ceilings(output: Path | None) -> None:
    """The roofline's ceilings on this GPU: bf16 and fp8 matmul TFLOP/s, copy TB/s (read + write)."""
    import torch

    from tunegen.measure import ceilings

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")
    result = ceilings.measure()
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1))
    click.echo(json.dumps(result, indent=1))


@main.command()
@click.argument(
    "results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tunegen-report"),
    show_default=True,
    help="Folder for index.html and its plots.",
)
@click.option(
    "--ceilings",
    "ceilings_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON from `tunegen bench ceilings` (matmul and copy ceilings) for the roofline.",
)
def report(results: tuple[Path, ...], output: Path, ceilings_path: Path | None) -> None:
    """An HTML page with plots from `tunegen bench` result files (CSV or JSON)."""
    from tunegen.measure import report as pages

    try:
        ceilings = pages.Ceilings.load(ceilings_path) if ceilings_path else None
        page = pages.write_report(results, output, ceilings)
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {page}")


@main.command("list")
@_db_option
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (its name).")
@click.option("--family", default=None, help="Only this family.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_winners(db_url: str | None, gpu_name: str | None, family: str | None, fmt: str) -> None:
    """List the Winners in the tuning database."""
    from rich.console import Console
    from rich.table import Table

    from tunegen.tuning_db.exchange import entry

    with _store(db_url, readonly=True) as store:
        winners = store.winners(gpu_name=gpu_name, family=family)
    if fmt == "json":
        click.echo(json.dumps([{"id": w.id, "gpu": w.gpu.name, **entry(w)} for w in winners], indent=1))
        return
    table = Table(title=f"{len(winners)} winners")
    for col in ("id", "gpu", "family", "problem", "variant", "ms", "speed", "vs peer", "triton"):
        table.add_column(col)
    for w in winners:
        table.add_row(
            str(w.id),
            w.gpu.name,
            w.family,
            _problem_text(w.problem),
            _variant_text(w.variant),
            f"{w.median_ms:.4f}",
            _speed(w),
            f"{w.speedup:.2f}x {w.peer_name}" if w.speedup else "-",
            w.triton_version,
        )
    Console(width=220).print(table)


@main.command()
@_db_option
@click.argument("winner_id", type=int)
def show(db_url: str | None, winner_id: int) -> None:
    """Show one Winner with its provenance (ids come from `tunegen list`)."""
    import dataclasses

    from tunegen.tuning_db.exchange import entry

    with _store(db_url, readonly=True) as store:
        found = store.winners(winner_id=winner_id)
    if not found:
        raise click.ClickException(f"no winner with id {winner_id}")
    w = found[0]
    click.echo(json.dumps({"id": w.id, "gpu": dataclasses.asdict(w.gpu), **entry(w)}, indent=2))


@main.command("export")
@_db_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "python", "aot"]),
    default="json",
    show_default=True,
    help="json: one readable file of winners per GPU (for `tunegen import`); python: a package that runs "
    "them with torch and triton alone; aot: cubins with C launchers and a manifest (prefill).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder to write into.",
)
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (its name).")
@click.option("--family", "families", multiple=True, help="Only this family (repeatable).")
@click.option("--package", default="tunegen_kernels", show_default=True, help="python: the package's name.")
@click.option(
    "--allow-mixed-gpus", is_flag=True, help="python, aot: one table may hold several GPUs' winners."
)
def export_winners(
    db_url: str | None,
    fmt: str,
    output: Path,
    gpu_name: str | None,
    families: tuple[str, ...],
    package: str,
    allow_mixed_gpus: bool,
) -> None:
    """Export Winners: to another machine, or to run without tunegen."""
    from tunegen.export import export

    with _store(db_url, readonly=True) as store:
        report = export(
            store,
            fmt,
            output,
            gpu_name=gpu_name,
            families=families,
            package=package,
            allow_mixed_gpus=allow_mixed_gpus,
        )
    for path, count in report.written.items():
        click.echo(f"{path}: {count} winners")
    for skipped in report.skipped:
        click.echo(
            f"skipped {skipped.winner.family} {_problem_text(skipped.winner.problem)}: {skipped.reason}"
        )


@main.command("import")
@_db_option
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def import_winners(db_url: str | None, files: tuple[Path, ...]) -> None:
    """Import Winners from exported JSON files; a faster result replaces a slower one."""
    from tunegen.tuning_db import import_document

    documents = []
    for path in files:
        try:
            documents.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise click.ClickException(f"{path}: not readable JSON: {exc}") from None
    with _store(db_url, readonly=False) as store:
        for path, document in documents:
            try:
                report = import_document(store, document)
            except ValueError as exc:
                raise click.ClickException(f"{path}: {exc}; nothing from it was imported") from None
            click.echo(
                f"{path}: merged {report.merged}, replaced {report.replaced}, skipped {report.skipped}"
            )


@main.group()
def db() -> None:
    """The tuning database itself."""


@db.command()
@_db_option
def upgrade(db_url: str | None) -> None:
    """Create the schema, or upgrade it in place to this release's."""
    with _store(db_url, readonly=False) as store:
        before, after = store.upgrade()
        click.echo(f"{store.name}: schema {before or 'none'} -> {after}")


if __name__ == "__main__":
    main()
