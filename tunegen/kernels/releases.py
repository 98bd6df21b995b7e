"""The Triton releases tunegen runs on, and everything that differs between them, in one place.

Templates read a `Release` (as `r`) where a release renames an API; families read it for the
register budgets their constraints were calibrated with; every launch and compile takes
`COMPILE_OPTIONS`, so a kernel's numerics do not follow a release's defaults. A release outside
`CHECKED` still runs, with a warning at import: nothing here was measured on it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import triton

# The releases CI and the GPU suite run (pyproject.toml's range): 3.6 is the GPU machine's,
# 3.7 the one torch 2.13 for CUDA pins, 3.9 the newest.
CHECKED = ((3, 6), (3, 7), (3, 8), (3, 9))

# Fused multiply-adds, as every release before 3.10 compiled by default and as every kernel was
# verified and timed; 3.10 turns the default off (TRITON_DEFAULT_FP_FUSION).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

# The oldest release of each schedule that needs more than the range's oldest (Gluon's Hopper
# API as of 3.6); the others run on every release that runs tunegen.
SCHEDULES = {"ws": (3, 6)}  # the prefill and backward families' Hopper schedules


def version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.9.0" or "3.7.1+git1234"; (0, 0) if unreadable."""
    parts = text.split(".")[:2]
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        return (0, 0)
    return int(parts[0]), int(parts[1])


@dataclasses.dataclass(frozen=True)
class Release:
    """One Triton release as the templates and families see it."""

    version: tuple[int, int]

    @property
    def name(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    @property
    def checked(self) -> bool:
        return self.version in CHECKED

    @property
    def tma_load(self) -> str:
        """Gluon's TMA copy into shared memory: `async_load` from 3.8 (3.9 removed the old name)."""
        return "async_load" if self.version >= (3, 8) else "async_copy_global_to_shared"

    @property
    def tma_store(self) -> str:
        """Gluon's TMA copy out of shared memory: `async_store` from 3.8."""
        return "async_store" if self.version >= (3, 8) else "async_copy_shared_to_global"

    @property
    def smem_reinterpret(self) -> str:
        """Gluon's view of a shared-memory buffer as another shape or layout: public as
        `reinterpret` from 3.9 (3.6 to 3.8 name it `_reinterpret`)."""
        return "reinterpret" if self.version >= (3, 9) else "_reinterpret"

    @property
    def thread_barrier(self) -> str:
        """Gluon's barrier over a partition's threads: `gl.barrier` from 3.7 (3.6 names it
        `gl.thread_barrier`)."""
        return "gl.barrier" if self.version >= (3, 7) else "gl.thread_barrier"

    @property
    def tma_reduce_helper(self) -> bool:
        """Whether Gluon lacks a public TMA reduce-add (before 3.9): templates then define one over
        the builder op (`create_async_tma_reduce`) that 3.6 to 3.8 already have."""
        return self.version < (3, 9)

    @property
    def tma_reduce(self) -> str:
        """Gluon's TMA reduce-add of a shared-memory tile into global memory, as a template calls it."""
        return "_tma_reduce_add" if self.tma_reduce_helper else "tma.async_atomic_add"

    @property
    def ws_spare_registers(self) -> int:
        """Registers per consumer thread of the Hopper schedule beyond its tiles (indices, row
        statistics, barrier phases): within its tiles plus these, ptxas spills at most 32 bytes
        on 3.6 to 3.8 and 48 on 3.9, which needs 16 more than the others to get there
        (benchmarks/results/ws_registers.md)."""
        return 48 if self.version >= (3, 9) else 32

    @property
    def ws_merge_tile(self) -> bool:
        """Whether the Hopper forward's stream-K merge (`stream_k`) costs a second output tile of
        registers: 3.9 spills 184 bytes at head dim 128 beside the loop's tiles, where 3.6 and 3.7
        spill 8 to 40 (taken for 3.8 too, unmeasured)."""
        return self.version >= (3, 8)

    @property
    def ws_query_registers(self) -> bool:
        """Whether the Hopper forward keeps its query rows in registers (`q_regs`) without
        spilling: at head dim 192 3.9 spills 48 to 920 bytes a thread where 3.6 to 3.8 spill 0 to
        32 (offline sm_90 compiles of each release, session 27)."""
        return self.version < (3, 9)

    @property
    def ws_fp8_head_dims(self) -> tuple[int, ...]:
        """Head dims at which the Hopper schedule takes FP8 inputs: 3.8 and 3.9 spill 100 to 350
        bytes of its e4m3 tiles at head dim 64 whatever registers are left, and at 128 too where
        the key ring or the persistent loop holds more (benchmarks/results/ws_registers.md); FP8
        takes FlashAttention-2's loop there. Measured with P carried in bytes: with P in words
        (issue 34) the defaults compile on 3.8 without spilling, and on 3.9 but the non-causal
        persistent one at 128 (72 bytes; offline, issue34_fp8_h200.md), not yet run on a GPU."""
        return () if self.version >= (3, 8) else (64, 128)

    @property
    def ws_backward_table(self) -> tuple[int, int]:
        """The release whose measured defaults the backward's Hopper schedule takes: 3.7 and
        later compile the same Variants into other code than 3.6, measured best with other knobs
        on 3.7.1 and 3.9.0 alike; 3.9 waits on a warpgroup's wgmma without a barrier over the
        partition when the partition is that one warpgroup, which makes a partition per
        consumer warpgroup 1-11% faster there (benchmarks/results/issue30_h100.md)."""
        if self.version >= (3, 9):
            return (3, 9)
        return (3, 7) if self.version >= (3, 7) else (3, 6)

    def require(self, schedule: str) -> None:
        """Raise ValueError naming `schedule` if its templates need a newer release than this."""
        oldest = SCHEDULES.get(schedule)
        if oldest is not None and self.version < oldest:
            raise ValueError(
                f"variant.schedule: {schedule!r} is written for Triton >= {oldest[0]}.{oldest[1]}, "
                f"not {self.name}"
            )


@functools.cache
def of(text: str) -> Release:
    """The Release of a version string (a Gpu's triton_version, say)."""
    return Release(version(text))


INSTALLED = of(triton.__version__)


def interpreter_problem(numpy_version: str | None = None) -> str | None:
    """Why the installed Triton's interpreter cannot run tunegen's kernels here, or None: Triton
    3.6's takes int() of the one-element arrays that hold its scalars, which numpy 2.4 refuses."""
    if INSTALLED.version >= (3, 7):
        return None
    if numpy_version is None:
        import numpy

        numpy_version = numpy.__version__
    if version(numpy_version) < (2, 4):
        return None
    return (
        f"Triton {INSTALLED.name}'s interpreter needs numpy below 2.4, not {numpy_version}: "
        "install 'numpy<2.4', or Triton 3.7 or newer"
    )


def checked_range() -> str:
    """The checked releases as a person reads them: "3.6 to 3.9"."""
    return f"{Release(CHECKED[0]).name} to {Release(CHECKED[-1]).name}"


def warn_if_unchecked() -> None:
    """Warn once that the installed release is outside the checked range (it still runs)."""
    if not INSTALLED.checked:
        warnings.warn(
            f"tunegen is checked on Triton {checked_range()}; Triton {triton.__version__} is not "
            "among them, so its kernels are unverified there",
            stacklevel=2,
        )
