"""Opening a tuning database: its URL, the engine (SQLite's pragmas and up-front write locks,
PostgreSQL's lock timeout), transactions, the driver's errors as TuningDbError saying what to do,
and the schema checked against this release's Alembic migrations and upgraded where allowed."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from tunegen.tuning_db.errors import TuningDbError
from tunegen.tuning_db.models import TABLES

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "tunegen_alembic_version"
LOCK_TIMEOUT_S = 30.0
SUPPORTED = ("sqlite", "postgresql")
_PG_MIGRATION_LOCK = 7_243_501

D = TypeVar("D", bound="Database")


def _alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest schema revision this release knows."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def _known_revisions() -> set[str]:
    return {script.revision for script in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}


class Database:
    """A tuning database behind one URL, opened at this release's schema (read-only, possibly
    empty), with its read and write transactions; Store adds the records and queries."""

    def __init__(self, url: str, *, readonly: bool = False, lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        try:
            self.url = sa.engine.make_url(url)
        except sa_exc.ArgumentError as exc:
            raise TuningDbError(f"database URL {url!r} is not a SQLAlchemy URL: {exc}") from None
        self.name = self.url.render_as_string(hide_password=True)
        self.readonly = readonly
        self.lock_timeout = lock_timeout
        backend = self.url.get_backend_name()
        if backend not in SUPPORTED:
            raise TuningDbError(f"{self.name}: {backend} is not supported; use SQLite or PostgreSQL")
        # Read-only, a database that does not exist yet (or has no schema) is simply empty.
        self.empty = False
        self.found_revision: str | None = None
        if readonly and backend == "sqlite" and self._sqlite_path() is not None:
            self.empty = not self._sqlite_path().exists()
        self.engine = self._create_engine()
        if self.empty:
            return
        try:
            self._open()
        except BaseException:
            self.engine.dispose()
            raise

    def _open(self) -> None:
        """Check the schema (upgrading it and proving a write goes through, unless read-only). A
        SQLite file in WAL mode whose folder cannot be written (no -shm file can be made) is read
        as immutable instead, unless its write-ahead log holds changes that reading would miss."""
        try:
            self._check_schema(upgrade=not self.readonly)
        except TuningDbError as exc:
            path = self._sqlite_path() if self.readonly else None
            if path is None or "unable to open database file" not in str(exc.__cause__):
                raise
            wal = path.with_name(path.name + "-wal")
            if wal.exists() and wal.stat().st_size > 0:
                raise TuningDbError(
                    f"{self.name}: cannot read it: its folder is read-only and its write-ahead log {wal} "
                    "holds changes not yet in the database; open it once where its folder is writable "
                    "(any tunegen command folds them in)"
                ) from exc
            self.engine.dispose()
            self.url = sa.engine.URL.create(
                "sqlite",
                database=f"file:{urllib.parse.quote(str(path.resolve()))}",
                query={"mode": "ro", "immutable": "1", "uri": "true"},
            )
            self.engine = self._create_engine()
            self._check_schema(upgrade=False)

    # -- connection ------------------------------------------------------------------------

    def _sqlite_path(self) -> Path | None:
        """The file behind a SQLite URL (None in memory), also for `file:` URIs."""
        database = self.url.database or ""
        if self.url.query.get("uri") in ("true", "1"):
            database = database.removeprefix("file:")
        return None if database in ("", ":memory:") else Path(database).expanduser()

    def _create_engine(self) -> Engine:
        if self.url.get_backend_name() == "postgresql":
            timeout_ms = int(self.lock_timeout * 1000)
            try:
                return sa.create_engine(
                    self.url, pool_pre_ping=True, connect_args={"options": f"-c lock_timeout={timeout_ms}"}
                )
            except ImportError as exc:
                raise TuningDbError(
                    f"{self.name}: no PostgreSQL driver for this URL ({exc}); install tunegen's "
                    "postgres extra, pip install 'tunegen[postgres]', and name its driver in the URL: "
                    "postgresql+psycopg://user@host/database"
                ) from None
        path = self._sqlite_path()
        memory = path is None
        if path is not None and not self.readonly:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TuningDbError(
                    f"{self.name}: cannot make its folder {path.parent}: {exc.strerror or exc}; point "
                    "TUNEGEN_DB (or --db) at a database in a folder you can write"
                ) from None
        engine = sa.create_engine(
            self.url,
            connect_args={"timeout": self.lock_timeout, "check_same_thread": False},
            poolclass=sa.pool.StaticPool if memory else None,
        )

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # SQLAlchemy issues BEGIN itself (below), so that writers take the lock up front.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            if not memory and not self.readonly:
                with contextlib.suppress(Exception):  # a read-only file keeps its journal mode
                    cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _on_begin(connection: Connection) -> None:
            write = connection.get_execution_options().get("tunegen_write", False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Turn the driver's errors into TuningDbError saying which database and what to do."""
        try:
            yield
        except TuningDbError:
            raise
        except sa_exc.DBAPIError as exc:
            message = str(exc.orig) if exc.orig is not None else str(exc)
            lowered = message.lower()
            if "locked" in lowered or "lock timeout" in lowered:
                hint = f"another process held it locked for more than {self.lock_timeout:g} s; try again"
            elif "readonly" in lowered or "read-only" in lowered:
                hint = "it is read-only; point TUNEGEN_DB (or --db) at a writable database"
            elif "unable to open database file" in lowered:
                hint = (
                    "SQLite cannot open it or make its files beside it (is its folder read-only?); point "
                    "TUNEGEN_DB (or --db) at a database in a folder you can write"
                )
            elif "not a database" in lowered or "malformed" in lowered:
                hint = "the file is not a SQLite database (or is damaged); nothing was changed"
            else:
                hint = message
            raise TuningDbError(f"{self.name}: cannot {action}: {hint}") from exc
        except sa_exc.SQLAlchemyError as exc:
            raise TuningDbError(f"{self.name}: cannot {action}: {exc}") from exc

    @contextlib.contextmanager
    def _write(self, action: str) -> Iterator[Connection]:
        if self.readonly:
            raise TuningDbError(f"{self.name}: cannot {action}: it was opened read-only")
        with self._errors(action), self.engine.connect() as raw:
            conn = raw.execution_options(tunegen_write=True)
            with conn.begin():
                yield conn

    @contextlib.contextmanager
    def _read(self, action: str) -> Iterator[Connection]:
        with self._errors(action), self.engine.connect() as conn, conn.begin():
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self: D) -> D:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- schema ----------------------------------------------------------------------------

    def revision(self) -> str | None:
        """The schema revision the database is at (None for an empty database)."""
        with self._read("read its schema version") as conn:
            return MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()

    def _check_schema(self, *, upgrade: bool) -> None:
        context = self._write("open it for writing") if upgrade else self._read("check its schema")
        with context as conn:
            if upgrade and self.url.get_backend_name() == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            current = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()
            self.found_revision = current
            present = set(sa.inspect(conn).get_table_names())
            head = head_revision()
            if current is None:
                ours = sorted(t for t in present if t.startswith("tunegen_"))
                if ours:
                    raise TuningDbError(
                        f"{self.name}: holds tunegen tables {ours} but no schema version: "
                        "it was damaged or not made by tunegen; nothing was changed"
                    )
                if not upgrade:
                    self.empty = True
                    return
            elif current not in _known_revisions():
                raise TuningDbError(
                    f"{self.name}: its schema (revision {current}) is newer than this tunegen knows "
                    f"(up to {head}); upgrade tunegen to use it; nothing was changed"
                )
            elif current == head:
                missing = sorted(set(TABLES) - present)
                if missing:
                    raise TuningDbError(
                        f"{self.name}: tables {missing} are missing: the database is damaged; nothing was "
                        "changed. Restore it from a backup or point TUNEGEN_DB elsewhere"
                    )
                if upgrade:
                    # A read-only file, folder, URL or server refuses this write now, with a clear
                    # error, rather than in the middle of the caller's work (Optuna's, say).
                    conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = version_num"))
                return
            if not upgrade:
                raise TuningDbError(
                    f"{self.name}: its schema is at revision {current or 'none'}, this tunegen needs {head}; "
                    "run `tunegen db upgrade` (it was opened read-only)"
                )
            command.upgrade(_alembic_config(conn), "head")

    def upgrade(self) -> tuple[str | None, str]:
        """Bring the schema to this release's head; returns the revision found when the store was
        opened and the one it is at now (opening a writable store already upgrades it)."""
        before = self.found_revision
        self._check_schema(upgrade=True)
        return before, head_revision()
