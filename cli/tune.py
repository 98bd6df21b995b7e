"""`tunegen tune`: find the fastest correct Variant for each Problem of the chosen models on this
GPU (or, without one, tiny shapes under Triton's interpreter) and record it as the Winner."""

from __future__ import annotations

import click

from tunegen.cli.options import CAUSAL, db_option, parse_ints
from tunegen.cli.text import problem_text, speed, variant_text


@click.command()
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
@click.option("--causal", type=click.Choice(list(CAUSAL)), default="yes", show_default=True)
@click.option(
    "--batches",
    callback=parse_ints,
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
    callback=parse_ints,
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
@db_option
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
    todo = presets.problems(
        models,
        dtype=presets.DTYPES[dtype],
        causal=CAUSAL[causal],
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
                label = problem_text(problem.as_dict())
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
            problem_text(o.problem.as_dict()),
            variant_text(w.variant) if w else "none found",
            speed(w) if w else "-",
            f"{w.peer_name} {speed(w, w.peer_ms)}" if w and w.peer_ms else "-",
            f"{w.speedup:.2f}x" if w and w.speedup else "-",
            str(o.evaluated),
            str(o.failed),
            o.recorded or "-",
            f"{o.wall_s:.0f} s",
        )
    console.print(table)
