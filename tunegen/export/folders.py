"""Where exports land. An export is written into a staging folder first and moved into its target
only once whole, so a failed export changes nothing. Each export lists the files it wrote in the
target (MANIFEST); an earlier export is replaced only when asked, and then exactly the files it
listed are removed: a file that no export wrote is never deleted nor overwritten."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from tunegen.export.provenance import FORMAT

MANIFEST = ".tunegen-export"
MANIFEST_FORMAT = "tunegen-export-files"


def is_export(folder: Path) -> bool:
    """Whether `folder` holds an export of an older tunegen (its provenance.json says so)."""
    try:
        return json.loads((folder / "provenance.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def written_files(folder: Path) -> list[str] | None:
    """The files (relative POSIX paths) an earlier export listed as written into `folder`, or None
    where no export did."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"] if data.get("format") == MANIFEST_FORMAT else None
    except (OSError, ValueError, AttributeError, KeyError):
        files = None
    if not isinstance(files, list) or not all(_inside(f) for f in files):
        raise ValueError(
            f"output: {path} is not a list of exported files this tunegen can read, so it cannot tell "
            "which files to replace; remove the earlier export yourself or choose another folder"
        )
    return files


def _inside(name: object) -> bool:
    """Whether a manifest entry names a file inside its folder (no absolute path, no "..")."""
    if not isinstance(name, str) or not name or name == MANIFEST:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and "\\" not in name


@contextlib.contextmanager
def staged(target: Path, *, replace: bool, whole_folder: bool) -> Iterator[Path]:
    """A fresh folder to write an export into; when the block ends without an error, its files
    move into `target` (made if needed) and are listed there. `target` may hold an earlier export
    only with `replace`; a file the export writes may not exist there unless that export wrote
    it; with `whole_folder` (the export owns the folder: a package, an AOT tree) `target` must
    otherwise be absent or empty. Any refusal comes before anything is written."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"output: {target} is a file, not a folder; choose a folder")
    earlier = written_files(target) if target.is_dir() else None
    if earlier is not None and not replace:
        raise ValueError(
            f"output: {target} holds an earlier tunegen export; pass --replace (replace=True) to replace "
            "it: only the files it wrote are removed"
        )
    if earlier is None and whole_folder and target.is_dir() and any(target.iterdir()):
        if is_export(target):
            raise ValueError(
                f"output: {target} holds an export of an older tunegen, which kept no list of the files "
                "it wrote; remove it yourself or choose another folder"
            )
        raise ValueError(f"output: {target} exists and is not a tunegen export; choose another folder")
    made = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    try:
        with _writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            beside = target if target.is_dir() else target.parent
            staging = Path(tempfile.mkdtemp(prefix=".tunegen-staging-", dir=beside))
        try:
            yield staging
            files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
            taken = [f for f in files if (target / f).exists() and f not in (earlier or ())]
            if taken:
                raise ValueError(
                    f"output: {target / taken[0]} exists and no earlier export wrote it; choose another "
                    "folder (nothing was written)"
                )
            with _writing(target):
                _move_in(staging, target, files, earlier or [])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        for folder in made:  # the folders made for the export, deepest first, if left empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _move_in(staging: Path, target: Path, files: list[str], earlier: list[str]) -> None:
    """Move the staged `files` into `target` and remove the `earlier` export's other files. The
    listing covers both while they move, so that an interrupted move leaves no file unlisted."""
    if not target.exists():
        _list(staging, files)
        staging.rename(target)
        return
    _list(target, sorted(set(files) | set(earlier)))
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, target / name)
    for name in sorted(set(earlier) - set(files)):
        (target / name).unlink(missing_ok=True)
        folder = (target / name).parent
        while folder != target and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    _list(target, files)


def _list(folder: Path, files: list[str]) -> None:
    (folder / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n")


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[None]:
    """A folder that cannot be written (permissions, a file in the way, a full disk) as a
    ValueError naming the output."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ValueError(
            f"output: cannot write the export into {target}: {exc.strerror or exc}{where}; choose a "
            "folder you can write"
        ) from None
