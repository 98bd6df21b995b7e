"""`tunegen tune`: find the fastest correct Variant for each Problem of the chosen models on this
GPU (or, without one, tiny shapes under Triton's interpreter) and record it as the Winner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from tunegen.cli.options import CAUSAL, COUNT, COUNTS, PAGE_SIZE, db_option, local_options
from tunegen.cli.text import speed, variant_text, where_time_went
from tunegen.kernels.problem import problem_text

# Compile workers per GPU by default (--workers).
PER_GPU_WORKERS = 16


@click.command()
@click.option(
    "--preset",
    "preset_names",
    multiple=True,
    help="Model to tune for, each kind of attention layer it has (repeatable): llama3-8b, llama3-70b, "
    "mistral-7b (v0.2 and v0.3: no window), mistral-7b-v0.1 (window 4096), qwen2.5-7b, gpt2, gemma2-2b, "
    "gemma2-9b, gemma2-27b, gemma3-1b, gemma3-4b, gemma3-12b, gemma3-27b, gpt-oss-20b, gpt-oss-120b, "
    "llama4-scout.",
)
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    metavar="HEADS,KV_HEADS,HEAD_DIM",
    help="An explicit attention shape (repeatable), e.g. 32,8,128; --window, --chunk, --softcap and --sinks "
    "give it a feature of current models (a cap's value is an argument: Winners serve any).",
)
@local_options
@click.option(
    "--family", type=click.Choice(["prefill", "decode", "backward"]), default="prefill", show_default=True
)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--causal", type=click.Choice(list(CAUSAL)), default="yes", show_default=True)
@click.option(
    "--batches",
    type=COUNTS,
    default="1,16,64",
    show_default=True,
    help="Decode: batch sizes to sweep.",
)
@click.option(
    "--page-size",
    type=PAGE_SIZE,
    default=0,
    show_default=True,
    help="Decode: tokens per page of a paged cache, a multiple of 16 (0: contiguous).",
)
@click.option(
    "--seqlens",
    type=COUNTS,
    default="1024,4096,16384",
    show_default=True,
    help="Sequence lengths to sweep (decode: cache lengths).",
)
@click.option(
    "--tokens",
    type=COUNT,
    default=16384,
    show_default=True,
    help="Prefill and backward: tokens per batch, B = tokens / N.",
)
@click.option(
    "--trials",
    type=click.IntRange(min=1),
    default=40,
    show_default=True,
    help="Variants evaluated per Problem.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds per Problem at most.",
)
@click.option(
    "--sampler", type=click.Choice(["tpe", "random", "grid", "cmaes", "gp"]), default="tpe", show_default=True
)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option(
    "--gpus",
    default=None,
    metavar="all|N|0,2,5",
    help="GPUs to tune on, one process each, sharing the trials: all, the first N, or these indices "
    "(one: '3,'). Default: the current GPU. Under --dry-run, N interpreter stand-ins.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Compile processes in all, spread over the GPUs, at least one each (default: the CPU cores this "
    f"process may use, at most {PER_GPU_WORKERS} per GPU).",
)
@click.option(
    "--trial-timeout",
    type=click.FloatRange(min=0, min_open=True),
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
    "--timeline",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write where each GPU's time went (its GPU, compile workers, waits) to this file, as a "
    "Chrome trace (Perfetto, chrome://tracing) with a per-GPU summary; the summary is printed too.",
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
    window,
    chunk,
    softcap,
    sinks,
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
    gpus,
    workers,
    trial_timeout,
    dry_run,
    timeline,
    fp8,
    db_url,
) -> None:
    """Find the fastest correct Variant for each Problem (each kind of attention layer of each model,
    at each length) on this GPU and record it as the Winner; a Problem its family does not build is
    skipped, with the reason."""
    import os
    import time

    from tunegen.tuning import presets
    from tunegen.tuning import ranks as placement

    models = [_parsed(presets.preset, n, "--preset") for n in preset_names]
    layer = _layer(presets, window, chunk, softcap, sinks, bool(shapes))
    models += [_parsed(lambda text: presets.parse_shape(text, layer), s, "--shape") for s in shapes]
    if not models:
        models = [presets.preset("llama3-8b")]
    _refuse_what_does_not_apply(family, causal, fp8)
    asked = time.time()
    # Asked before the imports below: a child process asks CUDA while this one imports.
    query = None if dry_run else placement.DeviceQuery()

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Table

    # The store's first use, in the run, would load SQLAlchemy's schema and Alembic: here instead.
    import tunegen.tuning_db.store  # noqa: F401
    from tunegen.tuning import host, interrupt
    from tunegen.tuning import timeline as timelines
    from tunegen.tuning.tuner import TuneOptions
    from tunegen.tuning_db import TuningDbError

    devices = [] if query is None else query.result()
    answered = time.time() if query is None else query.answered
    interpret = not devices
    if interpret and trials > presets.DRY_RUN_TRIALS:
        if _given("trials"):
            raise click.BadParameter(
                f"a dry run (no GPU, or --dry-run) evaluates at most {presets.DRY_RUN_TRIALS} Variants "
                f"per Problem, got {trials}",
                param_hint="--trials",
            )
        trials = presets.DRY_RUN_TRIALS
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
        console.print(
            "[yellow]No GPU (or --dry-run): tuning tiny shapes under Triton's interpreter (at most "
            f"{presets.DRY_RUN_TRIALS} trials per Problem); stored as backend 'interpreter', never used "
            "on a GPU.[/yellow]"
        )
    try:
        ranks = _ranks(gpus, devices)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("gpus: "), param_hint="--gpus") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = max(1, (workers or min(PER_GPU_WORKERS * len(ranks), cores)) // len(ranks))
    options = TuneOptions(
        trials=trials,
        timeout=timeout,
        sampler=sampler,
        seed=seed,
        workers=per_rank,
        trial_timeout=trial_timeout,
        url=db_url,
    )
    by_gpu = placement.groups(ranks)
    where = {gpu: f"{gpu.name} ({_devices(members, interpret)})" for gpu, members in by_gpu.items()}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} trials"),
        TextColumn("{task.fields[best]}"),
        TextColumn("{task.fields[peer]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    # Redrawn on each report, by no thread of its own: the ranks (and the workers their zygotes
    # fork) are forked from this process, and a thread writing to the terminal at that moment
    # would leave them the stream's lock held for good.
    with Progress(*columns, console=console, auto_refresh=False) as progress:
        tasks = {
            (gpu, j): progress.add_task(
                problem_text(p.as_dict()) + (f" on {where[gpu]}" if len(ranks) > 1 else ""),
                total=options.trials,
                best="",
                peer="",
            )
            for gpu in by_gpu
            for j, p in enumerate(todo)
        }

        def report(gpu, j, state):
            best = f"best {state['best_rate']:.0f} {state['unit']}" if state["best_rate"] else ""
            peer = f"vs {state['peer_name']} {state['peer_rate']:.0f}" if state["peer_rate"] else ""
            done = min(state["evaluated"], options.trials)
            progress.update(tasks[(gpu, j)], completed=done, best=best, peer=peer, refresh=True)

        def finished(gpu, j, outcome):
            progress.update(tasks[(gpu, j)], completed=options.trials, refresh=True)

        started = time.time()
        launched = min(timelines.process_start() or started, started)
        first = [timelines.Span(timelines.TUNER, timelines.STARTING, "", launched, started)]
        if devices:
            first.append(timelines.Span(timelines.TUNER, timelines.READING_GPUS, "", asked, answered))
        spans: dict[str, list] = {r.name: list(first) for r in ranks}
        try:
            outcomes = host.tune_on(
                todo, ranks, options, report, finished, lambda rank, more: spans[rank].extend(more)
            )
        except (TuningDbError, ValueError, host.HostError) as exc:
            raise click.ClickException(str(exc)) from None
        except interrupt.Interrupted as exc:
            stopped = click.ClickException(
                f"stopped by {exc.name}: the trials this run held are marked failed and queued again; "
                "run the same command to resume"
            )
            stopped.exit_code = exc.exit_code
            raise stopped from None
    first = next(iter(by_gpu))
    names = ", ".join(where.values()) if len(ranks) > 1 else first.name
    table = Table(title=f"tuned on {names} (Triton {first.triton_version})")
    headers = ["problem", "winner", "speed", "best peer", "speedup", "trials", "failed", "recorded", "time"]
    for col in (["gpu"] if len(ranks) > 1 else []) + headers:
        table.add_column(col)
    for (gpu, _), o in sorted(
        outcomes.items(), key=lambda item: (list(by_gpu).index(item[0][0]), item[0][1])
    ):
        w = o.winner
        table.add_row(
            *([where[gpu]] if len(ranks) > 1 else []),
            problem_text(o.problem.as_dict()),
            variant_text(w) if w else (f"skipped: {o.skipped}" if o.skipped else "none found"),
            speed(w) if w else "-",
            f"{w.peer_name} {speed(w, w.peer_ms)}" if w and w.peer_ms else "-",
            f"{w.speedup:.2f}x" if w and w.speedup else "-",
            str(o.evaluated),
            str(o.failed),
            o.recorded or "-",
            f"{o.wall_s:.0f} s",
        )
    console.print(table)
    if timeline or len(ranks) > 1:
        ended = time.time()
        console.print(where_time_went(timelines.summary(spans, launched, ended)))
        if timeline:
            timelines.write(timeline, spans, launched, ended)
            console.print(f"timeline written to {timeline}")


def _given(name: str) -> bool:
    """Whether the option `name` was given (on the command line or in the environment)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def _parsed(parse: Callable[[str], Any], text: str, option: str) -> Any:
    """`parse(text)`, its ValueError a usage error of `option`."""
    try:
        return parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc).split(": ", 1)[-1], param_hint=option) from None


