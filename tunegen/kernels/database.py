"""Where tunegen keeps what it learns: the database URL and opening the store (dispatch reads it
through tunegen.kernels.snapshot), and stored records read back as this release's Gpu and a
Winner's applicable knobs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import platformdirs
import torch
import triton

from tunegen.kernels.families import get
from tunegen.kernels.families.base import applicable
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import GpuRecord, Store, WinnerRecord


def database_url(url: str | None = None) -> str:
    """`url`, else TUNEGEN_DB, else an embedded SQLite file in the user's data folder."""
    if url:
        return url
    if os.environ.get("TUNEGEN_DB"):
        return os.environ["TUNEGEN_DB"]
    return f"sqlite:///{Path(platformdirs.user_data_dir('tunegen')) / 'tunegen.db'}"


def open_store(url: str | None = None, *, readonly: bool = False) -> Store:
    """Open (creating or upgrading as needed, unless read-only) the tuning database."""
    return Store(database_url(url), readonly=readonly)


def gpu_record(gpu: Gpu, driver: str = "") -> GpuRecord:
    """The store's record of a Gpu."""
    return GpuRecord(
        name=gpu.name,
        capability=f"{gpu.capability[0]}.{gpu.capability[1]}",
        sm_count=gpu.sm_count,
        smem_per_block=gpu.smem_per_block,
        backend=gpu.backend,
        driver=driver,
    )


def gpu_from_record(record: GpuRecord) -> Gpu:
    """The Gpu a stored record names, with this process's Triton and torch versions."""
    major, _, minor = record.capability.partition(".")
    return Gpu(
        name=record.name,
        capability=(int(major), int(minor or 0)),
        sm_count=record.sm_count,
        smem_per_block=record.smem_per_block,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        backend=record.backend,
    )


def applicable_knobs(w: WinnerRecord) -> dict[str, Any]:
    """A stored Winner's knobs that apply to its Problem on its GPU (`base.applicable`), for
    listings and exports; all of its stored knobs where this release cannot rebuild its family,
    Problem, Variant or GPU (rows of other releases), so that showing a Winner never fails."""
    try:
        family = get(w.family)
        variant = family.variant_type.from_json(w.variant)
        return applicable(family, variant, Problem(**w.problem), gpu_from_record(w.gpu))
    except (TypeError, ValueError):
        return dict(w.variant)
