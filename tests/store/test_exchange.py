"""Winners leave and enter the store as JSON (round trip, merge report, invalid documents import
nothing), shipped winners come after the user's, Optuna studies share the database, and the
command line lists, shows, exports, imports and upgrades it."""

from __future__ import annotations

import dataclasses
import json

import optuna
import pytest
from click.testing import CliRunner

from store_records import H100, problem, servable, winner
from tunegen.cli.main import main
from tunegen.tuning_db import (
    Store,
    TuningDbError,
    export_documents,
    head_revision,
    import_document,
    load_shipped,
)


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tunegen.db'}"


def test_json_round_trip_and_merge_report(url, tmp_path):
    with Store(url) as store:
        store.record_winners([winner(i, ms=1.0 + i) for i in range(3)])
        documents = export_documents(store)
    ((name, doc),) = documents.items()
    assert name == "nvidia_h100_80gb_hbm3_sm90_cuda.json" and len(doc["winners"]) == 3
    json.dumps(doc)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with Store(other) as store:
        assert import_document(store, doc).__dict__ == {"merged": 3, "replaced": 0, "skipped": 0}
        assert import_document(store, doc).__dict__ == {"merged": 0, "replaced": 0, "skipped": 3}
        faster = json.loads(json.dumps(doc))
        next(e for e in faster["winners"] if e["median_ms"] == 2.0)["median_ms"] = 0.5
        assert import_document(store, faster).__dict__ == {"merged": 0, "replaced": 1, "skipped": 2}
        assert sorted(w.median_ms for w in store.winners()) == [0.5, 1.0, 3.0]


@pytest.mark.parametrize(
    ("path", "value", "pattern"),
    [
        (("format",), "other", r"format: expected 'tunegen-winners'"),
        (("winners", 1, "median_ms"), -1, r"winners\[1\]\.median_ms: expected a positive finite number"),
        (("winners", 1, "median_ms"), float("inf"), r"winners\[1\]\.median_ms: expected a positive finite"),
        (("winners", 2, "rel_err"), "small", r"winners\[2\]\.rel_err"),
        (("winners", 0, "created_at"), "yesterday", r"winners\[0\]\.created_at: expected an ISO 8601 time"),
        (("gpu", "sm_count"), "many", r"gpu\.sm_count: expected an integer"),
    ],
)
def test_invalid_documents_import_nothing(url, path, value, pattern):
    with Store(url) as store:
        store.record_winners([winner(i, ms=1.0 + i) for i in range(3)])
        (doc,) = export_documents(store).values()
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with Store(url.replace("tunegen.db", "fresh.db")) as store:
        with pytest.raises(ValueError, match=pattern):
            import_document(store, doc)
        assert store.winners() == []


def test_shipped_winners_come_after_the_users(tmp_path, url):
    with Store(url) as store:
        store.record_winner(winner(0, ms=3.0, block_m=32))
        (doc,) = export_documents(store).values()
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    (shipped_dir / "h100.json").write_text(json.dumps(doc))
    shipped = load_shipped(shipped_dir)
    assert [w.variant["block_m"] for w in shipped.winners(gpu=H100, problem=problem(0))] == [32]
    with pytest.raises(TuningDbError, match="read-only"):
        shipped.record_winner(winner())
    assert load_shipped(tmp_path / "nothing-shipped").winners() == []


def test_optuna_studies_share_the_database(url):
    with Store(url) as store:
        store.record_winner(winner())
    study = optuna.create_study(study_name="prefill-test", storage=url, direction="minimize")
    study.optimize(lambda trial: (trial.suggest_int("block_m", 16, 128) - 64) ** 2, n_trials=3)
    with Store(url) as store:
        assert store.revision() == head_revision() and len(store.winners()) == 1
    assert len(optuna.load_study(study_name="prefill-test", storage=url).trials) == 3


def test_cli_list_show_export_import_upgrade(url, tmp_path):
    runner = CliRunner()
    with Store(url) as store:
        store.record_winners([servable(i, ms=1.0 + i) for i in range(2)])
    table = runner.invoke(main, ["list", "--db", url])
    assert table.exit_code == 0, table.output
    assert "bfloat16 D128 H32/8" in table.output and "1.40x sdpa-flash" in table.output
    listed = json.loads(runner.invoke(main, ["list", "--db", url, "--format", "json"]).output)
    assert {w["median_ms"] for w in listed} == {1.0, 2.0}
    shown = json.loads(runner.invoke(main, ["show", "--db", url, str(listed[0]["id"])]).output)
    assert shown["gpu"]["driver"] == "580.159.04" and shown["template_hash"] == "abc123"
    assert "no winner with id 99" in runner.invoke(main, ["show", "--db", url, "99"]).output
    out = runner.invoke(main, ["export", "--db", url, "-o", str(tmp_path / "exported")])
    assert out.exit_code == 0 and "2 winners" in out.output
    other = f"sqlite:///{tmp_path / 'other.db'}"
    files = [str(p) for p in (tmp_path / "exported").glob("*.json")]
    imported = runner.invoke(main, ["import", "--db", other, *files])
    assert "merged 2, replaced 0, skipped 0" in imported.output
    (tmp_path / "bad.json").write_text("{not json")
    bad = runner.invoke(main, ["import", "--db", other, str(tmp_path / "bad.json")])
    assert bad.exit_code != 0 and "not readable JSON" in bad.output
    upgraded = runner.invoke(main, ["db", "upgrade", "--db", f"sqlite:///{tmp_path / 'new.db'}"])
    assert upgraded.exit_code == 0 and f"none -> {head_revision()}" in upgraded.output
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    junk = runner.invoke(main, ["list", "--db", f"sqlite:///{tmp_path / 'junk.db'}"])
    assert junk.exit_code != 0 and "not a SQLite database" in junk.output


def test_lookups_see_the_users_database_first_then_the_shipped_one(tmp_path, monkeypatch):
    from tunegen import tuning_db
    from tunegen.kernels import database, dispatch, snapshot
    from tunegen.kernels.gpu import Gpu
    from tunegen.kernels.problem import Problem

    gpu = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, "3.6.0", "2.11.0", "cuda")
    problem = Problem("prefill", "bfloat16", 128, True, 32, 8, 4, 4096, 4096)
    record = database.gpu_record(gpu)
    user_url = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("TUNEGEN_DB", user_url)
    assert database.database_url() == user_url and database.database_url("sqlite://") == "sqlite://"
    mine = dataclasses.replace(winner(ms=2.0, block_m=64), gpu=record, problem=problem.as_dict())
    shipped = dataclasses.replace(winner(ms=1.0, block_m=128), gpu=record, problem=problem.as_dict())
    with Store(f"sqlite:///{tmp_path / 'ship.db'}") as store:
        store.record_winner(shipped)
        (doc,) = export_documents(store).values()
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "h100.json").write_text(json.dumps(doc))
    monkeypatch.setattr(tuning_db, "shipped_store", lambda: load_shipped(tmp_path / "shipped"))

    def served() -> tuple[list[int], list[int], int]:
        snapshot.forget()
        taken = snapshot.for_gpu(gpu)
        user, ship = taken.matching(problem)
        chosen = dispatch.select(problem, gpu, taken).variant.block_m
        return [w.variant["block_m"] for w in user], [w.variant["block_m"] for w in ship], chosen

    assert served() == ([], [128], 128), "no user database yet: the shipped Winner"
    assert not (tmp_path / "user.db").exists(), "a lookup never creates the user's database"
    with Store(user_url) as store:
        store.record_winner(mine)
    assert served() == ([64], [128], 64), "the user's own Winner before a faster shipped one"
    snapshot.forget()
