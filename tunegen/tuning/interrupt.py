"""Stopping a tuning process on SIGINT (Ctrl-C) or SIGTERM as an exception, so that it can give its
trials back to the shared study before it exits (see Tuner.close) instead of leaving them running
until the heartbeat's grace runs out. The few steps that must not be cut in two (a trial asked for
but not yet held) defer the exception to their end, and the processes a tuner starts get the
signals only once they can handle them (`blocked`), never as a traceback halfway through starting."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
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
    depth = 0  # deferred() sections the main thread is in
    pending: int | None = None  # a signal that arrived inside one
    raised = False  # Interrupted was raised: the process is stopping, later signals wait for it


def _stop(signum: int) -> Interrupted:
    _State.raised = True
    _POOL_LOG.setLevel(logging.CRITICAL)
    return Interrupted(signum)


def _handler(signum: int, _frame: Any) -> None:
    if _State.raised:
        return
    if _State.depth:
        _State.pending = _State.pending or signum
        return
    raise _stop(signum)


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """While in force, SIGINT and SIGTERM raise `Interrupted` in the main thread, once: signals
    after it are ignored while the process stops, so that a second Ctrl-C (or the terminal's
    SIGINT reaching a process whose parent also forwards a SIGTERM) cannot cut its cleanup short.
    A signal its starter made this process ignore stays ignored; outside the main thread, where
    Python cannot handle signals, this does nothing."""
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
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _State.depth, _State.pending, _State.raised = 0, None, False
        _POOL_LOG.setLevel(pool_level)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold `Interrupted` back until the end of this section (of the main thread: elsewhere no
    signal is handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if not _State.depth and _State.pending is not None:
            signum, _State.pending = _State.pending, None
            raise _stop(signum)


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
