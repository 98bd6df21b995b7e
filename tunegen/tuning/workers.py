"""Worker processes for tuning: each runs one task at a time and is replaced when it dies or
overruns its time limit, so a kernel that crashes or hangs the GPU context costs one trial,
not the search."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tunegen.kernels.render import interpreting
from tunegen.tuning.interrupt import SLICE_S, blocked, check, unblock
from tunegen.tuning.timeline import Timeline, compile_lane
from tunegen.tuning.zygote import Forked, Zygote

Task = Callable[[dict[str, Any]], dict[str, Any]]


def _serve(conn: Any) -> None:
    # Ctrl-C reaches every process of the terminal: the parent stops the work and ends this
    # process. SIGTERM ends it (as multiprocessing does at exit); the parent then reports the task
    # as stopped, never as the Variant's failure. Both were blocked while it started
    # (Worker._spawn; a forked one inherits the zygote's blocked mask).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock()
    # A host stopped by a signal may close the pipe before its exit ends this process: that is
    # the end of the work too, not an error to print.
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            task, payload = message
            try:
                result = task(payload)
            except Exception as exc:  # report, and keep serving
                result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
            conn.send(result)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return


def _serve_forked(conn: Any, cpus: tuple[int, ...] | None) -> None:
    """A forked worker (its Triton already in its mode, `Worker._fork`): its cores, then `_serve`.
    Its CPU ops run on one thread, as PyTorch's forked DataLoader workers do: GNU OpenMP's threads
    do not survive a fork, and a parallel region (a float64 reference's matmul) would wait for
    them for good where an ancestor process had started them."""
    torch.set_num_threads(1)
    if cpus:
        os.sched_setaffinity(0, cpus)
    _serve(conn)


class Worker:
    """One child process; Triton in it interprets kernels or compiles them, as asked. With `cpus`,
    it and what it starts (the compiler's assembler) run on those cores only. Forked by `zygote`
    where one is given for its mode (starting in milliseconds with this process's imports), else
    spawned."""

    def __init__(
        self, *, interpret: bool, cpus: tuple[int, ...] | None = None, zygote: Zygote | None = None
    ) -> None:
        self.interpret = interpret
        self.cpus = cpus
        self._zygote = zygote
        self._killed = False
        self._stopping = False
        self._start()

    def _start(self) -> None:
        self._conn, child = multiprocessing.Pipe()
        self._process = self._fork(child) or self._spawn(child)
        child.close()

    def _fork(self, child: Any) -> Forked | None:
        if self._zygote is None or self._zygote.interpret != self.interpret:
            return None  # spawned: its Triton imported in the mode it needs
        try:
            return self._zygote.start(_serve_forked, child, self.cpus)
        except OSError:  # the zygote is gone: this worker is spawned from now on
            self._zygote = None
            return None

    def _spawn(self, child: Any) -> Any:
        context = multiprocessing.get_context("spawn")
        # The child reads TRITON_INTERPRET when it first imports Triton.
        with interpreting(self.interpret), blocked():
            process = context.Process(target=_serve, args=(child,), daemon=True)
            process.start()
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(process.pid, self.cpus)
        return process

    def call(self, task: Task, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run `task(payload)` in the child; a death or overrun becomes a failed result, or one with
        status "stopped" where the child was stopped (`kill`, or a SIGTERM): not the task's doing."""
        deadline = time.monotonic() + timeout
        try:
            self._conn.send((task, payload))
            while True:
                check()  # in the main thread, a signal stops the wait (the tuner then kills this)
                left = deadline - time.monotonic()
                if self._conn.poll(min(SLICE_S, max(0.0, left))):
                    return self._conn.recv()
                if left <= 0:
                    break
            reason = f"timed out after {timeout:g} s"
        except (EOFError, OSError, BrokenPipeError):
            reason = "the worker process died"
        self._process.join(0.1)
        code = self._process.exitcode
        if code is not None and code != 0:
            reason += f" (exit code {code})"
        if self._killed:
            return {"status": "stopped", "reason": "the tuning process is stopping"}
        self._restart()
        return {"status": "stopped" if code == -signal.SIGTERM else "error", "reason": reason}

    def _restart(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()
        self._start()

    def kill(self) -> None:
        """End the child now, whatever it is doing: a task it runs returns at once, stopped, and
        the child is not replaced."""
        self._killed = True
        self._process.kill()

    def stop(self) -> None:
        """Ask the child to end once its task is done, without waiting for it (`close` waits):
        children asked together tear down their CUDA contexts side by side."""
        if not self._killed and not self._stopping:
            self._stopping = True
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(None)

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


class WorkerPool:
    """Up to `size` Workers for work that may run side by side (compiling), started as the work
    needs them: `start` at once, one more whenever a task finds every started one busy. A spawned
    worker spends seconds on its imports, a forked one does not; each makes its own CUDA context.
    Free workers are taken most recently freed first, so the ones already warm stay in use. With a
    `timeline`, each task is recorded on its worker's lane; with a `zygote`, the workers are forked
    by it (Worker)."""

    def __init__(
        self,
        size: int,
        *,
        interpret: bool,
        cpus: tuple[int, ...] | None = None,
        timeline: Timeline | None = None,
        start: int | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        self._size = max(1, size)
        self._interpret = interpret
        self._cpus = cpus
        self._zygote = zygote
        self._timeline = timeline
        self._free: queue.LifoQueue[tuple[int, Worker]] = queue.LifoQueue()
        self._all: list[Worker] = []
        self._lock = threading.Lock()
        self._stopping = False
        for _ in range(min(self._size, start or self._size)):
            self._free.put(self._new())
        self._threads = concurrent.futures.ThreadPoolExecutor(self._size, thread_name_prefix="tunegen-pool")

    @property
    def size(self) -> int:
        """How many tasks run at once, at most."""
        return self._size

    @property
    def started(self) -> int:
        """How many workers were started."""
        return len(self._all)

    def _new(self) -> tuple[int, Worker]:
        worker = Worker(interpret=self._interpret, cpus=self._cpus, zygote=self._zygote)
        self._all.append(worker)
        return len(self._all) - 1, worker

    def _take(self) -> tuple[int, Worker]:
        """A free worker; a new one if none is free and fewer than `size` were started."""
        with contextlib.suppress(queue.Empty):
            return self._free.get_nowait()
        with self._lock:
            if len(self._all) < self._size and not self._stopping:
                return self._new()
        return self._free.get()

    def submit(
        self, task: Task, payload: dict[str, Any], timeout: float, label: tuple[str, str] = ("", "")
    ) -> concurrent.futures.Future:
        """Run `task(payload)` on a free worker; the future holds its result. `label`: the
        (name, Problem) its timeline span shows."""

        def run() -> dict[str, Any]:
            index, worker = self._take()
            try:
                if self._timeline is None:
                    return worker.call(task, payload, timeout)
                with self._timeline.span(compile_lane(index), *label):
                    return worker.call(task, payload, timeout)
            finally:
                self._free.put((index, worker))

        return self._threads.submit(run)

    def kill(self) -> None:
        """End every worker now (Worker.kill): the tasks they run return at once."""
        with self._lock:
            self._stopping = True
            workers = list(self._all)
        for worker in workers:
            worker.kill()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._threads.shutdown(wait=True)
        for worker in self._all:
            worker.stop()
        for worker in self._all:
            worker.close()
