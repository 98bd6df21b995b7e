"""Which GPUs a tuning run uses and how its ranks share the host: the host's CUDA devices,
`--gpus` parsed to device indices, one Rank per device (the CUDA_VISIBLE_DEVICES entry it is
shown), ranks grouped by GPU model, and each rank's share of the CPU cores."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tunegen.kernels.compiler import ready_to_fork
from tunegen.kernels.gpu import DeviceFacts, Gpu, device_facts, driver_version, interpreting
from tunegen.tuning import zygote


@dataclasses.dataclass(frozen=True)
class Rank:
    """One GPU of the run: its index as this process numbers CUDA devices (or the number of an
    interpreter stand-in), what CUDA_VISIBLE_DEVICES the rank gets (None: this process's own
    view, for a rank run in this process), its Gpu identity, and for a CUDA device its facts,
    which its compile workers compile for without asking CUDA (gpu.set_meta_device)."""

    index: int
    visible: str | None
    gpu: Gpu
    facts: DeviceFacts | None = None

    @property
    def name(self) -> str:
        """How the timeline and messages name the rank."""
        return f"{'stand-in' if self.gpu.backend == 'interpreter' else 'GPU'} {self.index}"


def cuda_devices() -> list[DeviceFacts]:
    """This host's CUDA devices, as CUDA_VISIBLE_DEVICES shows them (none without CUDA): see
    DeviceQuery, whose answer this waits for."""
    return DeviceQuery().result()


class DeviceQuery:
    """This host's CUDA devices being asked, in a forked child where this process has not touched
    CUDA yet: once a process asks CUDA anything, even whether it is there, the processes it forks
    can no longer use it, and the ranks and their workers are forked from this one (zygote.py).
    Asked here where that was too late. While the child asks (0.6 s), a thread of this process
    gets ready to fork the ranks (`_get_ready`, 0.6 s), and the command that made the query goes
    on (`tunegen tune` imports the tuning database's layer, 0.6 s on an H200 host, 2026-11-26);
    `result()` waits for the answer and the thread. Nothing may fork in between."""

    def __init__(self) -> None:
        self._found: list[DeviceFacts] | None = None
        self._child = None
        self.answered: float | None = None  # when the devices were known (time.time())
        if not zygote.usable():
            self._found = _devices()
            self.answered = time.time()
            return
        context = multiprocessing.get_context("fork")
        self._ours, theirs = context.Pipe(duplex=False)
        self._child = context.Process(target=_send_devices, args=(theirs,), daemon=True)
        self._child.start()
        theirs.close()
        self._ready: list = []  # what _get_ready returned, or the exception it raised
        self._readying = threading.Thread(target=self._get_ready, name="tunegen-get-ready")
        self._readying.start()

    def _get_ready(self) -> None:
        try:
            self._ready.append(_get_ready())
        except BaseException as exc:  # raised where the answer is waited for
            self._ready.append(exc)

    def result(self) -> list[DeviceFacts]:
        """The devices found (asked in this process where no child could be forked)."""
        if self._child is None:
            return self._found or []
        try:
            self._readying.join()
            found, self.answered = self._ours.recv()
        except EOFError:
            self._child.join()
            raise RuntimeError(
                f"querying this host's CUDA devices died (exit code {self._child.exitcode})"
            ) from None
        finally:
            self._ours.close()
            self._child.join()
        (unready,) = self._ready
        if isinstance(unready, BaseException):
            raise unready
        if found and unready:
            warnings.warn(
                f"tunegen tune: Triton's CUDA driver could not be made ahead of the workers ({unready}); "
                "each makes its own, which slows its first compile",
                stacklevel=2,
            )
        return _devices() if found is None else found


def _get_ready() -> str | None:
    """What every rank and worker forked from this process would otherwise do for itself before
    its first trial: Triton's share (compiler.ready_to_fork, whose failure it returns) and the
    NVIDIA driver's version, which each rank records (nvidia-smi, run meanwhile). Only where a
    CUDA build may compile."""
    if torch.version.cuda is None or interpreting():
        return None
    smi = threading.Thread(target=driver_version, name="tunegen-driver-version")
    smi.start()
    try:
        return ready_to_fork()
    finally:
        smi.join()


def _devices() -> list[DeviceFacts]:
    return [device_facts(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _send_devices(conn: Any) -> None:
    # None: this process's parent had asked CUDA something already, which forking cannot undo
    found = None if torch.cuda._is_in_bad_fork() else _devices()
    conn.send((found, time.time()))


def select(spec: str, count: int) -> list[int]:
    """The device indices `spec` names among `count` devices: "all"; a number N (the first N);
    or a comma-separated list of indices ("0,2,5"; one device: "3,")."""
    spec = spec.strip()
    if spec == "all":
        return list(range(count))
    try:
        indices = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        indices = []
    if not indices:
        raise ValueError(f"gpus: expected all, a count or indices like 0,2,5; got {spec!r}")
    if "," not in spec:
        if not 1 <= indices[0] <= count:
            raise ValueError(f"gpus: this host has {count} GPU(s); asked for {indices[0]}")
        return list(range(indices[0]))
    if len(set(indices)) != len(indices):
        raise ValueError(f"gpus: expected distinct indices, got {spec!r}")
    if not all(0 <= i < count for i in indices):
        raise ValueError(f"gpus: this host's GPUs are 0..{count - 1}; got {spec!r}")
    return indices


def cuda_ranks(indices: list[int], devices: Callable[[int], DeviceFacts]) -> list[Rank]:
    """Ranks for CUDA devices `indices`, each shown only its own device (through the entry of
    this process's CUDA_VISIBLE_DEVICES that the index stands for, if that is set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else None
    return [Rank(i, entries[i] if entries else str(i), devices(i).gpu(), devices(i)) for i in indices]


def groups(ranks: list[Rank]) -> dict[Gpu, list[Rank]]:
    """Ranks by GPU model: those sharing a Gpu identity tune together; Winners never mix."""
    out: dict[Gpu, list[Rank]] = {}
    for rank in ranks:
        out.setdefault(rank.gpu, []).append(rank)
    return out


# Where Linux describes which logical CPUs share a physical core.
TOPOLOGY = Path("/sys/devices/system/cpu")
# From this many physical cores, a rank leaves idle the other hyper-threads of its timing worker's
# core: the GPU waits on that worker, the compiles have cores to spare.
TIMING_CORE_ALONE = 4


def cores(position: int, ranks: int, topology: Path = TOPOLOGY) -> tuple[int, ...] | None:
    """The CPU cores of the rank at `position` of `ranks`, its timing worker's first: an equal share
    of the physical cores this process may use, each with its hyper-threads, so that no two ranks
    (nor a rank's timing worker and its compiles, from TIMING_CORE_ALONE on) share a physical core.
    None where the platform cannot pin processes, and for the ranks past the last whole share
    where there are fewer physical cores than ranks (those run wherever the system puts them)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    physical = _physical(sorted(os.sched_getaffinity(0)), topology)
    share = max(1, len(physical) // ranks)
    mine = physical[position * share : (position + 1) * share]
    if not mine:
        return None
    (timing, *siblings), *rest = mine
    kept = siblings if len(mine) < TIMING_CORE_ALONE else []
    return (timing, *kept, *(cpu for group in rest for cpu in group))


def _physical(cpus: list[int], topology: Path) -> list[list[int]]:
    """`cpus` grouped by the physical core they are hyper-threads of, as `topology` lists each
    one's siblings (each alone where it does not say), groups in the order of their first."""
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        try:
            key = (topology / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            key = f"cpu{cpu}"
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())
