"""`tunegen doctor`: what this machine and its database hold, and where dispatch falls back."""

from __future__ import annotations

import json

import click

from tunegen.cli.options import db_option


@click.command()
@db_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def doctor(db_url: str | None, fmt: str) -> None:
    """The GPU, versions, database, winners for this GPU, stale ones, and dispatch's fallbacks for
    each family (FP8 apart) with winners for this GPU (prefill where none has)."""
    from tunegen.measure.doctor import render_text, report

    result = report(db_url)
    click.echo(json.dumps(result, indent=1) if fmt == "json" else render_text(result))
