"""`tunegen`: the command line's entry point, the group that each command module's commands join.
Each command parses, calls the library and prints."""

from __future__ import annotations

import click

import tunegen
from tunegen.cli import bench, database, doctor, memory, render, tune


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tunegen.__version__, prog_name="tunegen")
def main() -> None:
    """Autotuned Triton attention kernels: tune them on this GPU into the database that dispatch
    serves Winners from, bench them against their peers and report; inspect, export and import that
    database; render a kernel's source, size attention's memory, and check the setup (doctor)."""


for command in (
    tune.tune,
    bench.bench,
    bench.report,
    database.list_winners,
    database.show,
    database.export_winners,
    database.import_winners,
    database.db,
    render.render,
    memory.memory,
    doctor.doctor,
):
    main.add_command(command)


if __name__ == "__main__":
    main()
