"""The store: one SQLAlchemy URL holding Winners, failed Variants and (beside them) Optuna's studies.

SQLite and PostgreSQL are supported; both resolve concurrent writers with one atomic
`INSERT ... ON CONFLICT` per row, so several processes recording at once lose nothing and a
Winner is only ever replaced by a faster one for the same (Gpu, Problem, Triton version).
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from tunegen.tuning_db.database import Database
from tunegen.tuning_db.models import FailureRow, GpuRow, ProblemRow, VariantRow, WinnerRow
from tunegen.tuning_db.records import FailureRecord, GpuRecord, WinnerRecord, canonical, features_key


class Store(Database):
    """A tuning database behind one URL. Open it with `Store(url)`; close it with `close()`."""

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
        problem=_json_object(p.key),
        variant=_json_object(v.config),
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


def _json_object(text: str) -> dict[str, Any]:
    """A stored Problem or Variant; {} for one that is not a JSON object (a row damaged or written
    by hand), which no valid record has, so that reading every row never fails on one."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
