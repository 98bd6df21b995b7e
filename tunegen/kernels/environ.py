"""Setting an environment variable for a block: what Triton reads as it decorates and compiles
kernels, and what a child process copies as it starts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` for the block (None: left as it is), then restored."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
