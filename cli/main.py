"""`tunegen`: the command line's entry point, the group that each command module's commands join.
Each command parses, calls the library and prints."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

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


def run() -> None:
    """The `tunegen` program: `main`, then, once its threads are joined, its exit handlers run and
    its output flushed, an exit that skips the interpreter's teardown of the modules it imported
    (torch's above all: 0.6-0.9 s of each `tunegen tune` on 2 x H200, 2026-11-26). An exception
    other than an exit propagates as usual."""
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what the interpreter's own exit does first, then the handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run()
