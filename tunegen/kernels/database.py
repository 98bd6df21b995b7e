"""Where tunegen keeps what it learns: the database URL and opening the store (dispatch reads it
through tunegen.kernels.snapshot), and stored or imported records read back as this release's
Problem, Variant and Gpu: checked against their family before `tunegen import` stores them, the
reason dispatch cannot serve a stored row, and a Winner's applicable knobs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import platformdirs
import torch
import triton

from tunegen import tuning_db
from tunegen.kernels.families import get
from tunegen.kernels.families.base import Family, applicable
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import TORCH_DTYPES, Problem
from tunegen.kernels.variant import Variant
from tunegen.tuning_db import GpuRecord, WinnerRecord, parse_document

if TYPE_CHECKING:
    from tunegen.tuning_db import Store

# The JSON types of the fields of Problem and of every Variant (their annotations), exactly: a
# boolean is no integer here.
_TYPES = {"str": str, "int": int, "bool": bool}
BACKENDS = ("cuda", "interpreter")
MAX_HEAD_DIM = 256  # tunegen.checks.MAX_HEAD_DIM: the head dims the public calls take


def database_url(url: str | None = None) -> str:
    """`url`, else TUNEGEN_DB, else an embedded SQLite file in the user's data folder."""
    if url:
        return url
    if os.environ.get("TUNEGEN_DB"):
        return os.environ["TUNEGEN_DB"]
    return f"sqlite:///{Path(platformdirs.user_data_dir('tunegen')) / 'tunegen.db'}"


def open_store(url: str | None = None, *, readonly: bool = False) -> Store:
    """Open (creating or upgrading as needed, unless read-only) the tuning database."""
    return tuning_db.Store(database_url(url), readonly=readonly)


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
        r = rebuild(w)
        return applicable(r.family, r.variant, r.problem, r.gpu)
    except ValueError:
        return dict(w.variant)


class Rebuilt(NamedTuple):
    """A Winner's record as this release's objects."""

    family: Family
    problem: Problem
    variant: Variant
    gpu: Gpu


def rebuild(w: WinnerRecord) -> Rebuilt:
    """`w`'s family, its Problem rebuilt from its fields, its Variant through the family's Variant
    type, and its GPU as tuned (with the Winner's Triton and torch), so that checks judge it
    where it was measured; a ValueError names the first field this release cannot take."""
    family = get(w.family)
    problem = problem_from_dict(w.problem)
    if problem.family != w.family:
        raise ValueError(f"problem.family: expected the winner's family {w.family!r}, got {problem.family!r}")
    return Rebuilt(family, problem, variant_from_dict(family, w.variant), tuned_gpu(w))


