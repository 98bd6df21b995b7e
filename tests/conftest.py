"""Test setup: CPU tests run the real kernels under Triton's interpreter; GPU tests are marked
`gpu` and skipped without CUDA. Rendered kernels go to a per-session cache folder.

One process cannot both interpret and compile Triton kernels (Triton fixes the mode of its own
library functions at import), so on a GPU machine run `pytest -m gpu` for the GPU leg and
`TRITON_INTERPRET=1 pytest` for the CPU leg.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

NEEDS_INTERPRETER = pytest.mark.skipif(not INTERPRETING, reason="CPU kernels need TRITON_INTERPRET=1")
NEEDS_GPU = pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a GPU, compiled kernels")
DEVICES = [
    pytest.param("cpu", marks=NEEDS_INTERPRETER),
    pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_GPU]),
]


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["TUNEGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each correctness test runs on the interpreter (CPU) and, where there is one, the GPU."""
    return torch.device(request.param)


@pytest.fixture
def user_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An empty user database (TUNEGEN_DB), its URL, and dispatch's memory cleared before and after,
    so calls get the defaults unless a test records a Winner."""
    from tunegen.kernels import dispatch

    url = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("TUNEGEN_DB", url)
    dispatch.forget()
    yield url
    dispatch.forget()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards.

    Each test gets its own database so that tests running in parallel (pytest -n) never see each
    other's schema changes. Skipped without TUNEGEN_TEST_PG_URL, except under CI, where the server
    is part of the contract (.ci/postgres.sh).
    """
    server = os.environ.get("TUNEGEN_TEST_PG_URL")
    if not server:
        if os.environ.get("CI"):
            pytest.fail("CI must provide a PostgreSQL server (.ci/postgres.sh)")
        pytest.skip("TUNEGEN_TEST_PG_URL not set")
    import sqlalchemy as sa

    name = f"tunegen_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["spawned", "forked"])
def zygote(request: pytest.FixtureRequest) -> Iterator[object]:
    """None (tuning workers spawned), then a Zygote (workers forked by it): a worker test runs both."""
    from tunegen.tuning.zygote import Zygote, usable

    if request.param == "spawned":
        yield None
        return
    if not usable():
        pytest.skip("workers are forked on Linux only, by a process that has not touched CUDA")
    made = Zygote()
    try:
        yield made
    finally:
        made.close()
