"""Exports ship the Winners without tunegen. The exported package, imported in a fresh interpreter
where tunegen cannot be imported, keys each call under the Problem tunegen would, serves the
Winner tunegen's dispatch would, and computes what tunegen computes, bit for bit, within float64
tolerance; JSON exports are one sorted, importable file per GPU; every export carries its
provenance and one table holds one GPU unless mixing is asked for. AOT exports:
test_export_aot.py."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import tunegen
from export_cases import H100, TILED, cli, export, record
from helpers import REL_TOL, assert_lse, rel_err
from tunegen.calls import DecodeCall
from tunegen.kernels import dispatch
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families.decode import DecodeVariant
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.gpu import cuda_gpu, interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.reference import attention_reference, attention_varlen_reference

CHILD = Path(__file__).resolve().parent / "export_child.py"
SQUARE = PrefillVariant(block_m=32, block_n=16, num_warps=4, num_stages=1)
SPLIT = DecodeVariant(block_n=16, num_splits=2, num_warps=4, num_stages=1, pack_gqa=True)


def cases(device: torch.device) -> list[dict]:
    """Fresh random inputs at ragged sizes: GQA prefill with log-sum-exp, float32 prefill, varlen
    with an empty sequence, decode appending to a cache; then an uncovered Problem (plain, then
    strict) and a bad argument."""
    gen = torch.Generator().manual_seed(7)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = randn(2, 4, 37, 24), randn(2, 2, 45, 24), randn(2, 2, 45, 24)
    q32, k32, v32 = (randn(1, h, 40, 16, dtype=torch.float32) for h in (2, 1, 1))
    cu_q = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 10, 29], dtype=torch.int32, device=device)
    packed = (randn(24, 2, 24), randn(29, 2, 24), randn(29, 2, 24), cu_q, cu_k, 19, 19)
    seqlens = torch.tensor([17, 30], dtype=torch.int32, device=device)
    cache = (randn(2, 2, 4, 24), randn(2, 50, 2, 24), randn(2, 50, 2, 24), seqlens)
    new = {"k": randn(2, 2, 2, 24), "v": randn(2, 2, 2, 24), "return_lse": True}
    return [
        {"fn": "attention", "args": (q, k, v), "kwargs": {"causal": True, "return_lse": True}},
        {"fn": "attention", "args": (q32, k32, v32), "kwargs": {}},
        {"fn": "attention_varlen", "args": packed, "kwargs": {"causal": True, "return_lse": True}},
        {"fn": "decode_attention", "args": cache, "kwargs": new},
        {"fn": "attention", "args": (q, k, v), "kwargs": {}},
        {"fn": "attention", "args": (q, k, v), "kwargs": {"strict": True}},
        {"fn": "attention", "args": (q, k[..., :16], v), "kwargs": {}},
    ]


def tunegen_problem(case: dict) -> dict:
    """The Problem tunegen keys the call under."""
    if case["fn"] == "decode_attention":
        return DecodeCall.checked(*case["args"], return_lse=True).problem().as_dict()
    return tunegen.explain(*case["args"], **case["kwargs"])["problem"]


def run_child(export_dir: Path, package: str, todo: list[dict], tmp_path: Path) -> dict:
    torch.save(todo, tmp_path / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1" if todo[0]["args"][0].device.type == "cpu" else "0"}
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            str(CHILD),
            str(export_dir),
            package,
            str(tmp_path / "cases.pt"),
            str(tmp_path / "results.pt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(tmp_path / "results.pt")


def test_the_exported_package_runs_without_tunegen_and_matches_it(user_db, tmp_path, device):
    gpu = interpreter_gpu() if device.type == "cpu" else cuda_gpu(torch.cuda.current_device())
    todo = cases(device)
    problems = [tunegen_problem(c) for c in todo[:4]]
    record(user_db, gpu_record(gpu), problems[0], TILED)
    record(
        user_db,
        gpu_record(gpu),
        {**problems[1], "seqlen_q": 32, "seqlen_k": 32},
        SQUARE,  # nearest bucket
    )
    record(user_db, gpu_record(gpu), problems[2], SQUARE)
    record(user_db, gpu_record(gpu), problems[3], SPLIT)
    dispatch.forget()  # explain() above chose before these Winners existed
    export(user_db, "python", tmp_path / "out", "--package", "tuned_attention")
    exported = tmp_path / "out" / "tuned_attention"
    code = "\n".join(p.read_text() for p in exported.rglob("*.py"))
    assert not re.search(r"^\s*(import|from)\s+(tunegen|jinja2|sqlalchemy)\b", code, re.M)

    child = run_child(tmp_path / "out", "tuned_attention", todo, tmp_path)
    assert child["leaked"] == []
    got = child["results"]
    assert [r["problem"] for r in got[:5]] == [*problems, tunegen_problem(todo[4])], "Problem keys drifted"
    assert [r["source"] for r in got] == ["winner", "nearest", "winner", "winner", None, None, None]
    assert [r["variant"] for r in got[:4]] == [v.as_dict() for v in (TILED, SQUARE, SQUARE, SPLIT)]

    assert [tunegen.explain(*c["args"], **c["kwargs"])["source"] for c in todo[:3]] == [
        "winner",
        "nearest",
        "winner",
    ]
    for case, result in zip(todo[:4], got[:4], strict=True):
        assert result["error"] is None and result["warnings"] == []
        theirs = getattr(tunegen, case["fn"])(*case["args"], **case["kwargs"])
        for mine, same in (
            zip(result["out"], theirs, strict=True)
            if isinstance(theirs, tuple)
            else [(result["out"], theirs)]
        ):
            assert torch.equal(mine, same), f"{case['fn']}: the export differs from tunegen"
    check_against_float64(todo, got)

    fallback, strict, bad = got[4:]
    assert fallback["error"] is None and fallback["warnings"] == ["FallbackWarning"]
    assert tunegen.explain(*todo[4]["args"])["source"] == "default"
    assert strict["error"].startswith("FallbackError: strict mode: no exported kernel serves")
    assert re.match(r"ValueError: k: expected head_dim 24 like q, got 16", bad["error"])


def check_against_float64(todo: list[dict], got: list[dict]) -> None:
    """Each exported output (fresh inputs) against the float64 reference, log-sum-exp included."""
    (q, k, v), (q32, k32, v32) = todo[0]["args"], todo[1]["args"]
    out, lse = got[0]["out"]
    ref, ref_lse = attention_reference(q, k, v, causal=True, scale=24**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
    ref32, _ = attention_reference(q32, k32, v32, causal=False, scale=16**-0.5)
    assert rel_err(got[1]["out"], ref32) < REL_TOL[torch.float32]
    pq, pk, pv, cu_q, cu_k, _, _ = todo[2]["args"]
    out, lse = got[2]["out"]
    ref, ref_lse = attention_varlen_reference(pq, pk, pv, cu_q, cu_k, causal=True, scale=24**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    assert_lse(lse, ref_lse, torch.float16)
    ref, _ = attention_reference(q, k, v, causal=False, scale=24**-0.5)
    assert rel_err(got[4]["out"], ref) < REL_TOL[torch.float16], "the PyTorch fallback"
    dq, k_cache, v_cache, seqlens = todo[3]["args"]
    new_k, new_v = todo[3]["kwargs"]["k"], todo[3]["kwargs"]["v"]
    for b, length in enumerate(seqlens.tolist()):
        keys = torch.cat([k_cache[b, :length], new_k[b]]).transpose(0, 1)[None]
        values = torch.cat([v_cache[b, :length], new_v[b]]).transpose(0, 1)[None]
        ref, _ = attention_reference(dq[b].transpose(0, 1)[None], keys, values, causal=True, scale=24**-0.5)
        assert rel_err(got[3]["out"][0][b].transpose(0, 1)[None], ref) < REL_TOL[torch.float16]


def import_export(folder: Path, package: str):
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(package)
    finally:
        sys.path.remove(str(folder))


def test_the_exported_choice_rule_is_dispatchs(user_db, tmp_path):
    """Exact, nearest (closest in log2 sizes, this Triton's first at equal distance), too far,
    other features, other GPU: the package's lookup and tunegen's dispatch agree on each."""
    gpu = interpreter_gpu()
    base = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64, return_lse=True)

    def at(**sizes) -> Problem:
        return dataclasses.replace(base, **sizes)

    record(user_db, gpu_record(gpu), at().as_dict(), TILED)
    record(user_db, gpu_record(gpu), at(batch=1, seqlen_q=16, seqlen_k=16).as_dict(), SQUARE)
    record(
        user_db,
        gpu_record(gpu),
        at(batch=4, seqlen_q=64, seqlen_k=64).as_dict(),
        SQUARE.replace(block_n=32),
        triton_version="3.0.0",
    )
    record(
        user_db, gpu_record(gpu), at(batch=1, seqlen_q=64, seqlen_k=64).as_dict(), SQUARE.replace(block_m=16)
    )
    record(user_db, H100, at(seqlen_q=256, seqlen_k=256).as_dict(), TILED)
    export(user_db, "python", tmp_path, "--package", "choice_rule", "--allow-mixed-gpus")
    package = import_export(tmp_path, "choice_rule")
    queries = [
        at(),
        at(seqlen_q=128, seqlen_k=128),
        at(batch=2, seqlen_q=32, seqlen_k=32),
        at(batch=8, seqlen_q=256, seqlen_k=512),
        at(seqlen_q=256, seqlen_k=256),
        dataclasses.replace(at(), causal=False),
        at(batch=1, seqlen_q=32, seqlen_k=32),
        at(batch=4, seqlen_q=32, seqlen_k=32),
    ]
    device_gpu = package.gpu_of(torch.device("cpu"))
    outcomes = []
    for problem in queries:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dispatch.StaleWinnerWarning)
            theirs = dispatch.choose(problem, gpu)
        mine = package.lookup(package.Problem(**problem.as_dict()), device_gpu)
        expected = None if theirs.source == "default" else (theirs.source, theirs.kernel.variant.as_dict())
        assert (mine and (mine["source"], mine["variant"])) == expected, problem
        outcomes.append(mine and (mine["source"], mine["triton_version"] == gpu.triton_version))
    current, stale = ("nearest", True), ("nearest", False)
    assert outcomes == [("winner", True), current, current, None, None, None, current, stale]


def test_one_table_holds_one_gpu_unless_asked(user_db, tmp_path):
    problem = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64).as_dict()
    record(user_db, gpu_record(interpreter_gpu()), problem, TILED)
    record(user_db, H100, problem, SQUARE)
    refused = export(user_db, "python", tmp_path / "a", ok=False)
    assert "several GPUs (NVIDIA H100 80GB HBM3, triton-interpreter)" in refused.output
    assert "--allow-mixed-gpus" in refused.output and "--gpu NAME" in refused.output
    assert not (tmp_path / "a" / "tunegen_kernels").exists()
    export(user_db, "python", tmp_path / "b", "--gpu", "triton-interpreter")
    table = json.loads((tmp_path / "b" / "tunegen_kernels" / "table.json").read_text())
    assert [e["gpu"]["name"] for e in table] == ["triton-interpreter"]
    again = export(user_db, "python", tmp_path / "b", "--allow-mixed-gpus", ok=False)
    assert "holds an earlier tunegen export; pass --replace" in again.output
    export(user_db, "python", tmp_path / "b", "--allow-mixed-gpus", "--replace")
    exported = tmp_path / "b" / "tunegen_kernels"
    table = json.loads((exported / "table.json").read_text())
    assert sorted(e["gpu"]["name"] for e in table) == ["NVIDIA H100 80GB HBM3", "triton-interpreter"]
    info = json.loads((exported / "provenance.json").read_text())
    assert info["kind"] == "python" and info["tunegen_version"] == tunegen.__version__
    assert info["exported_with"]["triton"] and info["exported_with"]["torch"] and info["exported_at"]
    assert {g["name"] for g in info["gpus"]} == {"NVIDIA H100 80GB HBM3", "triton-interpreter"}
    assert set(info["templates"]) == {"attention_fwd.py.j2", "export_package/__init__.py.j2"}
    assert "decode_attention" not in import_export(tmp_path / "b", "tunegen_kernels").__all__
    (tmp_path / "c" / "tunegen_kernels").mkdir(parents=True)
    (tmp_path / "c" / "tunegen_kernels" / "mine.txt").write_text("not an export")
    taken = export(user_db, "python", tmp_path / "c", "--gpu", "triton-interpreter", ok=False)
    assert "exists and is not a tunegen export" in taken.output
    assert (
        "package: expected a Python identifier"
        in export(
            user_db, "python", tmp_path / "d", "--package", "not-a-name", "--allow-mixed-gpus", ok=False
        ).output
    )


def test_json_export_is_one_sorted_importable_file_per_gpu(user_db, tmp_path):
    problem = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64).as_dict()
    record(user_db, gpu_record(interpreter_gpu()), problem, TILED)
    record(user_db, H100, problem, SQUARE)
    record(user_db, H100, {**problem, "causal": False}, TILED)
    out = export(user_db, "json", tmp_path / "json").output
    files = sorted((tmp_path / "json").glob("*.json"))
    assert [f.name for f in files] == [
        "nvidia_h100_80gb_hbm3_sm90_cuda.json",
        "triton_interpreter_sm00_interpreter.json",
    ]
    assert "2 winners" in out and "1 winners" in out
    for path in files:
        text = path.read_text()
        assert text == json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n", (
            "sorted, one field a line"
        )
        info = json.loads(text)["provenance"]
        assert info["kind"] == "json" and info["tunegen_version"] == tunegen.__version__
        assert info["templates"]["attention_fwd.py.j2"] and info["winners"]["tuned_template_hashes"] == [
            "tuned-template"
        ]
    imported = cli("import", "--db", f"sqlite:///{tmp_path / 'other.db'}", *files).output
    assert "merged 2," in imported and "merged 1," in imported
    assert (
        "no winners to export"
        in export(user_db, "json", tmp_path / "x", "--family", "decode", ok=False).output
    )
    assert (
        "family: expected one of"
        in export(user_db, "json", tmp_path / "x", "--family", "nope", ok=False).output
    )
