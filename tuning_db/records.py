"""Plain records the store takes and returns, free of any ORM session."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

SIZE_KEYS = ("batch", "seqlen_q", "seqlen_k")


def canonical(data: dict[str, Any]) -> str:
    """Canonical JSON: sorted keys, no whitespace."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def features_key(problem: dict[str, Any]) -> str:
    """The canonical JSON of a Problem without its bucketed sizes."""
    return canonical({k: v for k, v in problem.items() if k not in SIZE_KEYS})


@dataclasses.dataclass(frozen=True)
class GpuRecord:
    name: str
    capability: str
    sm_count: int
    smem_per_block: int
    backend: str = "cuda"
    driver: str = ""

    def identity(self) -> tuple[str, str, int, int, str]:
        return (self.name, self.capability, self.sm_count, self.smem_per_block, self.backend)


@dataclasses.dataclass(frozen=True)
class WinnerRecord:
    """A Winner with its provenance; `problem` and `variant` are the dicts of their canonical JSON."""

    gpu: GpuRecord
    family: str
    problem: dict[str, Any]
    variant: dict[str, Any]
    median_ms: float
    rel_err: float
    triton_version: str
    torch_version: str
    template_hash: str
    cuda_version: str = ""
    tflops: float | None = None
    gbps: float | None = None
    peer_name: str | None = None
    peer_ms: float | None = None
    created_at: datetime.datetime = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
    )
    id: int | None = None

    @property
    def speedup(self) -> float | None:
        """How many times faster than the best peer measured in the same run."""
        return self.peer_ms / self.median_ms if self.peer_ms else None


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    gpu: GpuRecord
    family: str
    problem: dict[str, Any]
    variant: dict[str, Any]
    triton_version: str
    reason: str
