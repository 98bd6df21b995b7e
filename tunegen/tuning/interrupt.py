"""Stopping a tuning process on SIGINT (Ctrl-C) or SIGTERM as an exception, so that it can give its
trials back to the shared study before it exits (see Tuner.close) instead of leaving them running
until the heartbeat's grace runs out.

The signal handler only notes the signal; `Interrupted` is raised where the main thread waits
(`check`, `pause`, and the waits of the tuner, the host and the workers, which wait in short
slices), never at whatever line the signal happens to land on. Raised there, it could cut a
lock's acquisition in two (a future's condition in `concurrent.futures.wait`, leaving the thread
that completes it blocked for good) or a database transaction (leaving SQLite's write lock held
by a connection nobody will close): either way the process could no longer give its trials back.
The processes a tuner starts get the signals only once they can handle them (`blocked`), never
as a traceback halfway through starting."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a wait of the main thread goes without looking for a signal.
SLICE_S = 0.1
# Interrupted can surface inside SQLAlchemy's pool as it resets a connection in a finalizer, which
# logs it with a traceback and passes it on: once the process is stopping by request, that log
# says nothing, so it is quieted until `raising()` ends.
_POOL_LOG = logging.getLogger("sqlalchemy.pool")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while `raising()` was in force."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        """The signal's name: SIGINT or SIGTERM."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 128 + its number."""
        return 128 + self.signum


class _State:
    pending: int | None = None  # the first signal that arrived, not yet raised
    raised = False  # Interrupted was raised: the process is stopping, later signals wait for it


def _handler(signum: int, _frame: Any) -> None:
    if not _State.raised and _State.pending is None:
        _State.pending = signum


def check() -> None:
    """Raise `Interrupted` if a signal arrived under `raising()` and none was raised yet (in the
    main thread only: elsewhere this does nothing)."""
    if _State.pending is None or _State.raised:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    signum, _State.pending = _State.pending, None
    _State.raised = True
    _POOL_LOG.setLevel(logging.CRITICAL)
    raise Interrupted(signum)


def pause(seconds: float) -> None:
    """`time.sleep(seconds)`, stopped by a signal (`check`)."""
    deadline = time.monotonic() + seconds
    while True:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, SLICE_S))


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """While in force, SIGINT and SIGTERM raise `Interrupted` in the main thread at its next wait
    (`check`), once: signals after it are ignored while the process stops, so that a second Ctrl-C
    (or the terminal's SIGINT reaching a process whose parent also forwards a SIGTERM) cannot cut
    its cleanup short. A signal that arrives after the last wait is raised as this ends. A signal
    its starter made this process ignore stays ignored; outside the main thread, where Python
    cannot handle signals, this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    pool_level = _POOL_LOG.level
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _handler)
    try:
        unblock()  # a process started under `blocked()` gets what was sent meanwhile, now
        yield
        check()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _State.pending, _State.raised = None, False
        _POOL_LOG.setLevel(pool_level)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread meanwhile: a process started meanwhile starts with
    them blocked (they wait, pending) until it calls `unblock()`, once it can handle them."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker, started once per process, unblocks both when it starts.
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def unblock() -> None:
    """Let SIGINT and SIGTERM reach this thread (see `blocked`)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
