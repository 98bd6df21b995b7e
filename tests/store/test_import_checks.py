"""`tunegen import` lets nothing invalid into the store: each Problem is rebuilt from its fields and
each Variant through its family's Variant type, checked against the family's space and
constraints on the document's GPU; one bad entry refuses its file, naming the row and field, and
then nothing of any file is written. A file that is not UTF-8 or not JSON gets a clear error."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from store_records import servable
from tunegen.cli.main import main
from tunegen.kernels.database import check_document
from tunegen.tuning_db import Store, documents

DELETE = object()


def document() -> dict:
    """An export document of two Winners this release takes (prefill on an H100)."""
    (doc,) = documents([servable(0), servable(1, ms=2.0)]).values()
    return json.loads(json.dumps(doc))


def changed(path: tuple, value: object) -> dict:
    doc = document()
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


BAD = [
    (("winners", 0, "problem"), {"foo": 1}, r"winners\[0\]\.problem: unknown fields \['foo'\]"),
    (
        ("winners", 1, "problem", "head_dim"),
        -5,
        r"winners\[1\]\.problem\.head_dim: expected 1 to 256, got -5",
    ),
    (("winners", 0, "problem", "dtype"), DELETE, r"winners\[0\]\.problem: missing fields \['dtype'\]"),
    (("winners", 0, "problem", "causal"), "yes", r"winners\[0\]\.problem\.causal: expected bool"),
    (
        ("winners", 0, "problem", "num_heads_q"),
        12,
        r"winners\[0\]\.problem\.num_heads_q: expected a multiple",
    ),
    (("winners", 0, "problem", "family"), "decode", r"winners\[0\]\.problem\.family: expected the winner's"),
    (("winners", 0, "family"), "sideways", r"winners\[0\]\.family: expected one of"),
    (("winners", 1, "variant", "block_m"), 7777, r"winners\[1\]\.variant\.block_m: expected a power of two"),
    (("winners", 0, "variant", "warp_magic"), 3, r"winners\[0\]\.variant: unknown knobs \['warp_magic'\]"),
    (("winners", 0, "variant", "num_warps"), True, r"winners\[0\]\.variant\.num_warps: expected int"),
    (
        ("winners", 0, "variant"),
        {"block_m": 128, "block_n": 128, "num_stages": 8},
        r"winners\[0\]\.variant: not within prefill's constraints on NVIDIA H100 80GB HBM3: shared memory",
    ),
    (("gpu", "backend"), "tpu", r"winners\[0\]\.gpu\.backend: expected one of \('cuda', 'interpreter'\)"),
    (("gpu", "capability"), "nine", r"winners\[0\]\.gpu\.capability: expected \"MAJOR\.MINOR\""),
]


@pytest.mark.parametrize(
    ("path", "value", "pattern"), BAD, ids=[str(b[0][-1]) + str(i) for i, b in enumerate(BAD)]
)
def test_a_bad_entry_refuses_the_file_and_nothing_is_written(tmp_path, path, value, pattern):
    doc = changed(path, value)
    with pytest.raises(ValueError, match=pattern):
        check_document(doc)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(document()))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    db = tmp_path / "t.db"
    result = CliRunner().invoke(main, ["import", "--db", f"sqlite:///{db}", str(good), str(bad)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(bad) in result.output and "nothing was imported" in result.output
    assert "merged" not in result.output, "the good file before it was not imported either"
    assert not db.exists(), "the database was not even opened for writing"


def test_imports_store_whole_variants_and_problems(tmp_path):
    """A Variant the export shortened to the knobs that apply is stored whole, as tuning records it."""
    doc = document()
    doc["winners"][0]["variant"] = {"block_m": 128}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(doc))
    url = f"sqlite:///{tmp_path / 't.db'}"
    result = CliRunner().invoke(main, ["import", "--db", url, str(path)])
    assert result.exit_code == 0 and "merged 2, replaced 0, skipped 0" in result.output, result.output
    with Store(url, readonly=True) as store:
        variants = [w.variant for w in store.winners()]
    assert all(len(v) > 10 and v["num_warps"] == 4 for v in variants)
    assert check_document(copy.deepcopy(doc))[0].variant["block_m"] == 128


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{\x00}\x00", "not UTF-8 text"),
        (b"{'winners': []}", "not readable JSON"),
        (
            json.dumps({"format": "tunegen-winners", "version": 1, "gpu": []}).encode(),
            "gpu: expected an object",
        ),
    ],
)
def test_files_that_are_no_export_get_a_clear_error(tmp_path, content, message):
    path = tmp_path / "w.json"
    path.write_bytes(content)
    result = CliRunner().invoke(main, ["import", "--db", f"sqlite:///{tmp_path / 't.db'}", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert message in result.output and "nothing was imported" in result.output
    assert not (tmp_path / "t.db").exists()


def test_the_shipped_winners_pass_the_checks_import_makes():
    from tunegen.tuning_db.shipped import SHIPPED_DIR

    for path in sorted(SHIPPED_DIR.glob("*.json")):
        check_document(json.loads(path.read_text()))
