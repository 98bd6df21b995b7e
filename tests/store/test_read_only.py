"""A read-only database: opening it to write (what `tunegen tune` does first) stops with a clear
error naming it, instead of Optuna's traceback mid-run; and a read-only database file, or a
WAL-mode database in a folder that cannot be written (no -shm file can be made beside it), can
still be listed and its Winners served by dispatch. Root ignores file modes, so the read-only
file and folder are made with `chattr +i` (the test is skipped where that is not allowed)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from store_records import GOOD, dispatch_snapshot
from tunegen.cli.main import main
from tunegen.tuning_db import Store, TuningDbError


@pytest.fixture
def freeze() -> Iterator[Callable[[Path], None]]:
    """Make a file or folder immutable (not even root may write it) until the test ends."""
    frozen: list[Path] = []

    def make(path: Path) -> None:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not allowed here: {done.stderr.strip()}")
        frozen.append(path)

    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    yield make
    for path in reversed(frozen):
        subprocess.run(["chattr", "-i", str(path)], check=True)


def database(folder: Path) -> str:
    """A WAL-mode database in `folder` holding GOOD, closed (no -wal or -shm file left)."""
    folder.mkdir()
    url = f"sqlite:///{folder / 'tunegen.db'}"
    with Store(url) as store:
        store.record_winner(GOOD)
    assert sorted(p.name for p in folder.iterdir()) == ["tunegen.db"]
    return url


def served(url: str, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The Problems of the user's Winners dispatch serves from `url` (no warning allowed)."""
    with dispatch_snapshot(url, monkeypatch) as (_, taken):
        return [w.problem for w in taken.user]


def listed(url: str) -> str:
    result = CliRunner().invoke(main, ["list", "--db", url])
    assert result.exit_code == 0, f"{result.output}{result.exception!r}"
    return result.output


def test_tune_stops_with_a_clear_error_on_a_read_only_database(tmp_path):
    path = tmp_path / "tunegen.db"
    Store(f"sqlite:///{path}").close()
    ro = f"sqlite:///file:{path}?mode=ro&uri=true"
    with pytest.raises(TuningDbError, match="cannot open it for writing: it is read-only"):
        Store(ro)
    args = ["tune", "--dry-run", "--shape", "2,1,16", "--seqlens", "32", "--trials", "1", "--db", ro]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    assert "tunegen.db" in result.output and "it is read-only" in result.output


def test_a_read_only_database_file_is_listed_and_served(tmp_path, freeze, monkeypatch):
    url = database(tmp_path / "db")
    freeze(tmp_path / "db" / "tunegen.db")
    with pytest.raises(TuningDbError, match="cannot open it for writing: it is read-only"):
        Store(url)
    assert "1 winners" in listed(url)
    assert served(url, monkeypatch) == [GOOD.problem]


def test_a_wal_database_in_a_read_only_folder_is_listed_and_served(tmp_path, freeze, monkeypatch):
    url = database(tmp_path / "db")
    freeze(tmp_path / "db")
    with Store(url, readonly=True) as store:
        assert [w.problem for w in store.winners()] == [GOOD.problem]
    assert "1 winners" in listed(url)
    assert served(url, monkeypatch) == [GOOD.problem]
    with pytest.raises(TuningDbError, match=r"cannot open it for writing: .*is its folder read-only"):
        Store(url)
    assert sorted(p.name for p in (tmp_path / "db").iterdir()) == ["tunegen.db"]


def test_a_read_only_folder_whose_log_holds_changes_is_refused_clearly(tmp_path, freeze):
    """Reading such a database as immutable would miss the log's changes: a clear error instead."""
    url = database(tmp_path / "db")
    (tmp_path / "db" / "tunegen.db-wal").write_bytes(b"\0" * 4096)
    freeze(tmp_path / "db")
    with pytest.raises(
        TuningDbError, match=r"its folder is read-only and its write-ahead log .* holds changes"
    ):
        Store(url, readonly=True)
