"""What a user sees from `tunegen tune` and `tunegen bench` on a CPU: no Python warnings (the
command's own process runs with warnings as errors; its worker processes' output is read for
any), and FP8 Problems labelled with what they are."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from click.testing import CliRunner

from tunegen.cli.main import main

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="dry runs run kernels under the interpreter"
)
DRY = ["tune", "--dry-run", "--shape", "4,2,32", "--seqlens", "512", "--workers", "1"]


def _quiet_invoke(args: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return CliRunner().invoke(main, args)


def test_a_dry_run_tune_prints_no_warnings_from_any_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "tunegen.cli.main", *DRY, "--trials", "2", "--db", url],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "inserted" in output
    assert "Warning" not in output and "warn" not in output.lower(), output


@pytest.mark.parametrize(
    ("extra", "label"),
    [
        (["--fp8"], "fp8 e4m3 inputs, bf16 output D32"),
        (["--family", "decode", "--fp8", "--batches", "2"], "bfloat16 over an fp8 e4m3 KV cache D32"),
    ],
    ids=["prefill", "decode"],
)
def test_fp8_problems_say_what_they_compute_in(tmp_path, extra, label):
    result = _quiet_invoke([*DRY, "--trials", "2", "--db", f"sqlite:///{tmp_path / 'fp8.db'}", *extra])
    assert result.exit_code == 0, result.output
    assert label in result.output and "inserted" in result.output
    listed = _quiet_invoke(["list", "--db", f"sqlite:///{tmp_path / 'fp8.db'}"])
    assert label.split(" D32")[0] in listed.output


def test_bench_without_a_gpu_says_so_quietly():
    result = _quiet_invoke(["bench", "prefill"])
    assert result.exit_code != 0 and "bench needs a CUDA GPU" in result.output
