"""AOT exports compile offline into cubins with C launchers that a C program builds against, and
carry their provenance; on a GPU, the C demo launches them."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NEEDS_GPU

from export_cases import H100, TILED, export, record
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem

AOT_DEMO = Path(__file__).resolve().parent / "aot_demo" / "run.py"


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")
def test_aot_export_compiles_offline_and_the_c_demo_builds_against_it(user_db, tmp_path):
    """What the GPU session runs (tests/export/aot_demo/run.py), short of linking libcuda and
    launching: export for sm_90 on this CPU, write inputs, compile demo.c with the export's C."""
    problem = Problem("prefill", "float16", 64, True, 8, 2, 2, 512, 512)
    record(
        user_db, H100, problem.as_dict(), PrefillVariant(block_m=64, block_n=64, num_warps=4, num_stages=3)
    )
    record(
        user_db, H100, dataclasses.replace(problem, dtype="bfloat16").as_dict(), PrefillVariant(load="desc")
    )
    ws = PrefillVariant(schedule="ws", block_n=128, consumers=2, overlap=True)
    record(user_db, H100, dataclasses.replace(problem, head_dim=128).as_dict(), ws, triton_version="3.6.0")
    record(user_db, gpu_record(interpreter_gpu()), problem.as_dict(), TILED)
    assert "--allow-mixed-gpus" in export(user_db, "aot", tmp_path, ok=False).output
    interpreted = export(user_db, "aot", tmp_path, "--gpu", "triton-interpreter", ok=False)
    assert (
        "no winners to compile ahead of time: tuned on interpreter, which is no GPU target"
        in interpreted.output
    )
    work = tmp_path / "demo"
    done = subprocess.run(
        [
            sys.executable,
            str(AOT_DEMO),
            "--work",
            str(work),
            "--offline",
            "--db",
            user_db,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "0"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "manifest.json: 1 winners" in done.stdout and "global scratch" in done.stdout
    assert "built objects" in done.stdout

    root = work / "aot"
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] == "tunegen-aot" and manifest["provenance"]["kind"] == "aot"
    assert json.loads((root / "provenance.json").read_text()) == manifest["provenance"]
    (row,) = manifest["table"]
    assert row["problem"] == problem.as_dict() and row["gpu"]["capability"] == "9.0"
    reasons = sorted(k["reason"] for k in manifest["skipped"])
    assert [r[:26] for r in reasons] == ["Triton's AOT compiler: Run", "schedule 'ws' is a Gluon k"]
    kernel = manifest["kernels"][row["kernel"]]
    assert kernel["target"] == "cuda:90:32" and [c["aligned"] for c in kernel["cubins"]] == [True, False]
    for cubin in kernel["cubins"]:
        data = (root / cubin["file"]).read_bytes()
        assert len(data) == cubin["bytes"] > 0 and data[:4] == b"\x7fELF"
    header = (root / kernel["header"]).read_text()
    # Triton 3.7 and later declare the entry point through typedefs of their own (TT_ResultTy).
    typedefs = {alias: c_type for c_type, alias in re.findall(r"typedef (\w+) (TT_\w+);", header)}
    header = re.sub(r"\bTT_\w+\b", lambda m: typedefs.get(m.group(0), m.group(0)), header)
    assert re.search(rf"CUresult {kernel['entry']}\(CUstream stream, CUdeviceptr Q, .*float qk_scale", header)
    assert all((root / s).exists() for s in [*kernel["sources"], kernel["triton_source"]])
    assert sorted(p.name for p in root.iterdir()) == [
        ".tunegen-export",
        "manifest.json",
        "provenance.json",
        row["kernel"],
    ]
    nm = shutil.which("nm")
    if nm:
        objects = [str(o) for o in work.glob("tunegen_*.o")]
        defined = subprocess.run([nm, "--defined-only", *objects], capture_output=True, text=True).stdout
        needed = subprocess.run(
            [nm, "--undefined-only", str(work / "demo.o")], capture_output=True, text=True
        )
        assert kernel["entry"] in needed.stdout and re.search(rf" T {kernel['entry']}$", defined, re.M)


@pytest.mark.gpu
@NEEDS_GPU
def test_the_aot_demo_runs_on_the_gpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(AOT_DEMO), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr
