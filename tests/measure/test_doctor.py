"""`tunegen doctor` reports the database, this GPU's winners, stale ones and, for each family with
winners, dispatch coverage."""

from __future__ import annotations

import dataclasses
import json
import warnings

from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families import get
from tunegen.kernels.families.base import unrendered
from tunegen.kernels.problem import Problem
from tunegen.measure.doctor import SUITES, current_gpu
from tunegen.tuning.presets import PRESETS, problems
from tunegen.tuning_db import Store, WinnerRecord


def suite(family: str = "prefill", fp8: bool = False) -> list[Problem]:
    """The preset Problems doctor counts for a family: every preset's layer kinds the family
    renders, causal and not, and `tunegen tune`'s default lengths and decode batch sizes."""
    every = problems(list(PRESETS.values()), causal=(False, True), family=family, fp8=fp8)
    return [p for p in every if unrendered(get(family), p) is None]


def record(url: str, problem: Problem, triton_version: str | None = None) -> None:
    """Record the family's default Variant as this GPU's Winner for `problem`."""
    gpu = current_gpu()
    variant = get(problem.family).default_variant(problem, gpu).as_dict()
    with Store(url) as store:
        store.record_winner(
            WinnerRecord(
                gpu_record(gpu),
                problem.family,
                problem.as_dict(),
                variant,
                1.0,
                1e-3,
                triton_version or gpu.triton_version,
                "2.13",
                "h",
            )
        )


def doctor(*args: str) -> str:
    """`tunegen doctor ARGS`'s output, run with every warning an error (doctor warns of nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = CliRunner().invoke(main, ["doctor", *args])
    assert result.exit_code == 0, f"{result.output}{result.exception!r}"
    return result.output


def dispatch_lines(text: str) -> list[str]:
    """The text report's dispatch lines, one per family, without the left column."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("dispatch "))
    return [line[11:] for line in lines[first:]]


