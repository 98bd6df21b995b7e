"""Exports that ship tuned kernels without tunegen: a standalone Python package (python), one
configuration file per GPU (json), or ahead-of-time compiled cubins with C launchers (aot). Each
carries its provenance; one table holds one GPU's Winners unless mixing is asked for."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from tunegen.export.selection import Skipped, select
from tunegen.tuning_db import Store

FORMATS = ("json", "python", "aot")


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What an export wrote (each file or folder with its number of Winners) and left out."""

    written: dict[Path, int]
    skipped: list[Skipped]


def export(
    store: Store,
    fmt: str,
    output: Path,
    *,
    gpu_name: str | None = None,
    families: Sequence[str] = (),
    package: str = "tunegen_kernels",
    allow_mixed_gpus: bool = False,
    replace: bool = False,
) -> ExportReport:
    """Export the Winners in `store` (of `families` on the GPU `gpu_name`, by default all) as `fmt`
    into the folder `output`. An earlier export there is replaced only with `replace`, and then
    only the files it wrote are removed (tunegen.export.folders)."""
    if fmt == "json":
        from tunegen.export.json_files import write_json

        return ExportReport(*write_json(store, output, gpu_name=gpu_name, families=families, replace=replace))
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {fmt!r}")
    selection = select(store, gpu_name=gpu_name, families=families, allow_mixed_gpus=allow_mixed_gpus)
    if fmt == "python":
        from tunegen.export.python_package import write_package

        root, kept = write_package(selection, output, package, replace=replace)
        return ExportReport({root: len(kept.selected)}, kept.skipped)
    from tunegen.export.aot import write_aot

    manifest, kept = write_aot(selection, output, replace=replace)
    return ExportReport({manifest: len(kept.selected)}, kept.skipped)
