"""`tunegen export --format json`: one readable, diffable file of Winners per GPU (sorted keys,
one field a line), in the format `tunegen import` reads, with the export's provenance. Each
Variant holds the knobs that apply to its Problem on its GPU (tunegen.kernels.database
.applicable_knobs); the others are at their defaults, which `from_json` fills back in."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tunegen.export.provenance import provenance
from tunegen.export.selection import no_winners, wanted_families
from tunegen.kernels.database import applicable_knobs
from tunegen.kernels.families import FAMILIES, get
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
        winners = parse_document(document)
        for e, w in zip(document["winners"], winners, strict=True):
            e["variant"] = applicable_knobs(w)
        present = {e["family"] for e in document["winners"]}
        document["provenance"] = provenance("json", winners, (get(f).template for f in present))
        output.mkdir(parents=True, exist_ok=True)
        path = output / name
        path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        written[path] = len(document["winners"])
    if not written:
        raise no_winners(gpu_name, wanted)
    return written


def with_every_knob(document: Any) -> Any:
    """An exported document for `tunegen import`: each Variant that this release can read is
    completed with the knobs the export left at their defaults, so the store holds whole
    Variants as tuning records them. Anything it cannot read stays as it is, for the import's
    own checks to name."""
    if not isinstance(document, dict) or not isinstance(document.get("winners"), list):
        return document
    entries = []
    for e in document["winners"]:
        if isinstance(e, dict) and e.get("family") in FAMILIES and isinstance(e.get("variant"), dict):
            with contextlib.suppress(TypeError, ValueError):
                e = {
                    **e,
                    "variant": get(e["family"]).variant_type.from_json(json.dumps(e["variant"])).as_dict(),
                }
        entries.append(e)
    return {**document, "winners": entries}
