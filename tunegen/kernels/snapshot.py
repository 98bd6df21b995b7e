"""The Winners dispatch serves from: per Gpu, every Winner recorded for it (the user's database,
read-only, and the winners shipped with tunegen), read once at the first dispatch on that Gpu in a
process and kept until `dispatch.forget()`. A tune that records a Winner while a job runs (on
another host, say) changes nothing the job serves until then.

Ranks agree: when torch.distributed is initialized as a snapshot is taken, the job's ranks share
one. The first rank to take it publishes it (in the winners' JSON exchange format) in the job's
c10d key-value store under a key naming the Gpu and the snapshot's generation, which forget()
bumps; every other rank serves from that one instead of its own reading. Publishing is one
compare-and-set, not a collective: ranks reach their first attention call at different times
(pipeline stages), and a collective there could deadlock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings

import torch.distributed as dist

from tunegen import tuning_db
from tunegen.kernels.database import gpu_record, open_store, unusable
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import TuningDbError, WinnerRecord, parse_document
from tunegen.tuning_db.exchange import FORMAT, VERSION, entry
from tunegen.tuning_db.records import canonical, features_key


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every Winner for one Gpu: the user's (none if the database was unusable, `error` saying
    why; rows this release cannot serve, of another release or edited by hand, left out) and the
    shipped ones."""

    user: tuple[WinnerRecord, ...]
    shipped: tuple[WinnerRecord, ...]
    error: str | None = None

    def matching(
        self, problem: Problem, *, same_features: bool = False
    ) -> tuple[list[WinnerRecord], list[WinnerRecord]]:
        """The user's and the shipped Winners for exactly `problem` (or, with `same_features`, for
        any Problem differing from it only in bucketed sizes)."""
        key = features_key if same_features else canonical
        wanted = key(problem.as_dict())
        return (
            [w for w in self.user if key(w.problem) == wanted],
            [w for w in self.shipped if key(w.problem) == wanted],
        )


_SNAPSHOTS: dict[Gpu, Snapshot] = {}
_LOCK = threading.Lock()
_generation = 0
_store_failed = False


def for_gpu(gpu: Gpu) -> Snapshot:
    """The snapshot dispatch serves `gpu` from, taken on the first call (after forget(), the
    first call since)."""
    snap = _SNAPSHOTS.get(gpu)
    if snap is None:
        with _LOCK:
            snap = _SNAPSHOTS.get(gpu)
            if snap is None:
                snap = _SNAPSHOTS[gpu] = (
                    _shared(gpu) if dist.is_available() and dist.is_initialized() else _read(gpu)
                )
                if snap.error:
                    warnings.warn(
                        f"tunegen: tuned winners unavailable, using default Variants: {snap.error}",
                        stacklevel=2,
                    )
    return snap


def forget() -> None:
    """Drop every snapshot: the next dispatch takes a new one, under a new generation, which the
    ranks of a job share again if each calls forget() the same number of times."""
    global _generation
    with _LOCK:
        _SNAPSHOTS.clear()
        _generation += 1


def _read(gpu: Gpu) -> Snapshot:
    """This process's reading for `gpu`; never creates the user's database."""
    record = gpu_record(gpu)
    shipped = tuple(tuning_db.shipped_store().winners(gpu=record))
    try:
        with open_store(readonly=True) as store:
            return Snapshot(tuple(w for w in store.winners(gpu=record) if unusable(w) is None), shipped)
    except TuningDbError as exc:
        return Snapshot((), shipped, str(exc))


def _shared(gpu: Gpu) -> Snapshot:
    """The snapshot the job's first rank took for `gpu` (this rank's reading if it is the first);
    this rank's own reading, with one warning per process, if the job's store cannot be used."""
    global _store_failed
    key = _key(gpu)
    try:
        store = dist.distributed_c10d._get_default_store()
        # A rank that comes later skips reading the database: the value is there to take.
        agreed = (
            store.get(key) if store.check([key]) else store.compare_set(key, "", _to_json(gpu, _read(gpu)))
        )
        return _from_json(agreed)
    except (AttributeError, KeyError, RuntimeError, ValueError) as exc:
        if not _store_failed:
            _store_failed = True
            warnings.warn(
                f"tunegen: cannot share tuned winners through torch.distributed's store ({exc}); each "
                "rank serves from its own reading of the database",
                stacklevel=3,
            )
        return _read(gpu)


def _key(gpu: Gpu) -> str:
    """The store key of a Gpu's snapshot: its identity, Triton version and the generation."""
    return "tunegen/winners/" + json.dumps([*gpu_record(gpu).identity(), gpu.triton_version, _generation])


def _to_json(gpu: Gpu, snap: Snapshot) -> str:
    """A snapshot as two documents of the winners' exchange format (the user's and the shipped)."""
    record = dataclasses.asdict(gpu_record(gpu))

    def document(winners: tuple[WinnerRecord, ...]) -> dict:
        return {"format": FORMAT, "version": VERSION, "gpu": record, "winners": [entry(w) for w in winners]}

    return json.dumps({"user": document(snap.user), "shipped": document(snap.shipped), "error": snap.error})


def _from_json(text: str | bytes) -> Snapshot:
    data = json.loads(text)
    return Snapshot(
        tuple(parse_document(data["user"])), tuple(parse_document(data["shipped"])), data["error"]
    )
