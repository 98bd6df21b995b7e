"""Which Winners an export carries: per GPU and Problem the one dispatch would serve, checked
against this release, from one GPU unless mixing is asked for, each rendered to its source."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tunegen.kernels import dispatch
from tunegen.kernels.database import gpu_from_record, problem_from_dict
from tunegen.kernels.families import FAMILIES, get
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import Rendered, render
from tunegen.kernels.variant import Variant
from tunegen.tuning_db import GpuRecord, Store, WinnerRecord
from tunegen.tuning_db.records import canonical


@dataclasses.dataclass(frozen=True)
class Selected:
    """One Winner an export carries, with the Problem, Variant and Gpu rebuilt and its source."""

    winner: WinnerRecord
    problem: Problem
    variant: Variant
    gpu: Gpu
    template: str
    rendered: Rendered


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A Winner left out, and why."""

    winner: WinnerRecord
    reason: str


@dataclasses.dataclass(frozen=True)
class Selection:
    selected: list[Selected]
    skipped: list[Skipped]

    @property
    def gpus(self) -> list[GpuRecord]:
        """The GPUs the selected Winners were tuned on (without driver versions), in name order."""
        found = {dataclasses.replace(s.winner.gpu, driver="") for s in self.selected}
        return sorted(found, key=GpuRecord.identity)


def wanted_families(families: Sequence[str]) -> set[str]:
    """The families an export takes: those named (each checked), else every family."""
    for family in families:
        get(family)
    return set(families or FAMILIES)


def no_winners(gpu_name: str | None, families: set[str], skipped: Sequence[Skipped] = ()) -> ValueError:
    """The error for an export that found nothing to write (and the first reason it skipped one)."""
    where = f" for GPU {gpu_name!r}" if gpu_name else ""
    why = f"; {len(skipped)} skipped, the first because {skipped[0].reason}" if skipped else ""
    return ValueError(f"no winners to export{where} in families {sorted(families)}{why}")


def select(
    store: Store,
    *,
    gpu_name: str | None = None,
    families: Sequence[str] = (),
    allow_mixed_gpus: bool = False,
) -> Selection:
    """The Winners to export: those of `families` (default: every family) on the GPU named
    `gpu_name` (default: every GPU; more than one is refused unless `allow_mixed_gpus`), one per
    GPU and Problem, chosen by dispatch's rule."""
    wanted = wanted_families(families)
    winners = [w for w in store.winners(gpu_name=gpu_name) if w.family in wanted]
    if not winners:
        raise no_winners(gpu_name, wanted)
    names = sorted({w.gpu.name for w in winners})
    if len({w.gpu.identity() for w in winners}) > 1 and not allow_mixed_gpus:
        raise ValueError(
            f"the winners come from several GPUs ({', '.join(names)}): pick one with --gpu NAME, or pass "
            "--allow-mixed-gpus to export each GPU's winners under its own identity in one table"
        )
    groups: dict[tuple, list[WinnerRecord]] = {}
    for w in winners:
        groups.setdefault((w.gpu.identity(), canonical(w.problem)), []).append(w)
    selected, skipped = [], []
    for group in groups.values():
        chosen = _choose(group)
        if isinstance(chosen, Selected):
            selected.append(chosen)
        else:
            skipped.extend(Skipped(w, chosen) for w in group)
    return Selection(selected, skipped)


def _choose(group: list[WinnerRecord]) -> Selected | str:
    """What dispatch would serve from one (GPU, Problem)'s Winners, or why none can be exported."""
    first = group[0]
    try:
        family = get(first.family)
        problem = problem_from_dict(first.problem)
        gpu = gpu_from_record(first.gpu)
    except ValueError as exc:
        return f"this release cannot read it ({exc})"
    usable = dispatch._usable(group, problem, gpu)
    if not usable:
        return f"its Variant is not valid for this release on {gpu.name}"
    winner, variant, _ = dispatch._best(usable, problem, gpu)
    rendered = render(family.template, family.name, variant, family.features(problem, gpu))
    return Selected(winner, problem, variant, gpu, family.template, rendered)
