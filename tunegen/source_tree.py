"""Code run from a clone without installing behaves as installed.

pyproject.toml installs the repository's top-level rooms `cli/`, `templates/` and `tuning_db/`
as `tunegen.cli`, `tunegen.templates` and `tunegen.tuning_db`. Imported from a source tree (the
clone's folder on PYTHONPATH, say), `tunegen` finds those folders under the same names; an
installed copy, or an editable install's own mapping, goes first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOMS = {"tunegen.cli": "cli", "tunegen.templates": "templates", "tunegen.tuning_db": "tuning_db"}


class SourceRooms(importlib.abc.MetaPathFinder):
    """Finds tunegen's top-level rooms in the repository `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = ROOMS.get(name)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)]
        )


def install(package_dir: Path) -> None:
    """Add the finder when `package_dir` (tunegen's own folder) sits in a source tree."""
    root = package_dir.parent
    if not (root / "pyproject.toml").is_file():
        return
    if not all((root / folder / "__init__.py").is_file() for folder in ROOMS.values()):
        return
    if not any(isinstance(f, SourceRooms) for f in sys.meta_path):
        sys.meta_path.append(SourceRooms(root))


install(Path(__file__).resolve().parent)
