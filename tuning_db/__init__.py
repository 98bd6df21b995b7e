"""The tuning store (installed as tunegen.tuning_db): Winners, failed Variants and Optuna's
studies behind one SQLAlchemy URL, schema migrations, JSON exchange, shipped winners."""

from tunegen.tuning_db.database import head_revision
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
from tunegen.tuning_db.shipped import load_shipped, shipped_store
from tunegen.tuning_db.store import Store

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
