"""`tunegen bench`: tunegen against its peers on this GPU, per family (prefill, decode, backward,
FP8), the roofline's ceilings, and all of them at once; and `tunegen report`, the HTML page of
plots from their result files."""

from __future__ import annotations

import json
from operator import itemgetter
from pathlib import Path

import click

from tunegen.cli.options import (
    CAUSAL,
    COUNT,
    COUNTS,
    HEAD_DIM,
    PAGE_SIZES,
    WINDOW_OPTION,
    check_kv_heads,
    check_suite,
    local_options,
    suite_options,
)


@click.group()
def bench() -> None:
    """Time tunegen against its peers (SDPA backends, FlexAttention) on this GPU."""


def _need_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise click.UsageError("bench needs a CUDA GPU: timings come from the GPU's clock")


def _missing(note: str) -> str:
    """A table cell without a speed: "n/a" (the implementation cannot run the inputs; the reason
    is listed under the table and in the results file), "wrong" (it ran and was wrong) or "-"."""
    if note.startswith("n/a"):
        return "n/a"
    return "wrong" if note.startswith("wrong") else "-"


def _print_refusals(console, notes: list[tuple[str, str]]) -> None:
    """Under a table, once each: which implementation could not run which inputs, and why."""
    for impl, note in dict.fromkeys((impl, note) for impl, note in notes if note.startswith("n/a")):
        console.print(f"{impl}: {note}")


@bench.command("prefill")
@suite_options
@local_options
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
    window: tuple[int, int],
    chunk: int,
    softcap: float,
    sinks: bool,
    impls: str | None,
    output: Path | None,
) -> None:
    """Prefill forward: TFLOP/s per implementation on the FlashAttention papers' suite, with the
    features of current models where asked (SDPA takes none: its rows say n/a). TFLOP/s count the
    (row, key) pairs attended; a window wider than a length is that length's plain mask."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tunegen.kernels import peers
    from tunegen.measure import bench as benchmarks
    from tunegen.measure.rows import write_rows
    from tunegen.measure.suites import prefill_suite

    check_suite(head_dims, hidden, kv_heads)
    _need_gpu()
    names = [s.strip() for s in impls.split(",")] if impls else ["tunegen", *peers.available()]
    features = {"window_size": window, "attention_chunk": chunk, "softcap": softcap, "sinks": sinks}
    shapes = prefill_suite(seqlens, head_dims, CAUSAL[causal], tokens, hidden, kv_heads, **features)
    with Progress(transient=True) as progress:
        task = progress.add_task("bench prefill", total=len(shapes) * len(names))
        rows = benchmarks.bench_prefill(shapes, names, dtype=dtype, on_row=lambda _: progress.advance(task))
    if output is not None:
        write_rows(rows, output)
    table = Table(title=f"prefill {dtype}, TFLOP/s of the pairs attended ({rows[0].gpu if rows else ''})")
    for col in ("D", "causal", "window", "chunk", "cap", "sinks", "N", "B", "H", *names):
        table.add_column(col, justify="right")
    by_shape: dict[tuple, dict[str, str]] = {}
    for r in rows:
        cell = f"{r.tflops:.0f}" if r.tflops is not None else _missing(r.note)
        local = (f"{r.window_left},{r.window_right}", r.attention_chunk, f"{r.softcap:g}", r.sinks)
        by_shape.setdefault((r.head_dim, r.causal, *local, r.seqlen, r.batch, r.heads), {})[r.impl] = cell
    for key, cells in by_shape.items():
        table.add_row(*(str(x) for x in key), *(cells.get(n, "") for n in names))
    console = Console(width=200)
    console.print(table)
    _print_refusals(console, [(r.impl, r.note) for r in rows])


@bench.command("decode")
@click.option("--batches", type=COUNTS, default="1,16,64", show_default=True)
@click.option("--cache-lengths", type=COUNTS, default="4096,32768", show_default=True)
@click.option("--heads", type=COUNT, default=32, show_default=True)
@click.option("--kv-heads", type=COUNT, default=8, show_default=True, help="A divisor of --heads.")
@click.option("--head-dim", type=HEAD_DIM, default=128, show_default=True)
@click.option(
    "--page-sizes",
    type=PAGE_SIZES,
    default="0,64",
    show_default=True,
    help="Cache layouts: 0 is contiguous, others paged with that many tokens a page (multiples of 16).",
)
@WINDOW_OPTION
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_decode(batches, cache_lengths, heads, kv_heads, head_dim, page_sizes, window, output) -> None:
    """Decode over a KV cache: GB/s of K and V read, tunegen against SDPA's backends; with a
    --window, GB/s of the window's keys and values only (SDPA takes no window)."""
    from rich.progress import Progress

    from tunegen.measure.bench import bench_cases
    from tunegen.measure.rows import write_rows
    from tunegen.measure.suites import decode_suite

    check_kv_heads(heads, kv_heads)
    _need_gpu()
    problems = decode_suite(batches, cache_lengths, heads, kv_heads, head_dim, page_sizes, window_size=window)
    with Progress(transient=True) as progress:
        task = progress.add_task("bench decode", total=None)
        rows = bench_cases(problems, on_row=lambda _: progress.advance(task))
    if output is not None:
        write_rows(rows, output)
    _print_cases(
        rows,
        "decode bf16, GB/s of K/V read: kernel (L2 flushed) / eager call, host included / CUDA graph",
        {
            "window": lambda r: f"{r.get('window_left', -1)},{r.get('window_right', -1)}",
            "B": lambda r: r["batch"],
            "cache": lambda r: r["seqlen_k"],
            "layout": lambda r: f"paged {r['page_size']}" if r["paged"] else "contiguous",
        },
    )


