"""The tuning store (installed as tunegen.tuning_db): Winners, failed Variants and Optuna's
studies behind one SQLAlchemy URL, schema migrations, JSON exchange, shipped winners.

What needs SQLAlchemy or Alembic (the store, its schema, the shipped winners) loads on first use:
`import tunegen` is 0.6 s shorter without them (an H200 host, 2026-11-26), and `tunegen tune`
imports them while its child process asks CUDA for the host's devices."""

import importlib
from typing import TYPE_CHECKING, Any

from tunegen.tuning_db.errors import TuningDbError
from tunegen.tuning_db.exchange import (
    ImportReport,
    documents,
    export_documents,
    import_document,
    parse_document,
    record_imported,
)
from tunegen.tuning_db.records import FailureRecord, GpuRecord, WinnerRecord

if TYPE_CHECKING:
    from tunegen.tuning_db.database import head_revision
    from tunegen.tuning_db.shipped import load_shipped, shipped_store
    from tunegen.tuning_db.store import Store

# The names loaded on first use, and the module of this package each comes from.
_ON_USE = {
    "Store": "store",
    "head_revision": "database",
    "load_shipped": "shipped",
    "shipped_store": "shipped",
}


def __getattr__(name: str) -> Any:
    if name not in _ON_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_USE})


__all__ = [
    "FailureRecord",
    "GpuRecord",
    "ImportReport",
    "Store",
    "TuningDbError",
    "WinnerRecord",
    "documents",
    "export_documents",
    "head_revision",
    "import_document",
    "load_shipped",
    "parse_document",
    "record_imported",
    "shipped_store",
]
