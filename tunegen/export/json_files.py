"""`tunegen export --format json`: one readable, diffable file of Winners per GPU (sorted keys,
one field a line), in the format `tunegen import` reads, with the export's provenance. Each
Variant holds the knobs that apply to its Problem on its GPU (tunegen.kernels.database
.applicable_knobs); the others are at their defaults, which `tunegen import` fills back in. Rows
that `tunegen import` would refuse (of another release, or edited by hand) are left out, with the
reason, so that every file written imports whole."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tunegen.export.folders import staged
from tunegen.export.provenance import provenance
from tunegen.export.selection import Skipped, no_winners, wanted_families
from tunegen.kernels.database import applicable_knobs, checked_winner
from tunegen.kernels.families import get
from tunegen.tuning_db import Store, documents, parse_document


def write_json(
    store: Store,
    output: Path,
    *,
    gpu_name: str | None = None,
    families: Sequence[str] = (),
    replace: bool = False,
) -> tuple[dict[Path, int], list[Skipped]]:
    """Write one file per GPU into the folder `output` (an earlier export there only with
    `replace`); returns each file with its number of Winners, and the Winners left out."""
    wanted = wanted_families(families)
    kept, skipped = [], []
    for w in store.winners(gpu_name=gpu_name):
        if families and w.family not in wanted:
            continue
        try:
            kept.append(checked_winner(w))
        except ValueError as exc:
            skipped.append(Skipped(w, f"tunegen import would refuse it: {exc}"))
    texts = {}
    for name, document in sorted(documents(kept).items()):
        winners = parse_document(document)
        for e, w in zip(document["winners"], winners, strict=True):
            e["variant"] = applicable_knobs(w) or e["variant"]
        present = {e["family"] for e in document["winners"]}
        document["provenance"] = provenance("json", winners, (get(f).template for f in present))
        texts[name] = (json.dumps(document, indent=1, sort_keys=True) + "\n", len(winners))
    if not texts:
        raise no_winners(gpu_name, wanted, skipped)
    with staged(output, replace=replace, whole_folder=False) as staging:
        for name, (text, _) in texts.items():
            (staging / name).write_text(text)
    return {output / name: count for name, (_, count) in texts.items()}, skipped
