"""What a tuning run is asked to do (TuneOptions), checked when it is made."""

from __future__ import annotations

import dataclasses

from tunegen.tuning.samplers import SAMPLERS

# Optuna's samplers take seeds below 2**32.
MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """How hard to search: evaluated trials per Problem, a time limit per Problem, the sampler;
    compile workers; how long a trial may take; the heartbeat that tells a dead process's trials
    from live ones (a trial not heard from for `grace_s` seconds is failed and queued again); and
    the CPU cores to run on: the first for the timing worker alone (so compiles, which now run
    while it times, do not delay its launches), the rest for the compile workers (None: any)."""

    trials: int = 40
    timeout: float | None = None
    sampler: str = "tpe"
    seed: int = 0
    workers: int = 8
    trial_timeout: float = 120.0
    url: str | None = None
    heartbeat_s: int = 10
    grace_s: int = 60
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {SAMPLERS}, got {self.sampler!r}")
        for name in ("trials", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        for name in ("timeout", "trial_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed: expected 0 to {MAX_SEED}, got {self.seed}")
        if not 0 < self.heartbeat_s < self.grace_s:
            raise ValueError(
                f"heartbeat_s, grace_s: expected 0 < heartbeat_s < grace_s, got {self.heartbeat_s}, "
                f"{self.grace_s}"
            )
