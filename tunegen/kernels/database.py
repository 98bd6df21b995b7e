"""Where tunegen keeps what it learns: the database URL, and lookups that see the user's
database first, then the winners shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import GpuRecord, Store, WinnerRecord, shipped_store


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


def winners_for(
    gpu: Gpu, problem: Problem, url: str | None = None, *, same_features: bool = False
) -> list[WinnerRecord]:
    """Winners recorded for this Gpu and exactly this Problem (or, with `same_features`, any
    Problem differing from it only in bucketed sizes): the user's database first, then the
    shipped winners; within each, the newest first. Never creates the user's database."""
    record = gpu_record(gpu)
    query: dict = {"features": problem.as_dict()} if same_features else {"problem": problem.as_dict()}
    with open_store(url, readonly=True) as store:
        found = store.winners(gpu=record, **query)
    return found + shipped_store().winners(gpu=record, **query)
