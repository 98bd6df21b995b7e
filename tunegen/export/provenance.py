"""Provenance every export carries: what was exported, from which GPUs and tuning runs, by which
tunegen, Triton and torch, when, and the hash of every template that produced its code."""

from __future__ import annotations

import dataclasses
import datetime
import platform
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import triton

from tunegen.kernels.render import template_hash
from tunegen.tuning_db import WinnerRecord
from tunegen.version import __version__

FORMAT = "tunegen-export"
VERSION = 1


def provenance(kind: str, winners: Sequence[WinnerRecord], templates: Iterable[str]) -> dict[str, Any]:
    """The provenance of an export of `kind` ("python", "json" or "aot") holding `winners`, whose
    code came from `templates` (names under templates/)."""
    gpus = {dataclasses.replace(w.gpu, driver=""): None for w in winners}
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "tunegen_version": __version__,
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exported_with": {
            "triton": triton.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "gpus": sorted((dataclasses.asdict(g) for g in gpus), key=lambda g: (g["name"], g["capability"])),
        "winners": {
            "count": len(winners),
            "triton_versions": sorted({w.triton_version for w in winners}),
            "torch_versions": sorted({w.torch_version for w in winners}),
            "tuned_template_hashes": sorted({w.template_hash for w in winners}),
            "tuned_between": [
                min(w.created_at for w in winners).isoformat(timespec="seconds"),
                max(w.created_at for w in winners).isoformat(timespec="seconds"),
            ]
            if winners
            else [],
        },
        "templates": {name: template_hash(name) for name in sorted(set(templates))},
    }