def _print_cases(rows: list[dict], title: str, columns: dict) -> None:
    """A table of `bench_cases` rows: one line per Problem (its `columns`, each a function of a
    row), one column per implementation with its rate or why it has none (`_missing`)."""
    from rich.console import Console
    from rich.table import Table

    names = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title=f"{title} ({rows[0]['gpu'] if rows else ''})")
    for col in (*columns, *names):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, str]] = {}
    for r in rows:
        key = tuple(column(r) for column in columns.values())
        cell = f"{r['rate']:.0f}" if r["rate"] else _missing(r["note"])
        if r["rate"] and "eager_rate" in r:
            cell += "".join(f" / {r[k]:.0f}" if r[k] else " / -" for k in ("eager_rate", "graph_rate"))
        cells.setdefault(key, {})[r["impl"]] = cell
    for key, row in cells.items():
        table.add_row(*(str(x) for x in key), *(row.get(n, "") for n in names))
    console = Console(width=200)
    console.print(table)
    _print_refusals(console, [(r["impl"], r["note"]) for r in rows])


@bench.command("backward")
@suite_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_backward(dtype, seqlens, head_dims, causal, tokens, hidden, kv_heads, output) -> None:
    """Backward (dQ, dK, dV): TFLOP/s, counted as 2.5x the forward's FLOPs, on the prefill suite;
    tunegen against the backward of SDPA's backends and of FlexAttention."""
    from rich.progress import Progress

    from tunegen.measure.bench import bench_cases
    from tunegen.measure.rows import write_rows
    from tunegen.measure.suites import backward_suite
    from tunegen.tuning.presets import DTYPES

    check_suite(head_dims, hidden, kv_heads)
    _need_gpu()
    problems = backward_suite(seqlens, head_dims, CAUSAL[causal], tokens, hidden, kv_heads, DTYPES[dtype])
    with Progress(transient=True) as progress:
        task = progress.add_task("bench backward", total=None)
        rows = bench_cases(problems, on_row=lambda _: progress.advance(task))
    if output is not None:
        write_rows(rows, output)
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
@click.option("--seqlens", type=COUNTS, default="1024,2048,4096,8192,16384", show_default=True)
@click.option("--causal", type=click.Choice(list(CAUSAL)), default="both", show_default=True)
@click.option(
    "--tokens", type=COUNT, default=16384, show_default=True, help="Prefill tokens per batch: B = tokens / N."
)
@click.option(
    "--hidden", type=COUNT, default=2048, show_default=True, help="Prefill hidden size: H = hidden / 128."
)
@click.option("--batches", type=COUNTS, default="1,16,64", show_default=True, help="Decode batch sizes.")
@click.option("--cache-lengths", type=COUNTS, default="4096,32768", show_default=True)
@click.option(
    "--page-sizes",
    type=PAGE_SIZES,
    default="0,64",
    show_default=True,
    help="Decode cache layouts: 0 is contiguous, others paged with that many tokens a page (multiples "
    "of 16).",
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
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tunegen.measure.bench import bench_cases
    from tunegen.measure.bench_fp8 import bench_fp8_prefill, fp8_speedups, write_fp8_results
    from tunegen.measure.suites import fp8_decode_suite, prefill_suite

    check_suite((128,), hidden)
    _need_gpu()
    shapes = prefill_suite(seqlens, (128,), CAUSAL[causal], tokens, hidden)
    with Progress(transient=True) as progress:
        task = progress.add_task("bench fp8", total=None)
        prefill_rows = bench_fp8_prefill(shapes, on_row=lambda _: progress.advance(task))
        decode_rows = bench_cases(
            fp8_decode_suite(batches, cache_lengths, page_sizes),
            on_row=lambda _: progress.advance(task),
        )
    speedups = fp8_speedups(prefill_rows, decode_rows)
    if output is not None:
        write_fp8_results(prefill_rows, decode_rows, speedups, output)
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
            cell = _missing(r.note)
        cells.setdefault((r.causal, r.seqlen, r.batch, r.heads), {})[r.impl] = cell
    for key, row in cells.items():
        table.add_row(*(str(x) for x in key), *(row.get(n, "") for n in names))
    console.print(table)
    _print_refusals(console, [(r.impl, r.note) for r in prefill_rows])
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
    from tunegen.kernels import peers

    _need_gpu()
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
    tunegen_command = click.get_current_context().find_root().command
    for i, (name, *args) in enumerate(steps, 1):
        click.secho(f"[{i}/{len(steps) + 1}] bench {name}", bold=True)
        args[-1] = str(output / args[-1])
        tunegen_command.main(["bench", name, *args], standalone_mode=False)
    click.secho(f"[{len(steps) + 1}/{len(steps) + 1}] report", bold=True)
    results = [str(output / name) for name in ("prefill.csv", "decode.csv", "backward.csv", "fp8.json")]
    ceilings = ["--ceilings", str(output / "ceilings.json")]
    tunegen_command.main(["report", *results, *ceilings, "-o", str(output / "report")], standalone_mode=False)


@bench.command("ceilings")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_ceilings(output: Path | None) -> None:
    """The roofline's ceilings on this GPU: bf16 and fp8 matmul TFLOP/s, copy TB/s (read + write)."""
    from tunegen.measure import ceilings

    _need_gpu()
    result = ceilings.measure()
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1))
    click.echo(json.dumps(result, indent=1))


@click.command()
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
