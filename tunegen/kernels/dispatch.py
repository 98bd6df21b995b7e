"""Dispatch: the kernel that serves a Problem on a Gpu.

The first call for a (Problem, Gpu) looks for a Winner in the Gpu's snapshot (tunegen.kernels.snapshot:
the user's database and the shipped winners, read at the first dispatch on that Gpu and, in a
torch.distributed job, shared by every rank): for exactly this Problem, else for the nearest
bucket with the same features (at most one doubling of each size away), else it takes the family's
default Variant. Among several Winners, `preference` decides by a stable rule (nearest, this
Triton version's, the user's own before shipped, fastest, then canonical JSON), never by when they
were recorded, so every process holding the same snapshot serves the same Variant. It builds that
kernel once, under a lock; every later call is a dict lookup. The public functions keep, per exact
input signature, the kernel's bound call (tunegen.kernels.launcher), so a repeated call is one
lookup and the compiled kernel's own launch. Winners tuned under another Triton version are used,
with one warning. forget() drops all of it, snapshot included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import warnings
from typing import Any, NamedTuple

from tunegen.kernels import launcher, snapshot
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import WinnerRecord
from tunegen.tuning_db.records import canonical

log = logging.getLogger("tunegen")
if os.environ.get("TUNEGEN_LOG"):
    level = os.environ["TUNEGEN_LOG"].upper()
    if isinstance(logging.getLevelName(level), int):
        logging.basicConfig()
        log.setLevel(level)
    else:
        warnings.warn(
            f"TUNEGEN_LOG: expected debug, info, warning or error, got {level.lower()!r}", stacklevel=2
        )


class StaleWinnerWarning(UserWarning):
    """A Winner tuned under another Triton version is in use: re-tune to refresh it."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """What dispatch serves for a (Problem, Gpu), and why."""

    kernel: base.Kernel
    source: str  # "winner", "nearest", or "default"
    reason: str
    winner: WinnerRecord | None = None
    stale: bool = False


_CHOICES: dict[tuple[Problem, Gpu], Choice] = {}
# What serves a Problem under torch.use_deterministic_algorithms, where that differs.
_DETERMINISTIC: dict[tuple[Problem, Gpu], base.Kernel] = {}
_LOCK = threading.Lock()
# Calls' exact input signatures (see api.attention, decode.decode_attention) to the bound
# launch of the kernel their Problem got; the most recent launcher.CALL_CACHE_SIZE are kept.
fast_calls = launcher.Calls()


# How far a nearest-bucket Winner may be: one doubling of each of batch, query and KV length (a
# step along the benchmark suite, which halves the batch as it doubles the length). Beyond that,
# the defaults, measured across lengths, are the better guess than a Variant tuned for others.
NEAREST_MAX_DISTANCE = 3.0


def _distance(problem: Problem, other: dict) -> float:
    """How far apart two buckets are: the sum of |log2| ratios of batch and lengths."""
    total = 0.0
    for name in ("batch", "seqlen_q", "seqlen_k"):
        a, b = getattr(problem, name), other.get(name, 0)
        total += abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
    return total


class Candidate(NamedTuple):
    """A Winner this release can serve, its Variant, and whether it was shipped with tunegen."""

    winner: WinnerRecord
    variant: base.Variant
    shipped: bool = False


def _usable(
    winners: list[WinnerRecord], problem: Problem, gpu: Gpu, *, shipped: bool = False
) -> list[Candidate]:
    family = get(problem.family)
    out = []
    for w in winners:
        try:
            variant = family.variant_type.from_json(w.variant)
            family.check_variant(variant, problem, gpu)
        except (ValueError, TypeError):
            continue  # a Variant this release cannot take: fall through to the next candidate
        out.append(Candidate(w, variant, shipped))
    return out


def preference(problem: Problem, gpu: Gpu, tuned: dict[str, Any], shipped: bool = False) -> tuple:
    """Where a Winner stands for `problem` on `gpu`, as a sort key (the smallest is served).

    `tuned` holds the Problem it was tuned for ("problem"), its Variant with every knob
    ("variant"), "triton_version" and "median_ms", as a row of an exported package's table does.
    The nearest bucket first (an exact Winner is at distance 0), then this Triton version's, the
    user's own before shipped ones, the fastest, and last the canonical JSON of Problem and
    Variant: never when it was recorded or where a database lists it, so that processes holding
    the same Winners choose the same one.
    """
    return (
        _distance(problem, tuned["problem"]),
        tuned["triton_version"] != gpu.triton_version,
        shipped,
        tuned["median_ms"],
        canonical(tuned["problem"]),
        canonical(tuned["variant"]),
    )


def _best(candidates: list[Candidate], problem: Problem, gpu: Gpu) -> Candidate:
    """The candidate dispatch serves: the first by `preference`."""

    def key(c: Candidate) -> tuple:
        w = c.winner
        tuned = {
            "problem": w.problem,
            "variant": c.variant.as_dict(),
            "triton_version": w.triton_version,
            "median_ms": w.median_ms,
        }
        return preference(problem, gpu, tuned, c.shipped)

    return min(candidates, key=key)


def _candidates(
    winners: snapshot.Snapshot, problem: Problem, gpu: Gpu, *, same_features: bool = False
) -> list[Candidate]:
    user, shipped = winners.matching(problem, same_features=same_features)
    return _usable(user, problem, gpu) + _usable(shipped, problem, gpu, shipped=True)


class Selection(NamedTuple):
    """What dispatch would serve from a snapshot, before building it: the source ("winner",
    "nearest" or "default"), the Winner and Variant (None and the default Variant for "default"),
    and how many Winners with the Problem's features were too far to use."""

    source: str
    winner: WinnerRecord | None
    variant: base.Variant
    too_far: int


