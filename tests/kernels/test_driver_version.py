"""The NVIDIA driver's version a Gpu record carries, read from the kernel module's own line where
Linux shows it (nvidia-smi took seconds on a host whose GPUs sleep between programs)."""

from __future__ import annotations

import shutil

import pytest

from tunegen.kernels import gpu

LINES = {
    "580.82.07": "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 14:23:32 UTC 2025\nGCC version:  gcc version 13.3.0\n",
    "535.183.01": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  "
    "Sun May 12 19:39:15 UTC 2024\n",
}


@pytest.fixture
def fresh(monkeypatch):
    gpu.driver_version.cache_clear()
    yield monkeypatch
    gpu.driver_version.cache_clear()


@pytest.mark.parametrize("version", list(LINES))
def test_the_version_comes_from_the_kernel_modules_line_without_running_nvidia_smi(fresh, tmp_path, version):
    (tmp_path / "version").write_text(LINES[version])
    fresh.setattr(gpu, "DRIVER_FILE", tmp_path / "version")
    fresh.setattr(shutil, "which", lambda name: pytest.fail("nvidia-smi was run"))
    assert gpu.driver_version() == version


def test_without_the_line_nor_nvidia_smi_the_version_is_empty(fresh, tmp_path):
    fresh.setattr(gpu, "DRIVER_FILE", tmp_path / "missing")
    fresh.setattr(shutil, "which", lambda name: None)
    assert gpu.driver_version() == ""
