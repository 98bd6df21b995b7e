"""`tunegen`: the command line. Each command parses, calls the library and prints."""

from __future__ import annotations

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
@click.argument("family", type=click.Choice(["prefill"]))
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

    from tunegen import families
    from tunegen import render as rendering
    from tunegen.gpu import Gpu, gpu_of
    from tunegen.problem import Problem

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


@bench.command("prefill")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--seqlens", callback=_parse_ints, default="512,1024,2048,4096,8192,16384", show_default=True)
@click.option("--head-dims", callback=_parse_ints, default="64,128,256", show_default=True)
@click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True)
@click.option(
    "--tokens", type=int, default=16384, show_default=True, help="Tokens per batch: B = tokens / N."
)
@click.option("--hidden", type=int, default=2048, show_default=True, help="Hidden size: H = hidden / D.")
@click.option("--kv-heads", type=int, default=None, help="Key/value heads (default: as many as query heads).")
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

    from tunegen import bench as benchmarks
    from tunegen import peers

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


if __name__ == "__main__":
    main()