def select(problem: Problem, gpu: Gpu, winners: snapshot.Snapshot) -> Selection:
    """The exact Winner, else the nearest usable bucket with the same features (at most
    NEAREST_MAX_DISTANCE away), else the family's default; ties by `preference`."""
    exact = _candidates(winners, problem, gpu)
    same_features = [] if exact else _candidates(winners, problem, gpu, same_features=True)
    nearby = [c for c in same_features if _distance(problem, c.winner.problem) <= NEAREST_MAX_DISTANCE]
    if exact or nearby:
        winner, variant, _ = _best(exact or nearby, problem, gpu)
        return Selection("winner" if exact else "nearest", winner, variant, 0)
    default = get(problem.family).default_variant(problem, gpu)
    return Selection("default", None, default, len(same_features))


def choose(problem: Problem, gpu: Gpu) -> Choice:
    """Find and build what serves `problem` on `gpu` (the slow path, once per Problem)."""
    winners = snapshot.for_gpu(gpu)
    source, winner, variant, too_far = select(problem, gpu, winners)
    if source == "winner":
        reason = f"tuned for this Problem on {winner.gpu.name} ({winner.median_ms:.4g} ms)"
    elif source == "nearest":
        sizes = "x".join(str(winner.problem.get(n)) for n in ("batch", "seqlen_q", "seqlen_k"))
        reason = f"tuned for the nearest bucket with the same features (B x Nq x Nk = {sizes})"
    else:
        reason = (
            f"no tuned winner for this Problem's features on {gpu.name}: the {gpu.arch} default for head dim "
            f"{problem.head_dim}" + (f" (database unavailable: {winners.error})" if winners.error else "")
        )
        if too_far:
            reason += f"; {too_far} winner(s) with these features are more than one size doubling away"
    stale = winner is not None and winner.triton_version != gpu.triton_version
    if stale:
        reason += f"; tuned under Triton {winner.triton_version}, running {gpu.triton_version} (stale)"
        warnings.warn(
            f"tunegen: using a winner tuned under Triton {winner.triton_version} with Triton "
            f"{gpu.triton_version}; re-run `tunegen tune` to refresh it ({problem.family}, head dim "
            f"{problem.head_dim})",
            StaleWinnerWarning,
            stacklevel=3,
        )
    kernel = base.build(get(problem.family), variant, problem, gpu)
    return Choice(kernel=kernel, source=source, reason=reason, winner=winner, stale=stale)


def choice_for(problem: Problem, gpu: Gpu) -> Choice:
    """The cached Choice for (problem, gpu), made on first use under a lock."""
    key = (problem, gpu)
    choice = _CHOICES.get(key)
    if choice is None:
        with _LOCK:
            choice = _CHOICES.get(key)
            if choice is None:
                choice = choose(problem, gpu)
                _CHOICES[key] = choice
                log.info(
                    "tunegen dispatch: %s on %s -> %s %s (%s)",
                    problem.to_json(),
                    gpu.name,
                    choice.source,
                    choice.kernel.variant.to_json(),
                    choice.reason,
                )
    return choice


def kernel_for(problem: Problem, gpu: Gpu) -> base.Kernel:
    """The kernel for `problem` on `gpu`: a dict lookup after the first call."""
    choice = _CHOICES.get((problem, gpu))
    return choice.kernel if choice is not None else choice_for(problem, gpu).kernel


def deterministic_kernel_for(problem: Problem, gpu: Gpu) -> base.Kernel:
    """The kernel for `problem` on `gpu` under torch.use_deterministic_algorithms: the one
    `kernel_for` serves, made by its family to give the same bits on every run (the backward's dQ
    added in a fixed order), or that kernel itself where it already does."""
    kernel = _DETERMINISTIC.get((problem, gpu))
    if kernel is not None:
        return kernel
    served = kernel_for(problem, gpu)
    family = get(problem.family)
    variant = family.deterministic(served.variant, problem, gpu)
    kernel = served if variant == served.variant else base.build(family, variant, problem, gpu)
    with _LOCK:
        choice = _CHOICES.get((problem, gpu))
        # Kept only while what it derives from is still served (forget() may have run since).
        if choice is not None and choice.kernel is served:
            kernel = _DETERMINISTIC.setdefault((problem, gpu), kernel)
    return kernel


def forget() -> None:
    """Drop every cached choice and the Winners' snapshot (after tuning in this process, say), so
    the next call reads the database again; in a torch.distributed job, call it on every rank in
    step and the ranks share the new snapshot too."""
    with _LOCK:
        _CHOICES.clear()
        _DETERMINISTIC.clear()
        fast_calls.clear()
        snapshot.forget()
