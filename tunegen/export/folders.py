"""Export folders are written whole or not at all: into a staging folder beside the target, which
then replaces the target (absent, empty, or an earlier tunegen export; anything else is refused)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tunegen.export.provenance import FORMAT


def is_export(folder: Path) -> bool:
    """Whether `folder` holds an earlier export (its provenance.json says so)."""
    try:
        return json.loads((folder / "provenance.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A fresh folder to write an export into; on success it replaces `target`, on error it goes."""
    if target.exists() and any(target.iterdir()) and not is_export(target):
        raise ValueError(f"output: {target} exists and is not a tunegen export; choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
