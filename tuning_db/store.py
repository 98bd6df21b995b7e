"""The store: one SQLAlchemy URL holding Winners, failed Variants and (beside them) Optuna's studies.

SQLite and PostgreSQL are supported; both resolve concurrent writers with one atomic
`INSERT ... ON CONFLICT` per row, so several processes recording at once lose nothing and a
Winner is only ever replaced by a faster one for the same (Gpu, Problem, Triton version).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from tunegen.tuning_db.errors import TuningDbError
from tunegen.tuning_db.models import TABLES, FailureRow, GpuRow, ProblemRow, VariantRow, WinnerRow
from tunegen.tuning_db.records import FailureRecord, GpuRecord, WinnerRecord, canonical, features_key

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "tunegen_alembic_version"
LOCK_TIMEOUT_S = 30.0
SUPPORTED = ("sqlite", "postgresql")
_PG_MIGRATION_LOCK = 7_243_501


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


class Store:
    """A tuning database behind one URL. Open it with `Store(url)`; close it with `close()`."""

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
            self._check_schema(upgrade=not readonly)
        except BaseException:
            self.engine.dispose()
            raise

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
            path.parent.mkdir(parents=True, exist_ok=True)
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

    def __enter__(self) -> Store:
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
        context = self._write("check its schema") if upgrade else self._read("check its schema")
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

    # -- writes ----------------------------------------------------------------------------

    def _insert(self, conn: Connection) -> Any:
        return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert

    def _row_id(self, conn: Connection, model: Any, values: dict[str, Any], unique: tuple[str, ...]) -> int:
        stmt = self._insert(conn)(model).values(**values).on_conflict_do_nothing(index_elements=list(unique))
        conn.execute(stmt)
        where = [getattr(model, name) == values[name] for name in unique]
        return conn.execute(select(model.id).where(*where)).scalar_one()

    def _ids(
        self, conn: Connection, gpu: GpuRecord, family: str, problem: dict, variant: dict
    ) -> tuple[int, ...]:
        gpu_values = {
            "name": gpu.name,
            "capability": gpu.capability,
            "sm_count": gpu.sm_count,
            "smem_per_block": gpu.smem_per_block,
            "backend": gpu.backend,
            "driver": gpu.driver,
        }
        gpu_id = self._row_id(
            conn, GpuRow, gpu_values, ("name", "capability", "sm_count", "smem_per_block", "backend")
        )
        problem_values = {
            "key": canonical(problem),
            "family": family,
            "features": features_key(problem),
            "batch": int(problem.get("batch", 0)),
            "seqlen_q": int(problem.get("seqlen_q", 0)),
            "seqlen_k": int(problem.get("seqlen_k", 0)),
        }
        problem_id = self._row_id(conn, ProblemRow, problem_values, ("key",))
        variant_id = self._row_id(
            conn, VariantRow, {"family": family, "config": canonical(variant)}, ("family", "config")
        )
        return gpu_id, problem_id, variant_id

    def record_winner(self, winner: WinnerRecord) -> str:
        """Record a verified result; returns "inserted", "replaced" (it was faster) or "kept" (it was not).

        The comparison and the replacement are one atomic statement, so concurrent recorders
        cannot lose the fastest result.
        """
        return self.record_winners([winner])[0]

    def record_winners(self, winners: list[WinnerRecord]) -> list[str]:
        """Record several results in one transaction: all of them, or none if the database fails."""
        for winner in winners:
            check_winner(winner)
        outcomes = []
        with self._write("record winners") as conn:
            for winner in winners:
                outcomes.append(self._upsert_winner(conn, winner))
        return outcomes

    def _upsert_winner(self, conn: Connection, winner: WinnerRecord) -> str:
        gpu_id, problem_id, variant_id = self._ids(
            conn, winner.gpu, winner.family, winner.problem, winner.variant
        )
        key = {"gpu_id": gpu_id, "problem_id": problem_id, "triton_version": winner.triton_version}
        before = conn.execute(
            select(WinnerRow.median_ms).where(*[getattr(WinnerRow, k) == v for k, v in key.items()])
        ).scalar()
        values = {
            **key,
            "variant_id": variant_id,
            "torch_version": winner.torch_version,
            "cuda_version": winner.cuda_version,
            "template_hash": winner.template_hash,
            "median_ms": winner.median_ms,
            "tflops": winner.tflops,
            "gbps": winner.gbps,
            "rel_err": winner.rel_err,
            "peer_name": winner.peer_name,
            "peer_ms": winner.peer_ms,
            "created_at": winner.created_at,
        }
        stmt = self._insert(conn)(WinnerRow).values(**values)
        stmt = stmt.on_conflict_do_update(
            index_elements=list(key),
            set_={name: stmt.excluded[name] for name in values if name not in key},
            where=WinnerRow.median_ms > stmt.excluded.median_ms,
        )
        conn.execute(stmt)
        if before is None:
            return "inserted"
        return "replaced" if winner.median_ms < before else "kept"

    def record_failure(self, failure: FailureRecord) -> None:
        """Record that a Variant failed (once per Gpu, Problem, Variant and Triton version)."""
        with self._write("record a failed variant") as conn:
            gpu_id, problem_id, variant_id = self._ids(
                conn, failure.gpu, failure.family, failure.problem, failure.variant
            )
            values = {
                "gpu_id": gpu_id,
                "problem_id": problem_id,
                "variant_id": variant_id,
                "triton_version": failure.triton_version,
                "reason": failure.reason,
                "created_at": datetime.datetime.now(datetime.timezone.utc),
            }
            stmt = (
                self._insert(conn)(FailureRow)
                .values(**values)
                .on_conflict_do_nothing(
                    index_elements=["gpu_id", "problem_id", "variant_id", "triton_version"]
                )
            )
            conn.execute(stmt)

    # -- reads -----------------------------------------------------------------------------

    def failures(
        self, gpu: GpuRecord, family: str, problem: dict[str, Any], triton_version: str
    ) -> dict[str, str]:
        """Canonical JSON of each Variant that failed for this (Gpu, Problem, Triton), with the reason."""
        if self.empty:
            return {}
        with self._read("read failed variants") as conn:
            rows = conn.execute(
                select(VariantRow.config, FailureRow.reason)
                .join(FailureRow, FailureRow.variant_id == VariantRow.id)
                .join(GpuRow, FailureRow.gpu_id == GpuRow.id)
                .join(ProblemRow, FailureRow.problem_id == ProblemRow.id)
                .where(
                    *_gpu_is(gpu),
                    ProblemRow.key == canonical(problem),
                    FailureRow.triton_version == triton_version,
                    VariantRow.family == family,
                )
            ).all()
        return {config: reason for config, reason in rows}

    def winners(
        self,
        *,
        gpu_name: str | None = None,
        family: str | None = None,
        gpu: GpuRecord | None = None,
        problem: dict[str, Any] | None = None,
        features: dict[str, Any] | None = None,
        winner_id: int | None = None,
    ) -> list[WinnerRecord]:
        """Winners matching every filter given, newest first. `features` matches every Problem
        that differs from it only in its bucketed sizes."""
        if self.empty:
            return []
        query = (
            select(WinnerRow, GpuRow, ProblemRow, VariantRow)
            .join(GpuRow, WinnerRow.gpu_id == GpuRow.id)
            .join(ProblemRow, WinnerRow.problem_id == ProblemRow.id)
            .join(VariantRow, WinnerRow.variant_id == VariantRow.id)
            .order_by(WinnerRow.created_at.desc(), WinnerRow.id.desc())
        )
        if gpu_name is not None:
            query = query.where(GpuRow.name == gpu_name)
        if gpu is not None:
            query = query.where(*_gpu_is(gpu))
        if family is not None:
            query = query.where(ProblemRow.family == family)
        if problem is not None:
            query = query.where(ProblemRow.key == canonical(problem))
        if features is not None:
            query = query.where(ProblemRow.features == features_key(features))
        if winner_id is not None:
            query = query.where(WinnerRow.id == winner_id)
        with self._read("read winners") as conn, Session(conn) as session:
            return [_winner_record(*row) for row in session.execute(query).all()]


def _gpu_is(gpu: GpuRecord) -> list[Any]:
    return [
        GpuRow.name == gpu.name,
        GpuRow.capability == gpu.capability,
        GpuRow.sm_count == gpu.sm_count,
        GpuRow.smem_per_block == gpu.smem_per_block,
        GpuRow.backend == gpu.backend,
    ]


def _winner_record(w: WinnerRow, g: GpuRow, p: ProblemRow, v: VariantRow) -> WinnerRecord:
    created = w.created_at if w.created_at.tzinfo else w.created_at.replace(tzinfo=datetime.timezone.utc)
    return WinnerRecord(
        gpu=GpuRecord(g.name, g.capability, g.sm_count, g.smem_per_block, g.backend, g.driver),
        family=p.family,
        problem=json.loads(p.key),
        variant=json.loads(v.config),
        median_ms=w.median_ms,
        rel_err=w.rel_err,
        triton_version=w.triton_version,
        torch_version=w.torch_version,
        template_hash=w.template_hash,
        cuda_version=w.cuda_version,
        tflops=w.tflops,
        gbps=w.gbps,
        peer_name=w.peer_name,
        peer_ms=w.peer_ms,
        created_at=created,
        id=w.id,
    )


def check_winner(winner: WinnerRecord) -> None:
    """Refuse results that are not a verified, finite measurement."""
    if not (
        isinstance(winner.median_ms, (int, float))
        and math.isfinite(winner.median_ms)
        and winner.median_ms > 0
    ):
        raise ValueError(f"median_ms: expected a positive finite time, got {winner.median_ms!r}")
    if not (
        isinstance(winner.rel_err, (int, float)) and math.isfinite(winner.rel_err) and winner.rel_err >= 0
    ):
        raise ValueError(
            f"rel_err: expected the verified error against float64 (finite, >= 0), got {winner.rel_err!r}"
        )
    for name in ("triton_version", "torch_version", "template_hash", "family"):
        if not getattr(winner, name):
            raise ValueError(f"{name}: expected a non-empty string for the winner's provenance")
    if not winner.problem or not winner.variant:
        raise ValueError("problem/variant: expected the Problem's and the Variant's fields")
