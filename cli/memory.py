"""`tunegen memory`: the memory calculator for a model preset, its numbers overridable."""

from __future__ import annotations

import json

import click

from tunegen.cli.options import COUNT, check_kv_heads


@click.command()
@click.option(
    "--preset",
    default="llama2-70b",
    show_default=True,
    help="llama2-70b, llama2-7b, llama3-8b, llama3-70b, mistral-7b, qwen2.5-7b, gpt2.",
)
@click.option("--layers", type=COUNT, default=None, help="Layers (default: the preset's).")
@click.option("--heads", type=COUNT, default=None, help="Query heads (default: the preset's).")
@click.option(
    "--kv-heads",
    type=COUNT,
    default=None,
    help="Key/value heads, a divisor of the query heads (default: the preset's).",
)
@click.option("--head-dim", type=COUNT, default=None, help="Head dimension (default: the preset's).")
@click.option("--seqlen", type=COUNT, default=4096, show_default=True)
@click.option("--batch", type=COUNT, default=1, show_default=True)
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
    check_kv_heads(model.heads, model.kv_heads)
    try:
        result = calc.report(model, seqlen=seqlen, batch=batch, dtype=dtype)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(
        json.dumps(dataclasses.asdict(result), indent=1) if fmt == "json" else calc.render_text(result)
    )
