"""Winners as JSON, one human-readable file per GPU (like vLLM's per-device configs), so tunings
move between machines. Import validates every entry before it records any."""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tunegen.tuning_db.records import GpuRecord, WinnerRecord

if TYPE_CHECKING:
    from tunegen.tuning_db.store import Store

FORMAT = "tunegen-winners"
VERSION = 1


def file_name(gpu: GpuRecord) -> str:
    """The file a GPU's winners go to: its name, compute capability and backend."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", gpu.name).strip("_").lower()
    return f"{slug}_sm{gpu.capability.replace('.', '')}_{gpu.backend}.json"


def entry(w: WinnerRecord) -> dict[str, Any]:
    """A Winner as a JSON object (without its GPU, which a document holds once)."""
    return {
        "family": w.family,
        "problem": w.problem,
        "variant": w.variant,
        "median_ms": w.median_ms,
        "tflops": w.tflops,
        "gbps": w.gbps,
        "rel_err": w.rel_err,
        "peer": {"name": w.peer_name, "ms": w.peer_ms} if w.peer_name else None,
        "triton_version": w.triton_version,
        "torch_version": w.torch_version,
        "cuda_version": w.cuda_version,
        "template_hash": w.template_hash,
        "created_at": w.created_at.isoformat(),
    }


def export_documents(
    store: Store, *, gpu_name: str | None = None, family: str | None = None
) -> dict[str, dict]:
    """One document per GPU holding its winners, keyed by file name."""
    return documents(store.winners(gpu_name=gpu_name, family=family))


def documents(winners: Iterable[WinnerRecord]) -> dict[str, dict]:
    """One document per GPU holding its winners among `winners`, keyed by file name."""
    groups: dict[GpuRecord, list[WinnerRecord]] = {}
    for w in winners:
        groups.setdefault(dataclasses.replace(w.gpu, driver=""), []).append(w)
    out = {}
    for gpu, group in groups.items():
        group.sort(key=lambda w: (w.family, sorted(w.problem.items()), w.triton_version))
        out[file_name(gpu)] = {
            "format": FORMAT,
            "version": VERSION,
            "gpu": dataclasses.asdict(max(group, key=lambda w: w.created_at).gpu),
            "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "winners": [entry(w) for w in group],
        }
    return out


def _need(cond: bool, where: str, expected: str, got: Any) -> None:
    if not cond:
        raise ValueError(f"{where}: expected {expected}, got {got!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_document(doc: Any) -> list[WinnerRecord]:
    """Validate a document and return its winners; a ValueError names the first bad field."""
    _need(isinstance(doc, dict), "document", "a JSON object", type(doc).__name__)
    _need(doc.get("format") == FORMAT, "format", repr(FORMAT), doc.get("format"))
    _need(doc.get("version") == VERSION, "version", str(VERSION), doc.get("version"))
    gpu = doc.get("gpu")
    _need(isinstance(gpu, dict), "gpu", "an object", gpu)
    try:
        gpu_record = GpuRecord(**gpu)
    except TypeError as exc:
        raise ValueError(f"gpu: {exc}") from None
    _need(isinstance(gpu_record.name, str) and gpu_record.name, "gpu.name", "a name", gpu_record.name)
    _need(
        isinstance(gpu_record.capability, str), "gpu.capability", 'a string like "9.0"', gpu_record.capability
    )
    for name in ("sm_count", "smem_per_block"):
        _need(
            isinstance(getattr(gpu_record, name), int), f"gpu.{name}", "an integer", getattr(gpu_record, name)
        )
    entries = doc.get("winners")
    _need(isinstance(entries, list), "winners", "a list", entries)
    records = []
    for i, e in enumerate(entries):
        at = f"winners[{i}]"
        _need(isinstance(e, dict), at, "an object", e)
        for name in ("family", "triton_version", "torch_version", "template_hash"):
            _need(
                isinstance(e.get(name), str) and e.get(name),
                f"{at}.{name}",
                "a non-empty string",
                e.get(name),
            )
        for name in ("problem", "variant"):
            _need(
                isinstance(e.get(name), dict) and e.get(name),
                f"{at}.{name}",
                "a non-empty object",
                e.get(name),
            )
        _need(
            _number(e.get("median_ms")) and e["median_ms"] > 0,
            f"{at}.median_ms",
            "a positive finite number",
            e.get("median_ms"),
        )
        _need(
            _number(e.get("rel_err")) and e["rel_err"] >= 0,
            f"{at}.rel_err",
            "a finite number >= 0",
            e.get("rel_err"),
        )
        for name in ("tflops", "gbps"):
            _need(
                e.get(name) is None or _number(e[name]),
                f"{at}.{name}",
                "a finite number or null",
                e.get(name),
            )
        peer = e.get("peer")
        _need(
            peer is None
            or (isinstance(peer, dict) and isinstance(peer.get("name"), str) and _number(peer.get("ms"))),
            f"{at}.peer",
            'null or {"name": str, "ms": number}',
            peer,
        )
        try:
            created = datetime.datetime.fromisoformat(e.get("created_at", ""))
        except (TypeError, ValueError):
            raise ValueError(
                f"{at}.created_at: expected an ISO 8601 time, got {e.get('created_at')!r}"
            ) from None
        if created.tzinfo is None:
            created = created.replace(tzinfo=datetime.timezone.utc)
        records.append(
            WinnerRecord(
                gpu=gpu_record,
                family=e["family"],
                problem=e["problem"],
                variant=e["variant"],
                median_ms=float(e["median_ms"]),
                rel_err=float(e["rel_err"]),
                triton_version=e["triton_version"],
                torch_version=e["torch_version"],
                template_hash=e["template_hash"],
                cuda_version=e.get("cuda_version") or "",
                tflops=e.get("tflops"),
                gbps=e.get("gbps"),
                peer_name=peer["name"] if peer else None,
                peer_ms=float(peer["ms"]) if peer else None,
                created_at=created,
            )
        )
    return records


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What an import did: new winners merged, faster ones replaced, others skipped."""

    merged: int
    replaced: int
    skipped: int


def import_document(store: Store, doc: Any) -> ImportReport:
    """Validate `doc` whole, then record its winners in one transaction (the store's own checks;
    `tunegen import` also rebuilds each Problem and Variant: tunegen.kernels.database)."""
    return record_imported(store, parse_document(doc))


def record_imported(store: Store, winners: list[WinnerRecord]) -> ImportReport:
    """Record a document's validated winners in one transaction: all of them or none."""
    outcomes = Counter(store.record_winners(winners))
    return ImportReport(merged=outcomes["inserted"], replaced=outcomes["replaced"], skipped=outcomes["kept"])
