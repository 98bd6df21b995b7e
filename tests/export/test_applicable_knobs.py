"""Listings and the JSON export show the knobs that apply to each Winner's Problem on its GPU
(`tunegen tune`'s table, `tunegen list` and `show`), while the store keeps every knob; exported
files import, into a fresh database or as shipped winners, to the same served Variants."""

from __future__ import annotations

import dataclasses
import json
import shutil

from export_cases import H100, TILED, cli, export, record
from tunegen.export.selection import select
from tunegen.kernels import dispatch
from tunegen.kernels.database import applicable_knobs, gpu_record
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.tuning_db import Store, load_shipped
from tunegen.tuning_db.records import canonical

FP8_KNOBS = ("p_fp8", "v_trans")


def test_tune_list_and_show_print_only_the_knobs_that_apply(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    shape = ("--shape", "4,2,32", "--seqlens", "512", "--causal", "no", "--trials", "2", "--workers", "1")
    tuned = cli("tune", "--db", url, *shape, "--dry-run").output
    assert "block_m=" in tuned and not any(k in tuned for k in FP8_KNOBS), tuned
    with Store(url) as store:
        (w,) = store.winners()
    assert set(FP8_KNOBS) <= set(w.variant), "the store keeps every knob"
    shown = applicable_knobs(w)
    assert not set(FP8_KNOBS) & set(shown) and PrefillVariant.from_json(shown) == PrefillVariant(**w.variant)
    table = cli("list", "--db", url).output
    assert f"block_m={shown['block_m']}" in table and not any(k in table for k in FP8_KNOBS), table
    (listed,) = json.loads(cli("list", "--db", url, "--format", "json").output)
    assert listed["variant"] == shown
    assert json.loads(cli("show", "--db", url, listed["id"]).output)["variant"] == shown


def served(store: Store) -> dict:
    """The Variant dispatch's rule serves for each GPU and Problem in `store`."""
    chosen = select(store, allow_mixed_gpus=True).selected
    return {(s.winner.gpu.name, canonical(s.winner.problem)): s.variant for s in chosen}


def test_json_exports_the_knobs_that_apply_and_imports_the_same_variants(user_db, tmp_path, monkeypatch):
    small = Problem("prefill", "float16", 24, True, 4, 2, 2, 64, 64)
    bf16 = Problem("prefill", "bfloat16", 128, False, 32, 8, 4, 4096, 4096)
    fp8 = dataclasses.replace(bf16, fp8=True)
    ws = PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, overlap=True, persistent=True)
    fa2 = PrefillVariant(block_m=128, block_n=128, num_warps=8, num_stages=3, p_fp8=False, v_trans=True)
    record(user_db, gpu_record(interpreter_gpu()), small.as_dict(), TILED)
    record(user_db, H100, bf16.as_dict(), ws)
    record(user_db, H100, fp8.as_dict(), fa2)
    export(user_db, "json", tmp_path / "json")
    files = sorted((tmp_path / "json").glob("*.json"))
    entries = {
        canonical(e["problem"]): e["variant"] for f in files for e in json.loads(f.read_text())["winners"]
    }
    assert entries[canonical(small.as_dict())] == {
        "block_m": 16,
        "block_n": 32,
        "num_stages": 1,
        "causal_split": False,
        "load": "ptr",
        "order": "head_inner",
        "reverse_m": True,
    }
    assert not set(FP8_KNOBS) & set(entries[canonical(bf16.as_dict())])
    assert {"consumers", "overlap", "persistent"} <= set(entries[canonical(bf16.as_dict())])
    fp8_knobs = entries[canonical(fp8.as_dict())]
    assert (fp8_knobs["p_fp8"], fp8_knobs["v_trans"], "consumers" in fp8_knobs) == (False, True, False)

    other = f"sqlite:///{tmp_path / 'other.db'}"
    cli("import", "--db", other, *files)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for f in files:
        shutil.copy(f, shipped)
    with Store(user_db) as mine, Store(other) as theirs:
        expected = served(mine)
        assert served(theirs) == expected == served(load_shipped(shipped))
        full = {canonical(w.problem): w.variant for w in mine.winners()}
        assert {canonical(w.problem): w.variant for w in theirs.winners()} == full, (
            "the import stores whole Variants, as tuning does"
        )
    assert set(expected.values()) == {TILED, ws, fa2}
    monkeypatch.setenv("TUNEGEN_DB", other)
    dispatch.forget()
    assert dispatch.choose(small, interpreter_gpu()).kernel.variant == TILED, "served from the import"
