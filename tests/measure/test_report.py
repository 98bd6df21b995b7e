"""`tunegen report`: rows from both bench formats, the roofline's arithmetic, and the page as a
real headless browser renders it."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.measure import report

PROVENANCE = {"gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "torch": "2.11.0", "date": "2026-11-22"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def prefill_rows() -> list[dict]:
    rows = []
    for impl, per_n in (("tunegen", 300.0), ("sdpa-flash", 250.0)):
        for n in (512, 1024, 2048):
            ms = 4.0 * (16384 // n) * 16 * n * n * 128 / (per_n * 1e9)
            rows.append(
                {
                    "impl": impl,
                    "dtype": "bf16",
                    "batch": 16384 // n,
                    "heads": 16,
                    "kv_heads": 16,
                    "seqlen": n,
                    "head_dim": 128,
                    "causal": False,
                    "ms": ms,
                    "tflops": per_n,
                    "rel_err": 0.002,
                    "note": "",
                    **PROVENANCE,
                }
            )
    rows.append(
        {**rows[-1], "impl": "flex", "ms": None, "tflops": None, "note": "wrong: relative error 1e-1"}
    )
    return rows


def decode_rows() -> list[dict]:
    rows = []
    for impl, ms in (("tunegen", 0.05), ("tunegen-default", 0.08), ("sdpa-flash", 0.07)):
        for n in (4096, 32768):
            rows.append(
                {
                    "impl": impl,
                    "family": "decode",
                    "dtype": "bfloat16",
                    "head_dim": 128,
                    "causal": True,
                    "num_heads_q": 32,
                    "num_heads_kv": 8,
                    "batch": 4,
                    "seqlen_q": 1,
                    "seqlen_k": n,
                    "unit": "GB/s",
                    "ms": ms * n / 4096,
                    "rate": 2.0 * 4 * n * 8 * 128 * 2 / (ms * n / 4096) / 1e6,
                    "rel_err": 0.001,
                    "note": "",
                    **PROVENANCE,
                }
            )
    return rows


@pytest.fixture
def results(tmp_path: Path) -> tuple[Path, Path, Path]:
    prefill = tmp_path / "prefill.csv"
    rows = prefill_rows()
    with prefill.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(decode_rows()))
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"gpu": "H100", "matmul_tflops": {"bf16": 780}, "copy_tbps": 3.0}))
    return prefill, decode, ceilings


def test_rows_of_both_formats_carry_flops_and_least_bytes(results):
    prefill, decode, _ = results
    rows = report.load_results([prefill, decode])
    assert len(rows) == 7 + 6
    p = next(r for r in rows if r.family == "prefill" and r.impl == "tunegen" and r.seqlen == 1024)
    assert p.flops == 4.0 * 16 * 16 * 1024 * 1024 * 128
    assert p.bytes == 2 * (16 * 16 * 1024 * 128 * 4)  # Q, K, V read and O written, 2 bytes each
    assert p.tflops == pytest.approx(300.0)
    d = next(r for r in rows if r.family == "decode" and r.impl == "tunegen" and r.seqlen == 32768)
    assert d.flops == 4.0 * 4 * 32 * 1 * 32768 * 128, "a one-token decode is not halved for causal"
    assert d.bytes == 2 * 4 * 128 * (2 * 32 * 1 + 2 * 8 * 32768)
    flex = next(r for r in rows if r.impl == "flex")
    assert flex.rate is None and flex.tflops is None and flex.note.startswith("wrong")


def test_memory_wall_is_head_dim_over_element_bytes():
    n, d = 4096, 128
    flops = 4.0 * n * n * d
    scores_traffic = 4 * n * n * 2  # S and P each written and read once, fp16
    assert report.memory_wall(d, "fp16") == flops / scores_traffic


def test_tuned_pairs_match_shapes():
    rows = [report.measurement(r) for r in decode_rows()]
    pairs = report.tuned_pairs(rows)
    assert len(pairs) == 2
    for tuned, default in pairs:
        assert (tuned.impl, default.impl) == ("tunegen", "tunegen-default")
        assert tuned.seqlen == default.seqlen and tuned.rate / default.rate == pytest.approx(0.08 / 0.05)


def test_bad_input_names_what_is_wrong(tmp_path, results):
    prefill, _, _ = results
    bad = tmp_path / "rows.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match=r"results: expected \.csv or \.json"):
        report.load_results([bad])
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{"impl": "tunegen"}]))
    with pytest.raises(ValueError, match="results: a row is not one"):
        report.load_results([broken])
    ceilings = tmp_path / "c.json"
    ceilings.write_text(json.dumps({"gpu": "H100"}))
    with pytest.raises(ValueError, match=r"ceilings: .* must hold"):
        report.Ceilings.load(ceilings)
    result = CliRunner().invoke(
        main, ["report", str(prefill), "--ceilings", str(ceilings), "-o", str(tmp_path)]
    )
    assert result.exit_code == 1 and "ceilings:" in result.output


def test_page_renders_in_headless_chromium(tmp_path, results):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (.ci/run does)")
        pytest.skip("no chromium on this machine")
    sync_api = pytest.importorskip("playwright.sync_api")
    prefill, decode, ceilings = results
    out = tmp_path / "page"
    result = CliRunner().invoke(
        main, ["report", str(prefill), str(decode), "--ceilings", str(ceilings), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}"))
        page.goto((out / "index.html").as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all(
            "img", "els => els.map(e => [e.getAttribute('src'), e.complete, e.naturalWidth, e.naturalHeight])"
        )
        captions = page.eval_on_selector_all("caption", "els => els.map(e => e.textContent)")
        best = page.eval_on_selector_all("td.best", "els => els.map(e => e.textContent)")
        shot = page.screenshot(full_page=True)
        browser.close()
    assert not errors, errors
    sources = {src for src, *_ in images}
    assert {"roofline.png", "tuned.png"} <= sources and len(images) == 2 + 2  # two speed plots
    assert all(complete and w > 100 and h > 100 for _, complete, w, h in images), images
    assert any("prefill bf16, head dim 128" in c for c in captions)
    assert any("decode bfloat16, head dim 128" in c and "32/8 heads" in c for c in captions)
    assert best.count("300") == 3, "tunegen is the best cell in each prefill row"
    assert len(shot) > 10_000


def test_bench_fp8_documents_put_fp8_beside_bf16(tmp_path):
    cache = [{**r, "fp8": flag} for r in decode_rows() if r["impl"] == "tunegen" for flag in (False, True)]
    prefill = [{**r, "impl": f"tunegen-{d}", "dtype": d} for r in prefill_rows()[:1] for d in ("bf16", "fp8")]
    doc = tmp_path / "fp8.json"
    doc.write_text(json.dumps({"prefill": prefill, "decode": cache, "speedups": [{"family": "decode"}]}))
    rows = report.load_results([doc])
    assert sorted({r.impl for r in rows}) == [
        "tunegen",
        "tunegen (e4m3 KV cache)",
        "tunegen-bf16",
        "tunegen-fp8 (e4m3 inputs, bf16 output)",
    ]
    assert len(report._groups(rows)) == 2, "one plot for prefill, one for decode, each with both dtypes"
    fp8_cache = next(r for r in rows if r.impl == "tunegen (e4m3 KV cache)")
    bf16_cache = next(r for r in rows if r.impl == "tunegen" and r.seqlen == fp8_cache.seqlen)
    assert fp8_cache.bytes == bf16_cache.bytes / 2
