"""`tunegen doctor` reports the database, this GPU's winners, stale ones and dispatch coverage."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.database import gpu_record
from tunegen.measure.doctor import current_gpu
from tunegen.tuning.presets import PRESETS, problems
from tunegen.tuning_db import Store, WinnerRecord


def test_doctor_lists_stale_winners_and_coverage(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    gpu = current_gpu()
    suite = problems(list(PRESETS.values()), causal=(False, True), seqlens=(1024, 4096, 16384))
    variant = {
        "block_m": 64,
        "block_n": 64,
        "num_warps": 4,
        "num_stages": 2,
        "causal_split": True,
        "load": "ptr",
        "order": "m_inner",
        "reverse_m": False,
    }
    with Store(url) as store:
        for problem, triton_version in ((suite[0], gpu.triton_version), (suite[1], "2.0.0")):
            store.record_winner(
                WinnerRecord(
                    gpu_record(gpu),
                    "prefill",
                    problem.as_dict(),
                    variant,
                    1.0,
                    1e-3,
                    triton_version,
                    "2.13",
                    "h",
                )
            )
    result = CliRunner().invoke(main, ["doctor", "--db", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["database"]["schema"] == report["database"]["head"]
    assert report["winners_for_this_gpu"]["user"] == 2
    assert [s["triton_version"] for s in report["stale"]] == ["2.0.0"]
    cov = report["coverage"]
    assert cov["winner"] == 2 and cov["winner"] + cov["nearest"] + cov["default"] == len(suite)
    text = CliRunner().invoke(main, ["doctor", "--db", url]).output
    assert "stale      1 tuned under another Triton" in text and "2 tuned" in text


def test_doctor_reports_a_broken_database(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    result = CliRunner().invoke(main, ["doctor", "--db", f"sqlite:///{tmp_path / 'junk.db'}"])
    assert result.exit_code == 0 and "ERROR:" in result.output and "not a SQLite database" in result.output


def test_doctor_on_a_database_not_created_yet(tmp_path):
    result = CliRunner().invoke(main, ["doctor", "--db", f"sqlite:///{tmp_path / 'none.db'}"])
    assert "not created yet" in result.output and not (tmp_path / "none.db").exists()
