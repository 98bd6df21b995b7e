"""The winners shipped inside the package: per-GPU JSON files in `shipped/`, loaded read-only
into an in-memory database the first time a lookup needs them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tunegen.tuning_db.exchange import parse_document
from tunegen.tuning_db.store import Store

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def load_shipped(folder: Path = SHIPPED_DIR) -> Store:
    """An in-memory store holding every shipped winner (empty if none are shipped)."""
    store = Store("sqlite://")
    for path in sorted(folder.glob("*.json")):
        try:
            store.record_winners(parse_document(json.loads(path.read_text())))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    store.readonly = True
    return store


@functools.cache
def shipped_store() -> Store:
    """The shipped winners, loaded once per process."""
    return load_shipped()
