"""Rows this release cannot serve (written by another release or by hand: a Problem without its
family, an unknown knob, JSON that is not an object or not JSON at all) never crash `tunegen list`,
`show`, the JSON export or dispatch's snapshot: each is reported with the reason, skipped by
dispatch and left out of exports, while the good rows beside them are served."""

from __future__ import annotations

import dataclasses
import json

import sqlalchemy as sa
from click.testing import CliRunner

from store_records import GOOD, dispatch_snapshot, servable
from tunegen.cli.main import main
from tunegen.kernels import snapshot
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import Store


def damaged_store(url: str) -> dict[str, int]:
    """A store holding GOOD and four damaged rows on the same GPU; the damaged rows' ids by kind."""
    no_family = {k: v for k, v in servable(1).problem.items() if k != "family"}
    rows = {
        "good": GOOD,
        "no_family": dataclasses.replace(servable(1), problem=no_family),
        "unknown_knob": dataclasses.replace(servable(2), variant={"block_m": 64, "warp_magic": 1}),
        "not_json": servable(3),
        "not_object": servable(4),
    }
    with Store(url) as store:
        store.record_winners(list(rows.values()))
        ids = {w.problem.get("seqlen_q"): w.id for w in store.winners()}
    found = {kind: ids[w.problem["seqlen_q"]] for kind, w in rows.items()}
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for kind, text in (("not_json", "{not json"), ("not_object", "[1, 2]")):
            problem_id = conn.execute(
                sa.text("SELECT problem_id FROM tunegen_winners WHERE id = :id"), {"id": found[kind]}
            ).scalar_one()
            conn.execute(
                sa.text("UPDATE tunegen_problems SET key = :key WHERE id = :id"),
                {"key": text, "id": problem_id},
            )
    engine.dispose()
    return found


def test_list_and_show_report_damaged_rows_with_the_reason(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    ids = damaged_store(url)
    runner = CliRunner()
    table = runner.invoke(main, ["list", "--db", url])
    assert table.exit_code == 0, f"{table.output}{table.exception!r}"
    assert f"unusable: id {ids['no_family']} " in table.output and "missing fields ['family']" in table.output
    assert (
        f"unusable: id {ids['unknown_knob']} " in table.output
        and "unknown knobs ['warp_magic']" in table.output
    )
    assert f"unusable: id {ids['not_json']} " in table.output and f"id {ids['good']} " not in table.output
    listed = runner.invoke(main, ["list", "--db", url, "--format", "json"])
    assert listed.exit_code == 0, f"{listed.output}{listed.exception!r}"
    reasons = {w["id"]: w["unusable"] for w in json.loads(listed.output)}
    assert reasons[ids["good"]] is None
    assert "expected an object of the Problem's fields" in reasons[ids["not_object"]]
    for winner_id in ids.values():
        shown = runner.invoke(main, ["show", "--db", url, str(winner_id)])
        assert shown.exit_code == 0, f"{shown.output}{shown.exception!r}"
        assert json.loads(shown.output)["unusable"] == reasons[winner_id]


def test_the_json_export_leaves_damaged_rows_out_and_imports_whole(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    damaged_store(url)
    runner = CliRunner()
    out = runner.invoke(main, ["export", "--db", url, "-o", str(tmp_path / "out")])
    assert out.exit_code == 0, f"{out.output}{out.exception!r}"
    assert "1 winners" in out.output and out.output.count("tunegen import would refuse it") == 4
    (path,) = (tmp_path / "out").glob("*.json")
    imported = runner.invoke(main, ["import", "--db", f"sqlite:///{tmp_path / 'other.db'}", str(path)])
    assert "merged 1, replaced 0, skipped 0" in imported.output, imported.output


def test_dispatch_serves_the_good_rows_beside_damaged_ones(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 't.db'}"
    damaged_store(url)
    with dispatch_snapshot(url, monkeypatch) as (gpu, taken):
        assert taken.error is None and [w.problem for w in taken.user] == [GOOD.problem]
        mine, _ = taken.matching(Problem(**GOOD.problem))
        assert [w.variant for w in mine] == [GOOD.variant]
        shared = snapshot._from_json(snapshot._to_json(gpu, taken))
        assert [w.problem for w in shared.user] == [GOOD.problem], "ranks can share the snapshot"