def problem_from_dict(data: Any) -> Problem:
    """A Problem from its fields, every one this release requires, of its type, and no other: a
    known family and dtype, head dim 1 to 256, positive head counts whose query heads are a
    multiple of the KV heads, sizes >= 0, a page size exactly where paged, and window sides of -1
    or more (the right one -1 under causal) and a chunk >= 0."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"problem: expected an object of the Problem's fields, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(Problem)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"problem: unknown fields {unknown}; expected those of {sorted(fields)}")
    missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"problem: missing fields {missing}")
    _check_types(Problem, data, "problem")
    problem = Problem(**data)
    get(problem.family)
    if problem.dtype not in TORCH_DTYPES:
        raise ValueError(f"problem.dtype: expected one of {sorted(TORCH_DTYPES)}, got {problem.dtype!r}")
    if not 1 <= problem.head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"problem.head_dim: expected 1 to {MAX_HEAD_DIM}, got {problem.head_dim}")
    for name in ("num_heads_q", "num_heads_kv"):
        if getattr(problem, name) < 1:
            raise ValueError(f"problem.{name}: expected at least 1, got {getattr(problem, name)}")
    if problem.num_heads_q % problem.num_heads_kv:
        raise ValueError(
            f"problem.num_heads_q: expected a multiple of num_heads_kv {problem.num_heads_kv}, "
            f"got {problem.num_heads_q}"
        )
    for name in ("batch", "seqlen_q", "seqlen_k", "page_size"):
        if getattr(problem, name) < 0:
            raise ValueError(f"problem.{name}: expected a size >= 0, got {getattr(problem, name)}")
    if problem.paged != (problem.page_size > 0):
        raise ValueError(
            f"problem.page_size: expected a size > 0 for paged Problems and 0 otherwise, got "
            f"{problem.page_size} with paged {problem.paged}"
        )
    for name in ("window_left", "window_right"):
        if getattr(problem, name) < -1:
            raise ValueError(
                f"problem.{name}: expected -1 (unbounded) or a size >= 0, got {getattr(problem, name)}"
            )
    if problem.causal and problem.window_right != -1:
        raise ValueError(
            f"problem.window_right: expected -1 with causal (causal bounds the right side), got "
            f"{problem.window_right}"
        )
    if problem.attention_chunk < 0:
        raise ValueError(
            f"problem.attention_chunk: expected 0 (no chunks) or a size > 0, got {problem.attention_chunk}"
        )
    return problem


def variant_from_dict(family: Family, data: Any) -> Variant:
    """`family`'s Variant from its knobs (those left out take their defaults), each of its type
    and within the Variant type's own bounds."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"variant: expected an object of the Variant's knobs, got {data!r}")
    names = sorted(f.name for f in dataclasses.fields(family.variant_type))
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"variant: unknown knobs {unknown}; {family.name} takes {names}")
    _check_types(family.variant_type, data, "variant")
    try:
        return family.variant_type.from_json(data)
    except ValueError as exc:
        raise ValueError(f"variant.{exc}") from None


def _check_types(cls: type, data: dict[str, Any], where: str) -> None:
    types = {f.name: _TYPES.get(str(f.type)) for f in dataclasses.fields(cls)}
    for name, value in data.items():
        expected = types.get(name)
        if expected is not None and type(value) is not expected:
            raise ValueError(f"{where}.{name}: expected {expected.__name__}, got {value!r}")


def tuned_gpu(w: WinnerRecord) -> Gpu:
    """The Gpu `w` was tuned on, with the Triton and torch versions it was tuned under."""
    if w.gpu.backend not in BACKENDS:
        raise ValueError(f"gpu.backend: expected one of {BACKENDS}, got {w.gpu.backend!r}")
    try:
        gpu = gpu_from_record(w.gpu)
    except ValueError:
        raise ValueError(
            f'gpu.capability: expected "MAJOR.MINOR" such as "9.0", got {w.gpu.capability!r}'
        ) from None
    return dataclasses.replace(gpu, triton_version=w.triton_version, torch_version=w.torch_version)


def unusable(w: WinnerRecord) -> str | None:
    """Why dispatch cannot serve the stored Winner `w` (a row of another release, or edited by
    hand): this release cannot rebuild it, or its Variant cannot run its Problem. None if it can."""
    try:
        r = rebuild(w)
        r.family.check_variant(r.variant, r.problem, r.gpu)
    except ValueError as exc:
        return str(exc)
    return None


def checked_winner(w: WinnerRecord) -> WinnerRecord:
    """`w` as `tunegen import` stores it: rebuilt, within its family's space and constraints on
    its GPU, its Problem and Variant completed (knobs left out take their defaults); a ValueError
    names the field that is not."""
    r = rebuild(w)
    reason = r.family.constraint(r.variant, r.problem, r.gpu)
    if reason is not None:
        raise ValueError(f"variant: not within {w.family}'s constraints on {w.gpu.name}: {reason}")
    return dataclasses.replace(w, problem=r.problem.as_dict(), variant=r.variant.as_dict())


def check_document(doc: Any) -> list[WinnerRecord]:
    """The winners of an exported document (`tuning_db.parse_document`), each `checked_winner`: a
    ValueError names the first row and field that is not, and nothing of the document may be
    stored then."""
    checked = []
    for i, w in enumerate(parse_document(doc)):
        try:
            checked.append(checked_winner(w))
        except ValueError as exc:
            raise ValueError(f"winners[{i}].{exc}") from None
    return checked
