"""Worker processes forked from a clean copy of this process rather than spawned.

A spawned worker imports torch, Triton and tunegen afresh before its first task: 5-6 s on the
2 x H200 host (measured 2026-11-26), against 0.04 s for a forked one, which starts with them
imported. The tuner starts workers as its compiles need them, so each spawned one also stalls the
trials it was started for. Forking has two conditions: the parent must not have touched CUDA (a
child of such a process cannot use it), and no other thread of the parent may hold a lock at the
moment of the fork (the child would wait for it for good, for example on its first write to a
stream the parent's display thread was writing). So a rank forks one copy of itself, the zygote,
while it has one thread and no CUDA context; the zygote forks each worker asked of it, handing it
the pipe end it receives over a Unix socket, and reports the worker's exit code once it ended.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tunegen.kernels.gpu import interpreting
from tunegen.tuning.interrupt import blocked

# How often the zygote looks whether a worker it is asked to wait for has ended.
_POLL_S = 0.01
# The longest the zygote warms up (`Zygote`'s `warm`) while its rank waits for its next worker.
WARM_S = 20.0
_MESSAGE = 1 << 16


def usable() -> bool:
    """Whether this process can fork workers that use CUDA, as far as it can tell: Linux, CUDA not
    initialized here, and this process not forked from one that had asked CUDA anything. (A
    question asked here, as `torch.cuda.is_available()`, shows only in the processes forked after
    it: ranks.cuda_devices asks its child.)"""
    return (
        sys.platform.startswith("linux")
        and hasattr(socket, "send_fds")
        and not torch.cuda._is_in_bad_fork()
        and not torch.cuda.is_initialized()
    )


class Zygote:
    """The clean copy of this process that forks its workers. Make it before this process starts
    a thread or touches CUDA (`usable`); it ends when this process closes it or dies. Triton fixes
    as it is imported whether its own library functions are interpreted, so its workers interpret
    kernels or compile them as this process's Triton does (`interpret`), never the other way."""

    def __init__(self, warm: Callable[[], None] | None = None) -> None:
        """`warm`: run in the zygote once it has forked its first worker (the rank's timing
        worker, which the GPU waits for), so that the workers forked after start with what it
        loads (see compiler.warm_compiler); its failure is ignored."""
        self.interpret = interpreting()
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        with blocked():  # it keeps SIGINT and SIGTERM blocked; the workers unblock them (workers._serve)
            self.pid = os.fork()
            if self.pid == 0:
                self._sock.close()
                _serve_forks(theirs, warm)  # never returns
        theirs.close()

    def _ask(self, request: tuple, fds: list[int] = ()) -> Any:
        with self._lock:
            socket.send_fds(self._sock, [pickle.dumps(request)], list(fds))
            answer = self._sock.recv(_MESSAGE)
        if not answer:
            raise ConnectionResetError("the zygote ended")
        return pickle.loads(answer)

    def start(
        self, target: Callable[..., None], conn: multiprocessing.connection.Connection, *args: Any
    ) -> Forked:
        """A new process running `target(conn, *args)` on a duplicate of `conn` (the caller closes
        its own); OSError if the zygote is gone."""
        return Forked(self, self._ask(("start", target, args), [conn.fileno()]))

    def wait(self, pid: int, timeout: float) -> tuple[bool, int | None]:
        """Whether `pid` ended, waiting up to `timeout` seconds, and its exit code (None where it
        is unknown: the zygote did not fork it)."""
        return self._ask(("wait", pid, timeout))

    def close(self) -> None:
        """End the zygote (the workers it forked are not touched: their pipes end them)."""
        with self._lock:
            self._sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class Forked:
    """A worker the zygote forked, with what the Worker uses of multiprocessing's Process. Held by
    a pidfd as well: killed and waited for even once the zygote is gone, and never confused with
    a later process given its pid."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self._code: int | None = None
        self._gone = False  # its exit was seen: its pid may be another's
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # Linux before 5.3, or it ended at once
            self._pidfd = None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._gone:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                gone, code = self._zygote.wait(self.pid, max(0.0, left))
            except OSError:  # the zygote ended (its workers went to init): the code is lost
                gone, code = self._ended(max(0.0, left)), None
            if gone:
                self._code = code
                self._release()
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _ended(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], timeout)[0])  # readable once it exits

    def _release(self) -> None:
        with self._lock:
            self._gone = True
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    @property
    def exitcode(self) -> int | None:
        if not self._gone:
            self.join(0)
        return self._code

    def is_alive(self) -> bool:
        if not self._gone:
            self.join(0)
        return not self._gone

    def kill(self) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif not self._gone:
                os.kill(self.pid, signal.SIGKILL)


def _serve_forks(sock: socket.socket, warm: Callable[[], None] | None) -> None:
    """The zygote's loop: fork a worker per "start" (`warm` after the first), report exit codes
    on "wait", end on EOF."""
    _name("tunegen-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handlers of the process it copies
    keep = sock.fileno()
    os.closerange(3, keep)  # its parent's pipes: their other ends must see EOF when it dies
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    codes: dict[int, int | None] = {}
    try:
        while True:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 1)
            if not data:
                break
            kind, *args = pickle.loads(data)
            if kind == "start":
                target, target_args = args
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    _run(target, fds[0], target_args)
                codes.pop(pid, None)  # an earlier worker's, whose pid it was given again
                os.close(fds[0])
                sock.send(pickle.dumps(pid))
                if warm is not None:
                    _bounded(warm, WARM_S)
                    warm = None
            else:
                pid, timeout = args
                sock.send(pickle.dumps(_reap(pid, timeout, codes)))
    finally:
        os._exit(0)


def _bounded(warm: Callable[[], None], seconds: float) -> None:
    """`warm()`, its failure ignored, cut short after `seconds` by an alarm (the zygote has one
    thread; a hung assembler, say, is killed as the alarm interrupts the wait for it), since the
    rank waits for its next worker meanwhile."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"warming up took over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with contextlib.suppress(Exception):
            warm()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _reap(pid: int, timeout: float, codes: dict[int, int | None]) -> tuple[bool, int | None]:
    deadline = time.monotonic() + timeout
    while pid not in codes:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not one of its workers
            codes[pid] = None
            break
        if done:
            codes[pid] = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            return False, None
        time.sleep(_POLL_S)
    return True, codes[pid]


def _name(name: str) -> None:
    """What `ps` and `top` show for this process (its command line is its parent's)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name)


def _run(target: Callable[..., None], fd: int, args: tuple) -> None:
    _name("tunegen-worker")
    code = 0
    try:
        target(multiprocessing.connection.Connection(fd), *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)
