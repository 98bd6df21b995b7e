"""Test setup: CPU tests run the real kernels under Triton's interpreter; GPU tests are marked
`gpu` and skipped without CUDA. Rendered kernels go to a per-session cache folder."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")]),
]


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["TUNEGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each correctness test runs on the interpreter (CPU) and, where there is one, the GPU."""
    return torch.device(request.param)
