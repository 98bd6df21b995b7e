"""`tunegen export --format python`: a package that runs the exported Winners with torch and
triton alone. It holds each Winner's rendered Triton source (kernels/), a table from Problem to
kernel (table.json), provenance (provenance.json), tunegen's own checks, keys and fallback
copied from its source (_tunegen/, see vendor.py), and a loader rendered from
templates/export_package/__init__.py.j2 with tunegen's call signatures."""

from __future__ import annotations

import json
import keyword
from pathlib import Path
from typing import Any

from tunegen.export.folders import staged
from tunegen.export.provenance import provenance
from tunegen.export.selection import Selected, Selection, Skipped
from tunegen.export.vendor import stem, vendor
from tunegen.kernels.render import render_text
from tunegen.version import __version__

LOADER_TEMPLATE = "export_package/__init__.py.j2"
SERVED = ("prefill", "decode")

# What the loader uses from tunegen: (module, name, the name the loader calls it).
LIBRARY = (
    ("tunegen.backends", "FallbackError", "FallbackError"),
    ("tunegen.calls.prefill", "PrefillCall", "PrefillCall"),
    ("tunegen.kernels.database", "gpu_record", "gpu_record"),
    ("tunegen.kernels.dispatch", "NEAREST_MAX_DISTANCE", "NEAREST_MAX_DISTANCE"),
    ("tunegen.kernels.dispatch", "StaleWinnerWarning", "StaleWinnerWarning"),
    ("tunegen.kernels.dispatch", "_distance", "distance"),
    ("tunegen.kernels.dispatch", "preference", "preference"),
    ("tunegen.kernels.gpu", "Gpu", "Gpu"),
    ("tunegen.kernels.gpu", "gpu_of", "gpu_of"),
    ("tunegen.kernels.problem", "Problem", "Problem"),
    ("tunegen.kernels.render", "interpreting", "interpreting"),
    ("tunegen.tuning_db.records", "GpuRecord", "GpuRecord"),
    ("tunegen.tuning_db.records", "features_key", "features_key"),
)
# The launcher the kernels import (templates/_attention.j2, launcher_import), which the package
# carries as _tunegen/launcher.py.
KERNEL_IMPORT = "from tunegen.kernels import launcher\n"
LAUNCHER = (
    "tunegen.kernels.launcher",
    ("bound", "device_properties", "key_of", "memoized", "rebased", "stream_of", "workspace"),
)
DECODE_LIBRARY = (
    ("tunegen.calls.decode", "DecodeCall", "DecodeCall"),
    ("tunegen.decode", "checking", "checking"),
)


def kernel_module(selected: Selected) -> str:
    """The kernels/ module a Winner's source goes to: its family and source hash."""
    return f"{selected.winner.family}_{selected.rendered.digest}"


def table_entry(selected: Selected) -> dict[str, Any]:
    """One row of table.json: the Problem and GPU it serves, the kernel, and the Winner's record."""
    w = selected.winner
    return {
        "gpu": {
            "name": w.gpu.name,
            "capability": w.gpu.capability,
            "sm_count": w.gpu.sm_count,
            "smem_per_block": w.gpu.smem_per_block,
            "backend": w.gpu.backend,
        },
        "family": w.family,
        "problem": w.problem,
        "module": kernel_module(selected),
        "variant": selected.variant.as_dict(),
        "median_ms": w.median_ms,
        "tflops": w.tflops,
        "gbps": w.gbps,
        "rel_err": w.rel_err,
        "triton_version": w.triton_version,
        "torch_version": w.torch_version,
        "tuned_template_hash": w.template_hash,
        "created_at": w.created_at.isoformat(timespec="seconds"),
    }


def kernel_source(selected: Selected) -> str:
    """A Winner's rendered source as the package holds it: importing the package's launcher."""
    source = selected.rendered.source
    if KERNEL_IMPORT not in source:
        raise ValueError(f"kernel {kernel_module(selected)}: its source lacks {KERNEL_IMPORT.strip()!r}")
    return source.replace(KERNEL_IMPORT, "from .._tunegen import launcher\n", 1)


def write_package(
    selection: Selection, output: Path, package: str, *, replace: bool = False
) -> tuple[Path, Selection]:
    """Write the package `package` into `output` (an earlier export of that name only with
    `replace`); returns its folder and the selection it holds (Winners of families it cannot serve
    moved to skipped)."""
    if not package.isidentifier() or keyword.iskeyword(package):
        raise ValueError(f"package: expected a Python identifier such as tunegen_kernels, got {package!r}")
    served = [s for s in selection.selected if s.winner.family in SERVED]
    skipped = [*selection.skipped] + [
        Skipped(s.winner, f"the exported loader serves {' and '.join(SERVED)}")
        for s in selection.selected
        if s.winner.family not in SERVED
    ]
    if not served:
        raise ValueError(f"no winners to export: the exported loader serves {' and '.join(SERVED)}")
    families = sorted({s.winner.family for s in served})
    library = LIBRARY + (DECODE_LIBRARY if "decode" in families else ())
    header = f"Written by `tunegen export` (tunegen {__version__}); regenerate rather than edit."
    info = provenance("python", [s.winner for s in served], [LOADER_TEMPLATE, *(s.template for s in served)])
    files = {
        "__init__.py": render_text(
            LOADER_TEMPLATE,
            package=package,
            provenance=info,
            families=families,
            library=sorted((stem(module), name, alias) for module, name, alias in library),
        ),
        "provenance.json": json.dumps(info, indent=1, sort_keys=True) + "\n",
        "table.json": json.dumps([table_entry(s) for s in served], indent=1, sort_keys=True) + "\n",
        "kernels/__init__.py": '"""The exported kernels, one rendered Triton source per Winner."""\n',
        "_tunegen/__init__.py": '"""What the loader needs from tunegen, copied from its source."""\n',
    }
    roots: dict[str, list[str]] = {}
    for module, name, _ in library:
        roots.setdefault(module, []).append(name)
    roots.setdefault(LAUNCHER[0], []).extend(LAUNCHER[1])
    for name, source in vendor(roots, header=header).items():
        files[f"_tunegen/{name}.py"] = source
    for s in served:
        files[f"kernels/{kernel_module(s)}.py"] = kernel_source(s)
    with staged(output / package, replace=replace, whole_folder=True) as staging:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)
    return output / package, Selection(served, skipped)
