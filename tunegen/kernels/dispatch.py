"""Dispatch: the kernel that serves a Problem on a Gpu.

The first call for a (Problem, Gpu) looks for a Winner (the user's database, then the shipped
winners): for exactly this Problem, else for the nearest bucket with the same features (at most
one doubling of each size away), else it takes the family's default Variant. It builds that
kernel once, under a lock; every later call is a dict lookup. The public functions keep, per
exact input signature, the kernel's bound call (tunegen.kernels.launcher), so a repeated call is one
lookup and the compiled kernel's own launch. Winners tuned under another Triton version are
used, with one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from tunegen.kernels.database import winners_for
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import TuningDbError, WinnerRecord

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
_LOCK = threading.Lock()
# Calls' exact input signatures (see eager.attention_eager, decode.decode_attention) to the bound
# launch of the kernel their Problem got.
fast_calls: dict[tuple, Callable[..., Any]] = {}


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


def _usable(
    winners: list[WinnerRecord], problem: Problem, gpu: Gpu
) -> list[tuple[WinnerRecord, base.Variant]]:
    family = get(problem.family)
    out = []
    for w in winners:
        try:
            variant = family.variant_type.from_json(w.variant)
            family.check_variant(variant, problem, gpu)
        except (ValueError, TypeError):
            continue  # a Variant this release cannot take: fall through to the next candidate
        out.append((w, variant))
    return out


def _prefer_current(pairs: list[tuple[WinnerRecord, base.Variant]], gpu: Gpu):
    """This Triton version's winner if there is one, else the newest from another version."""
    current = [p for p in pairs if p[0].triton_version == gpu.triton_version]
    return (current or pairs)[0]


def choose(problem: Problem, gpu: Gpu) -> Choice:
    """Find and build what serves `problem` on `gpu` (the slow path, once per Problem)."""
    family = get(problem.family)
    try:
        exact = _usable(winners_for(gpu, problem), problem, gpu)
        nearby = [] if exact else _usable(winners_for(gpu, problem, same_features=True), problem, gpu)
        too_far = [p for p in nearby if _distance(problem, p[0].problem) > NEAREST_MAX_DISTANCE]
        nearby = [p for p in nearby if p not in too_far]
        lookup_error = None
    except TuningDbError as exc:
        exact, nearby, too_far, lookup_error = [], [], [], str(exc)
        warnings.warn(f"tunegen: tuned winners unavailable, using default Variants: {exc}", stacklevel=3)
    if exact:
        winner, variant = _prefer_current(exact, gpu)
        source, reason = "winner", f"tuned for this Problem on {winner.gpu.name} ({winner.median_ms:.4g} ms)"
    elif nearby:
        nearby.sort(
            key=lambda p: (_distance(problem, p[0].problem), p[0].triton_version != gpu.triton_version)
        )
        winner, variant = nearby[0]
        sizes = "x".join(str(winner.problem.get(n)) for n in ("batch", "seqlen_q", "seqlen_k"))
        source, reason = (
            "nearest",
            f"tuned for the nearest bucket with the same features (B x Nq x Nk = {sizes})",
        )
    else:
        winner, variant = None, family.default_variant(problem, gpu)
        source = "default"
        reason = (
            f"no tuned winner for this Problem's features on {gpu.name}: the {gpu.arch} default for head dim "
            f"{problem.head_dim}" + (f" (database unavailable: {lookup_error})" if lookup_error else "")
        )
        if too_far:
            reason += f"; {len(too_far)} winner(s) with these features are more than one size doubling away"
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
    kernel = base.build(family, variant, problem, gpu)
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


def forget() -> None:
    """Drop every cached choice (after tuning in this process, say), so the next call looks again."""
    with _LOCK:
        _CHOICES.clear()
        fast_calls.clear()
