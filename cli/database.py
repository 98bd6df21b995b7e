"""The tuning database's commands: `tunegen list` and `show` its Winners, `export` them (to JSON
for another machine, or to run without tunegen) and `import` them, and `tunegen db upgrade`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tunegen.cli.options import db_option, opened_store
from tunegen.cli.text import problem_text, speed, variant_text

if TYPE_CHECKING:
    from tunegen.tuning_db import WinnerRecord


@click.command("list")
@db_option
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (its name).")
@click.option("--family", default=None, help="Only this family.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_winners(db_url: str | None, gpu_name: str | None, family: str | None, fmt: str) -> None:
    """List the Winners in the tuning database."""
    from rich.console import Console
    from rich.table import Table

    with opened_store(db_url, readonly=True) as store:
        winners = store.winners(gpu_name=gpu_name, family=family)
    if fmt == "json":
        click.echo(json.dumps([{"id": w.id, "gpu": w.gpu.name, **_entry(w)} for w in winners], indent=1))
        return
    table = Table(title=f"{len(winners)} winners")
    for col in ("id", "gpu", "family", "problem", "variant", "ms", "speed", "vs peer", "triton"):
        table.add_column(col)
    for w in winners:
        table.add_row(
            str(w.id),
            w.gpu.name,
            w.family,
            problem_text(w.problem),
            variant_text(w),
            f"{w.median_ms:.4f}",
            speed(w),
            f"{w.speedup:.2f}x {w.peer_name}" if w.speedup else "-",
            w.triton_version,
        )
    Console(width=220).print(table)


@click.command()
@db_option
@click.argument("winner_id", type=int)
def show(db_url: str | None, winner_id: int) -> None:
    """Show one Winner with its provenance (ids come from `tunegen list`)."""
    import dataclasses

    with opened_store(db_url, readonly=True) as store:
        found = store.winners(winner_id=winner_id)
    if not found:
        raise click.ClickException(f"no winner with id {winner_id}")
    w = found[0]
    click.echo(json.dumps({"id": w.id, "gpu": dataclasses.asdict(w.gpu), **_entry(w)}, indent=2))


def _entry(w: WinnerRecord) -> dict:
    """A Winner as `list` and `show` print it: its exchange entry with only the knobs that apply."""
    from tunegen.kernels.database import applicable_knobs
    from tunegen.tuning_db.exchange import entry

    return {**entry(w), "variant": applicable_knobs(w)}


@click.command("export")
@db_option
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

    with opened_store(db_url, readonly=True) as store:
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
            f"skipped {skipped.winner.family} {problem_text(skipped.winner.problem)}: {skipped.reason}"
        )


@click.command("import")
@db_option
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def import_winners(db_url: str | None, files: tuple[Path, ...]) -> None:
    """Import Winners from exported JSON files; a faster result replaces a slower one."""
    from tunegen.export.json_files import with_every_knob
    from tunegen.tuning_db import import_document

    documents = []
    for path in files:
        try:
            documents.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise click.ClickException(f"{path}: not readable JSON: {exc}") from None
    with opened_store(db_url, readonly=False) as store:
        for path, document in documents:
            try:
                report = import_document(store, with_every_knob(document))
            except ValueError as exc:
                raise click.ClickException(f"{path}: {exc}; nothing from it was imported") from None
            click.echo(
                f"{path}: merged {report.merged}, replaced {report.replaced}, skipped {report.skipped}"
            )


@click.group()
def db() -> None:
    """The tuning database itself."""


@db.command()
@db_option
def upgrade(db_url: str | None) -> None:
    """Create the schema, or upgrade it in place to this release's."""
    with opened_store(db_url, readonly=False) as store:
        before, after = store.upgrade()
        click.echo(f"{store.name}: schema {before or 'none'} -> {after}")
