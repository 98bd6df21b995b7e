"""`tunegen export --format json`: one readable, diffable file of Winners per GPU (sorted keys,
one field a line), in the format `tunegen import` reads, with the export's provenance."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tunegen.export.provenance import provenance
from tunegen.export.selection import no_winners, wanted_families
from tunegen.kernels.families import get
from tunegen.tuning_db import Store, export_documents, parse_document


def write_json(
    store: Store, output: Path, *, gpu_name: str | None = None, families: Sequence[str] = ()
) -> dict[Path, int]:
    """Write one file per GPU into `output`; returns each file with its number of Winners."""
    wanted = wanted_families(families)
    written = {}
    for name, document in sorted(export_documents(store, gpu_name=gpu_name).items()):
        document["winners"] = [e for e in document["winners"] if e["family"] in wanted]
        if not document["winners"]:
            continue
        present = {e["family"] for e in document["winners"]}
        document["provenance"] = provenance(
            "json", parse_document(document), (get(f).template for f in present)
        )
        output.mkdir(parents=True, exist_ok=True)
        path = output / name
        path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        written[path] = len(document["winners"])
    if not written:
        raise no_winners(gpu_name, wanted)
    return written
