"""What the export tests share: a GPU other than this machine's, a tiled prefill Variant, Winners
recorded into a database, and tunegen's CLI to export and import them."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.tuning_db import GpuRecord, Store, WinnerRecord

H100 = GpuRecord("NVIDIA H100 80GB HBM3", "9.0", 132, 232448, "cuda")
TILED = PrefillVariant(
    block_m=16, block_n=32, num_warps=4, num_stages=1, causal_split=False, order="head_inner", reverse_m=True
)


def record(url: str, gpu: GpuRecord, problem: dict, variant, *, triton_version: str | None = None) -> None:
    with Store(url) as store:
        store.record_winner(
            WinnerRecord(
                gpu=gpu,
                family=problem["family"],
                problem=problem,
                variant=variant.as_dict(),
                median_ms=1.0,
                rel_err=1e-3,
                triton_version=triton_version or interpreter_gpu().triton_version,
                torch_version=torch.__version__,
                template_hash="tuned-template",
            )
        )


def cli(*args: str, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert (result.exit_code == 0) == ok, result.output
    return result


def export(url: str, fmt: str, output: Path, *options: str, ok: bool = True):
    return cli("export", "--format", fmt, "--db", url, "-o", output, *options, ok=ok)
