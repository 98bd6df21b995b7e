"""The tables: GPUs, Problems, Variants, Winners and failed Variants (SQLAlchemy 2 typed models).

Every table carries the `tunegen_` prefix so that Optuna's own tables (its studies live in
the same database) never collide with ours.
"""

from __future__ import annotations

import datetime

from sqlalchemy import DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    pass


class GpuRow(Base):
    """A device identity: what makes two GPUs interchangeable for a tuned kernel."""

    __tablename__ = "tunegen_gpus"
    __table_args__ = (UniqueConstraint("name", "capability", "sm_count", "smem_per_block", "backend"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    smem_per_block: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(32))
    driver: Mapped[str] = mapped_column(String(64), default="")


class ProblemRow(Base):
    """A Problem as its canonical JSON `key`, with the searchable parts as columns.

    `features` is the canonical JSON of everything but the bucketed sizes, so the nearest
    bucket with the same features is one indexed query.
    """

    __tablename__ = "tunegen_problems"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(Text, unique=True)
    family: Mapped[str] = mapped_column(String(64), index=True)
    features: Mapped[str] = mapped_column(Text, index=True)
    batch: Mapped[int] = mapped_column(Integer)
    seqlen_q: Mapped[int] = mapped_column(Integer)
    seqlen_k: Mapped[int] = mapped_column(Integer)


class VariantRow(Base):
    """A Variant's canonical JSON, per family."""

    __tablename__ = "tunegen_variants"
    __table_args__ = (UniqueConstraint("family", "config"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    family: Mapped[str] = mapped_column(String(64))
    config: Mapped[str] = mapped_column(Text)


class WinnerRow(Base):
    """The fastest verified Variant for a (Gpu, Problem) under one Triton version, with provenance."""

    __tablename__ = "tunegen_winners"
    __table_args__ = (UniqueConstraint("gpu_id", "problem_id", "triton_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("tunegen_gpus.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("tunegen_problems.id"))
    variant_id: Mapped[int] = mapped_column(ForeignKey("tunegen_variants.id"))
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str] = mapped_column(String(64), default="")
    template_hash: Mapped[str] = mapped_column(String(64))
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    gbps: Mapped[float | None] = mapped_column(Float, nullable=True)
    rel_err: Mapped[float] = mapped_column(Float)
    peer_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    peer_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True))

    gpu: Mapped[GpuRow] = relationship()
    problem: Mapped[ProblemRow] = relationship()
    variant: Mapped[VariantRow] = relationship()


class FailureRow(Base):
    """A Variant that failed for a (Gpu, Problem) under one Triton version, and why: never retried."""

    __tablename__ = "tunegen_failures"
    __table_args__ = (UniqueConstraint("gpu_id", "problem_id", "variant_id", "triton_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("tunegen_gpus.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("tunegen_problems.id"))
    variant_id: Mapped[int] = mapped_column(ForeignKey("tunegen_variants.id"))
    triton_version: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True))


TABLES = sorted(Base.metadata.tables)
