"""The tuning database's commands: `tunegen list` and `show` its Winners, `export` them (to JSON
for another machine, or to run without tunegen) and `import` them, and `tunegen db upgrade`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tunegen.cli.options import db_option, opened_store
from tunegen.cli.text import speed, variant_text
from tunegen.kernels.problem import problem_text

if TYPE_CHECKING:
    from tunegen.tuning_db import WinnerRecord


@click.command("list")
@db_option
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (its name).")
@click.option("--family", default=None, help="Only this family.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_winners(db_url: str | None, gpu_name: str | None, family: str | None, fmt: str) -> None:
    """List the Winners in the tuning database, and the rows this tunegen cannot serve and why."""
    from rich.console import Console
    from rich.table import Table

    from tunegen.kernels.database import unusable

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
    for w in winners:
        reason = unusable(w)
        if reason:
            click.echo(f"unusable: id {w.id} cannot be served by this tunegen (dispatch skips it): {reason}")


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
    """A Winner as `list` and `show` print it: its exchange entry with only the knobs that apply,
    and why dispatch cannot serve it (null when it can)."""
    from tunegen.kernels.database import applicable_knobs, unusable
    from tunegen.tuning_db.exchange import entry

    return {**entry(w), "variant": applicable_knobs(w), "unusable": unusable(w)}


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
@click.option(
    "--replace",
    is_flag=True,
    help="Replace an earlier export there: only the files it wrote are removed, never others.",
)
def export_winners(
    db_url: str | None,
    fmt: str,
    output: Path,
    gpu_name: str | None,
    families: tuple[str, ...],
    package: str,
    allow_mixed_gpus: bool,
    replace: bool,
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
            replace=replace,
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
    """Import Winners from exported JSON files; a faster result replaces a slower one. Every file
    is checked first, each Problem and Variant rebuilt and checked against its family: one bad
    entry refuses its file, and then nothing is imported."""
    from tunegen.kernels.database import check_document
    from tunegen.tuning_db import record_imported

    checked = []
    for path in files:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            checked.append((path, check_document(document)))
        except UnicodeDecodeError as exc:
            raise click.ClickException(
                f"{path}: not UTF-8 text (byte {exc.start}); an export is UTF-8 JSON; nothing was imported"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise click.ClickException(f"{path}: not readable JSON: {exc}; nothing was imported") from None
        except ValueError as exc:
            raise click.ClickException(f"{path}: {exc}; nothing was imported") from None
    with opened_store(db_url, readonly=False) as store:
        for path, winners in checked:
            report = record_imported(store, winners)
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
