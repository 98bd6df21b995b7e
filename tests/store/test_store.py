"""The store never loses a result and never serves a worse or unverified one; damaged, locked,
read-only or too-new databases give a clear error and are left as they were."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import random
import sqlite3

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner

from store_records import H100, problem, winner
from tunegen.cli.main import main
from tunegen.tuning_db import (
    FailureRecord,
    GpuRecord,
    Store,
    TuningDbError,
    head_revision,
)
from tunegen.tuning_db.database import VERSION_TABLE, _alembic_config
from tunegen.tuning_db.models import Base


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tunegen.db'}"


def test_a_winner_is_replaced_only_by_a_faster_one(url):
    with Store(url) as store:
        assert store.record_winner(winner(ms=2.0, block_m=64)) == "inserted"
        assert store.record_winner(winner(ms=2.5, block_m=32)) == "kept"
        assert store.record_winner(winner(ms=1.5, block_m=128)) == "replaced"
        assert store.record_winner(winner(ms=1.5, block_m=16)) == "kept"
        (w,) = store.winners()
        assert (w.median_ms, w.variant["block_m"], w.peer_name, w.gpu.driver) == (
            1.5,
            128,
            "sdpa-flash",
            "580.159.04",
        )
        # Another Triton version keeps its own Winner.
        assert store.record_winner(winner(ms=9.0, triton_version="3.7.0")) == "inserted"
        assert sorted(w.triton_version for w in store.winners()) == ["3.6.0", "3.7.0"]


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"rel_err": float("nan")}, "rel_err"),
        ({"rel_err": None}, "rel_err"),
        ({"median_ms": 0.0}, "median_ms"),
        ({"median_ms": float("inf")}, "median_ms"),
        ({"template_hash": ""}, "template_hash"),
    ],
)
def test_unverified_results_are_refused(url, changes, pattern):
    with Store(url) as store:
        with pytest.raises(ValueError, match=pattern):
            store.record_winner(winner(**changes))
        assert store.winners() == []


def test_failures_are_recorded_once_per_triton_version(url):
    with Store(url) as store:
        fail = FailureRecord(
            H100, "prefill", problem(), {"block_m": 256}, "3.6.0", "OutOfResources: shared memory"
        )
        store.record_failure(fail)
        store.record_failure(dataclasses.replace(fail, reason="again"))
        assert store.failures(H100, "prefill", problem(), "3.6.0") == {
            '{"block_m":256}': "OutOfResources: shared memory"
        }
        assert store.failures(H100, "prefill", problem(), "3.7.0") == {}


def _record_many(args):
    url, seed, keys, per_process = args
    rng = random.Random(seed)
    expected = {}
    with Store(url) as store:
        for n in range(per_process):
            key = rng.randrange(keys)
            ms = rng.uniform(0.5, 5.0)
            store.record_winner(winner(key, ms=ms, block_m=16 << (n % 4)))
            expected[key] = min(ms, expected.get(key, float("inf")))
            store.record_failure(
                FailureRecord(H100, "prefill", problem(key), {"seed": seed, "n": n}, "3.6.0", "x")
            )
    return expected


def _concurrent(url, processes=4, keys=12, per_process=40):
    Store(url).close()  # create the schema once, as `tunegen db upgrade` would
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        results = pool.map(_record_many, [(url, seed, keys, per_process) for seed in range(processes)])
    best = {}
    for result in results:
        for key, ms in result.items():
            best[key] = min(ms, best.get(key, float("inf")))
    with Store(url) as store:
        stored = {w.problem["variant_of"]: w.median_ms for w in store.winners()}
        assert stored == pytest.approx(best), "a faster result was lost"
        failures = sum(len(store.failures(H100, "prefill", problem(k), "3.6.0")) for k in range(keys))
        assert failures == processes * per_process, "a failure record was lost"


def test_concurrent_processes_lose_nothing_on_sqlite(url):
    _concurrent(url)


def test_concurrent_processes_lose_nothing_on_postgresql(postgres_url):
    _concurrent(postgres_url, processes=4, per_process=30)
    with Store(postgres_url) as store:
        assert store.revision() == head_revision()


def test_an_older_schema_upgrades_in_place_and_keeps_its_winners(url):
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        command.upgrade(_alembic_config(conn), "0001")
        conn.execute(sa.text("INSERT INTO tunegen_gpus VALUES (1, 'H100', '9.0', 132, 232448, 'cuda', '');"))
        conn.execute(
            sa.text("INSERT INTO tunegen_problems VALUES (1, :key, 'prefill', '{}', 4, 4096, 4096)"),
            {"key": json.dumps(problem(), sort_keys=True, separators=(",", ":"))},
        )
        conn.execute(
            sa.text("INSERT INTO tunegen_variants VALUES (1, 'prefill', :config)"),
            {"config": '{"block_m":64}'},
        )
        conn.execute(
            sa.text(
                "INSERT INTO tunegen_winners VALUES "
                "(1, 1, 1, 1, '3.6.0', '2.11', '', 'h', 1.25, 300.0, NULL, 0.001, '2026-11-01 00:00:00')"
            )
        )
    engine.dispose()
    with Store(url) as store:
        assert store.revision() == head_revision()
        (w,) = store.winners()
        assert (w.median_ms, w.variant, w.peer_name) == (1.25, {"block_m": 64}, None)
        assert store.record_winner(winner(ms=1.0, gpu=GpuRecord("H100", "9.0", 132, 232448))) == "replaced"


def test_migrations_build_exactly_the_models(url):
    Store(url).close()
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        diffs = compare_metadata(
            MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}), Base.metadata
        )
    assert diffs == []


def _fingerprint(path):
    return path.read_bytes() if path.exists() else None


def test_a_newer_schema_is_refused_and_left_alone(url, tmp_path):
    Store(url).close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    engine.dispose()
    before = _fingerprint(tmp_path / "tunegen.db")
    with pytest.raises(TuningDbError, match=r"revision 9999\) is newer than this tunegen knows"):
        Store(url)
    assert _fingerprint(tmp_path / "tunegen.db") == before


def test_not_a_database(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    before = path.read_bytes()
    with pytest.raises(TuningDbError, match=r"not a SQLite database"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_missing_tables_are_reported_and_nothing_is_recreated(url, tmp_path):
    with Store(url) as store:
        store.record_winner(winner())
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE tunegen_failures"))
    engine.dispose()
    with pytest.raises(TuningDbError, match=r"tables \['tunegen_failures'\] are missing"):
        Store(url)
    assert "tunegen_failures" not in sa.inspect(sa.create_engine(url)).get_table_names()


def test_read_only_database(tmp_path):
    path = tmp_path / "tunegen.db"
    with Store(f"sqlite:///{path}") as store:
        store.record_winner(winner())
    ro = f"sqlite:///file:{path}?mode=ro&uri=true"
    with Store(ro, readonly=True) as store:
        assert len(store.winners()) == 1
        with pytest.raises(TuningDbError, match="opened read-only"):
            store.record_winner(winner(ms=0.1))
    with pytest.raises(TuningDbError, match=r"read-only"):
        Store(ro).record_winner(winner(ms=0.1))
    with Store(f"sqlite:///{path}") as store:
        assert [w.median_ms for w in store.winners()] == [1.0]


def test_a_database_locked_too_long(tmp_path):
    path = tmp_path / "tunegen.db"
    Store(f"sqlite:///{path}").close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with Store(f"sqlite:///{path}", readonly=True, lock_timeout=0.2) as store:
            assert store.winners() == []  # readers are not blocked (WAL)
        with pytest.raises(TuningDbError, match=r"locked for more than 0.2 s"):
            Store(f"sqlite:///{path}", lock_timeout=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with Store(f"sqlite:///{path}") as store:
        assert store.winners() == []


def test_a_missing_database_reads_as_empty_without_being_created(tmp_path):
    path = tmp_path / "none.db"
    with Store(f"sqlite:///{path}", readonly=True) as store:
        assert store.winners() == [] and store.failures(H100, "prefill", problem(), "3.6.0") == {}
    assert not path.exists()


def test_bad_urls():
    with pytest.raises(TuningDbError, match="not a SQLAlchemy URL"):
        Store("not a url")
    with pytest.raises(TuningDbError, match="mysql is not supported"):
        Store("mysql://localhost/db")


def test_a_postgresql_url_without_its_driver_names_the_extra_to_install(monkeypatch):
    url = "postgresql+pg8000://user@127.0.0.1:1/tunegen"  # a driver this environment lacks
    with pytest.raises(TuningDbError, match=r"pip install 'tunegen\[postgres\]'"):
        Store(url)
    monkeypatch.setenv("TUNEGEN_DB", url)
    result = CliRunner().invoke(main, ["list"])
    assert result.exit_code != 0
    assert "tunegen[postgres]" in result.output and "Traceback" not in result.output
