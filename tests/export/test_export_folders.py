"""Where exports land: an export over an earlier one is refused unless `--replace` is given, and
then only the files the earlier export listed as its own are removed (a user's file inside an
exported package survives); a file no export wrote is never overwritten; a folder that cannot be
written gets a clear error naming the output, not a traceback, and nothing is left behind."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from export_cases import H100, TILED, export, record
from tunegen.export.folders import MANIFEST
from tunegen.kernels.database import gpu_record
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem

PROBLEM = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64).as_dict()
INTERPRETER_FILE = "triton_interpreter_sm00_interpreter.json"
H100_FILE = "nvidia_h100_80gb_hbm3_sm90_cuda.json"


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_package_is_replaced_only_when_asked_and_a_users_file_in_it_survives(user_db, tmp_path):
    record(user_db, gpu_record(interpreter_gpu()), PROBLEM, TILED)
    export(user_db, "python", tmp_path / "out")
    package = tmp_path / "out" / "tunegen_kernels"
    written = json.loads((package / MANIFEST).read_text())["files"]
    assert "table.json" in written and "_tunegen/launcher.py" in written and MANIFEST not in written
    (package / "mine.txt").write_text("my notes")
    (package / "kernels" / "my_kernel.py").write_text("# mine")
    before = listing(package)
    refused = export(user_db, "python", tmp_path / "out", ok=False)
    assert "holds an earlier tunegen export; pass --replace" in refused.output
    assert "Traceback" not in refused.output and listing(package) == before
    export(user_db, "python", tmp_path / "out", "--replace")
    assert listing(package) == before, "the same files, the user's own among them"
    assert (package / "mine.txt").read_text() == "my notes"
    assert (package / "kernels" / "my_kernel.py").read_text() == "# mine"
    assert not [p for p in (tmp_path / "out").iterdir() if p.name != "tunegen_kernels"], "no staging left"


def test_replacing_a_json_export_removes_only_the_files_it_wrote(user_db, tmp_path):
    record(user_db, gpu_record(interpreter_gpu()), PROBLEM, TILED)
    record(user_db, H100, PROBLEM, TILED)
    out = tmp_path / "json"
    export(user_db, "json", out)
    assert listing(out) == [MANIFEST, H100_FILE, INTERPRETER_FILE]
    (out / "notes.txt").write_text("mine")
    assert "pass --replace" in export(user_db, "json", out, ok=False).output
    export(user_db, "json", out, "--gpu", "triton-interpreter", "--replace")
    assert listing(out) == [MANIFEST, "notes.txt", INTERPRETER_FILE], "the H100 file was the export's"
    assert (out / "notes.txt").read_text() == "mine"


def test_a_file_no_export_wrote_is_never_overwritten(user_db, tmp_path):
    record(user_db, gpu_record(interpreter_gpu()), PROBLEM, TILED)
    out = tmp_path / "json"
    out.mkdir()
    (out / INTERPRETER_FILE).write_text("my own file")
    for options in ((), ("--replace",)):
        refused = export(user_db, "json", out, *options, ok=False)
        assert f"{out / INTERPRETER_FILE} exists and no earlier export wrote it" in refused.output
    assert listing(out) == [INTERPRETER_FILE] and (out / INTERPRETER_FILE).read_text() == "my own file"


def test_a_manifest_naming_files_outside_its_folder_is_refused(user_db, tmp_path):
    record(user_db, gpu_record(interpreter_gpu()), PROBLEM, TILED)
    out = tmp_path / "json"
    export(user_db, "json", out)
    (tmp_path / "precious.txt").write_text("keep me")
    (out / MANIFEST).write_text(json.dumps({"format": "tunegen-export-files", "files": ["../precious.txt"]}))
    refused = export(user_db, "json", out, "--replace", ok=False)
    assert "is not a list of exported files this tunegen can read" in refused.output
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("fmt", ["json", "python"])
def test_a_folder_that_cannot_be_written_gets_a_clear_error(user_db, tmp_path, monkeypatch, fmt):
    record(user_db, gpu_record(interpreter_gpu()), PROBLEM, TILED)
    (tmp_path / "a_file").write_text("not a folder")
    blocked = export(user_db, fmt, tmp_path / "a_file" / "out", ok=False)
    assert "output: cannot write the export into" in blocked.output and "Traceback" not in blocked.output

    def denied(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    refused = export(user_db, fmt, tmp_path / "out", ok=False)
    assert "cannot write the export into" in refused.output and "Permission denied" in refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "out").exists()