def test_doctor_lists_stale_winners_and_coverage(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    prefill = suite()
    record(url, prefill[0])
    record(url, prefill[1], "2.0.0")
    report = json.loads(doctor("--db", url, "--format", "json"))
    assert report["database"]["schema"] == report["database"]["head"]
    assert report["winners_for_this_gpu"]["user"] == 2
    assert [s["triton_version"] for s in report["stale"]] == ["2.0.0"]
    cov = report["coverage"]
    assert cov["winner"] == 2 and cov["winner"] + cov["nearest"] + cov["default"] == len(prefill)
    # Prefill winners alone: prefill's line alone.
    assert list(report["dispatch"]) == ["prefill"] and report["dispatch"]["prefill"] == cov
    text = doctor("--db", url)
    assert "stale      1 tuned under another Triton" in text
    assert dispatch_lines(text) == [
        "prefill, every preset, causal and not, N = 1024, 4096, 16384, bf16: "
        f"2 tuned, {cov['nearest']} nearest bucket, {cov['default']} default Variant"
    ]


def test_doctor_counts_each_family_with_winners(user_db):
    """Decode, backward and FP8 prefill winners each get their family's counts (by TUNEGEN_DB);
    prefill and FP8 decode, with none, get no line."""
    decode, backward, fp8 = suite("decode"), suite("backward"), suite("prefill", fp8=True)
    # Dispatch takes a nearest bucket at most 3 size doublings away (batch, query and KV length
    # summed). llama3-8b's decode at B = 1, N = 1024 exactly; of the other 8 Problems with its
    # features (B = 1, 16, 64 by N = 1024, 4096, 16384; mistral-7b's are the same), only B = 1,
    # N = 4096 is that near (2 doublings); N = 16384 or B = 16 are 4 away.
    record(user_db, decode[0])
    # Backward tuned only at B = 2, N = 8192, a size the suite lacks: B = 4, N = 4096 and B = 1,
    # N = 16384 are 3 doublings away (nearest); B = 16, N = 1024 is 9 away (default).
    record(user_db, dataclasses.replace(backward[0], batch=2, seqlen_q=8192, seqlen_k=8192))
    # Two of FP8 prefill's Problems exactly (N = 1024 and 4096); N = 16384 is 6 doublings from
    # the nearer one: the default.
    record(user_db, fp8[0])
    record(user_db, fp8[1])
    report = json.loads(doctor("--format", "json"))
    counts = {
        key: (c["winner"], c["nearest"], c["default"], len(c["falls_back"]))
        for key, c in report["dispatch"].items()
    }
    assert counts == {
        "decode": (1, 1, len(decode) - 2, len(decode) - 2),
        "backward": (0, 2, len(backward) - 2, len(backward) - 2),
        "prefill-fp8": (2, 0, len(fp8) - 2, len(fp8) - 2),
    }
    assert report["dispatch"]["prefill-fp8"]["label"] == "FP8 prefill (e4m3 inputs, bf16 output)"
    assert all(p["fp8"] for p in report["dispatch"]["prefill-fp8"]["falls_back"])
    assert report["coverage"]["winner"] == 0 and report["coverage"]["default"] == len(suite())
    assert dispatch_lines(doctor()) == [
        f"decode, every preset, B = 1, 16, 64, cache length 1024, 4096, 16384, bf16: "
        f"1 tuned, 1 nearest bucket, {len(decode) - 2} default Variant",
        f"backward, every preset's layers it renders, causal and not, N = 1024, 4096, 16384, bf16: "
        f"0 tuned, 2 nearest bucket, {len(backward) - 2} default Variant",
        f"FP8 prefill (e4m3 inputs, bf16 output), every preset, causal and not, N = 1024, 4096, 16384: "
        f"2 tuned, 0 nearest bucket, {len(fp8) - 2} default Variant",
    ]
    # At B = 2, N = 1024: B = 1 and 16 at N = 1024 and B = 1 at N = 4096 are within 3 doublings.
    record(user_db, dataclasses.replace(suite("decode", fp8=True)[0], batch=2))
    assert dispatch_lines(doctor())[-1] == (
        "decode over an e4m3 KV cache, every preset, B = 1, 16, 64, cache length 1024, 4096, 16384, "
        f"bf16 queries: 0 tuned, 3 nearest bucket, {len(suite('decode', fp8=True)) - 3} default Variant"
    )


def test_doctor_reports_a_broken_database(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    text = doctor("--db", f"sqlite:///{tmp_path / 'junk.db'}")
    assert "ERROR:" in text and "not a SQLite database" in text


def test_doctor_on_a_database_not_created_yet(tmp_path):
    """No winners at all: the prefill line, every Problem on the default; no database made."""
    text = doctor("--db", f"sqlite:///{tmp_path / 'none.db'}")
    assert "not created yet" in text and not (tmp_path / "none.db").exists()
    assert dispatch_lines(text) == [
        "prefill, every preset, causal and not, N = 1024, 4096, 16384, bf16: "
        f"0 tuned, 0 nearest bucket, {len(suite())} default Variant"
    ]


def test_doctor_reports_rows_it_cannot_serve_and_counts_the_rest(tmp_path):
    """A stored row without its Problem's family (written by hand or an older release) crashed
    doctor (KeyError 'family'); one whose Problem is not JSON crashed reading the store. Both are
    listed with the reason, and the good Winner beside them still counts."""
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'd.db'}"
    prefill = suite()
    record(url, prefill[0])
    gpu = current_gpu()
    variant = get("prefill").default_variant(prefill[1], gpu).as_dict()
    no_family = {k: v for k, v in prefill[1].as_dict().items() if k != "family"}
    bad = WinnerRecord(
        gpu_record(gpu), "prefill", no_family, variant, 1.0, 1e-3, gpu.triton_version, "2", "h"
    )
    with Store(url) as store:
        store.record_winners([bad, dataclasses.replace(bad, problem=prefill[2].as_dict())])
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE tunegen_problems SET key = '{not json' WHERE key = :key"),
            {"key": json.dumps(prefill[2].as_dict(), sort_keys=True, separators=(",", ":"))},
        )
    engine.dispose()
    report = json.loads(doctor("--db", url, "--format", "json"))
    reasons = sorted(u["reason"] for u in report["unusable"])
    assert len(reasons) == 2 and "problem: missing fields ['family']" in reasons
    assert "problem: expected an object of the Problem's fields, got {}" in reasons
    assert report["winners_for_this_gpu"]["user"] == 1 and report["coverage"]["winner"] == 1
    text = doctor("--db", url)
    assert "unusable   2 stored rows this tunegen cannot serve (skipped):" in text
    assert "missing fields ['family']" in text


def test_doctor_counts_the_layer_kinds_of_current_models_each_family_renders(monkeypatch):
    """Every suite holds the presets' layer kinds (gpt-oss's window and sinks at N = 16384, its
    sliding layers causal only: their window's right side is 0), and none a family does not render."""
    prefill = SUITES["prefill"].problems()
    assert any(p.window_left == 127 and p.sinks and p.seqlen_q == 16384 for p in prefill)
    assert all(p.causal for p in prefill if p.window_left >= 0 or p.attention_chunk)
    monkeypatch.setattr(type(get("backward")), "model_features", frozenset())
    backward = SUITES["backward"].problems()
    assert backward and not any(p.model_features for p in backward)
    assert len(backward) == len([p for p in prefill if not p.model_features])