def _layer(
    presets: Any, window: tuple[int, int], chunk: int, softcap: float, sinks: bool, shapes: bool
) -> Any:
    """The layer kind that --window, --chunk, --softcap and --sinks give each --shape; refused
    without a --shape (a preset carries its model's own)."""
    for name in ("window", "chunk", "softcap", "sinks"):
        if _given(name) and not shapes:
            raise click.BadParameter(
                "adds a feature to each --shape; a --preset carries its model's own layer kinds",
                param_hint=f"--{name}",
            )
    return presets.LayerKind(*window, chunk, softcap > 0, sinks)


def _refuse_what_does_not_apply(family: str, causal: str, fp8: bool) -> None:
    """Refuse options given for another family: their values would be silently ignored."""
    if fp8 and family not in ("prefill", "decode"):
        raise click.BadParameter(f"FP8 applies to prefill and decode, not {family}", param_hint="--fp8")
    if family == "decode":
        if _given("tokens"):
            raise click.BadParameter("sets prefill batches; decode sweeps --batches", param_hint="--tokens")
        if causal != "yes":
            raise click.BadParameter(
                f"decode is causal (the new token sees the whole cache), got {causal!r}",
                param_hint="--causal",
            )
        return
    if _given("batches"):
        raise click.BadParameter(
            f"applies to --family decode; {family} batches come from --tokens", param_hint="--batches"
        )
    if _given("page_size"):
        raise click.BadParameter(
            f"applies to --family decode (a paged KV cache), not {family}", param_hint="--page-size"
        )


def _ranks(spec: str | None, devices: list) -> list:
    """The GPUs to tune on: `--gpus` among this host's CUDA `devices` (the first without it),
    or interpreter stand-ins where there are none. Each CUDA one runs in a process of its own,
    which forks its workers (tuning/zygote.py)."""
    from tunegen.kernels.gpu import interpreter_gpu
    from tunegen.tuning import ranks as placement

    if not devices:
        count = 1 if spec in (None, "all") else len(placement.select(spec, 64))
        return [placement.Rank(i, None, interpreter_gpu()) for i in range(count)]
    indices = [0] if spec is None else placement.select(spec, len(devices))
    return placement.cuda_ranks(indices, devices.__getitem__)


def _devices(ranks: list, interpret: bool) -> str:
    indices = ",".join(str(r.index) for r in ranks)
    return f"{len(ranks)} stand-in(s)" if interpret else f"GPU {indices}"
