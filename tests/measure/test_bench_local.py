"""`tunegen bench` with the attention of current models: shapes carry the features in canonical
form, TFLOP/s count the pairs attended and decode's GB/s the keys read (each against a count cell
by cell), the bench's calls run tunegen and FlexAttention with the features and SDPA says why it
cannot, the report counts what the bench counted, and the commands pass the features on and
refuse values that mean nothing."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch
from click.testing import CliRunner

from tunegen.kernels.families import get
from tunegen.kernels.masks import keys_seen, local_mask
from tunegen.measure import bench, report, rows
from tunegen.measure.suites import Shape, decode_suite, prefill_suite

SIDES = [(-1, -1), (0, -1), (5, -1), (17, 3), (-1, 9), (3, 0), (0, 0), (127, 0)]


def test_a_featured_shape_counts_the_pairs_it_attends():
    """Under a window or chunk, 4·B·H·D per pair attended, exactly; a mask that is plain after all
    (a window wider than N) keeps the papers' count (N², halved for causal)."""
    for n, (left, right), chunk, causal in itertools.product((1, 37, 200), SIDES, (0, 5, 64), (False, True)):
        shape = Shape(3, 4, 2, n, 16, causal).featured((left, right), chunk, softcap=30.0, sinks=True)
        mask = local_mask(n, n, causal=causal, left=left, right=right, chunk=chunk)
        pairs = int(mask.sum()) if shape.problem("bfloat16").local else n * n / (2 if shape.causal else 1)
        assert shape.flops() == 4.0 * 3 * 4 * 16 * pairs, (n, left, right, chunk, causal)
    window = Shape(1, 32, 8, 16384, 128, True).featured((4096, 0))
    assert window.flops() == 4.0 * 32 * 128 * (4097 * 4096 // 2 + (16384 - 4096) * 4097)
    plain = Shape(2, 8, 8, 1024, 64, False)
    assert plain.featured((4096, 0)) == Shape(2, 8, 8, 1024, 64, True), "wider than N: causal's mask"
    assert plain.featured((4096, 0)).call_args(None) == {}
    gpt_oss = plain.featured((127, 0), sinks=True)
    assert gpt_oss.features == {"window_size": (127, -1), "sinks": True}
    assert gpt_oss.call_args(sinks := torch.zeros(8))["sinks"] is sinks
    assert gpt_oss.problem("bfloat16").window_left == 127 and gpt_oss.problem("bfloat16").sinks


def test_a_suite_with_a_causal_window_lists_each_shape_once():
    shapes = prefill_suite((512, 8192), (128,), (False, True), window_size=(4095, 0), softcap=50.0)
    assert [(s.seqlen, s.causal, s.window_left, s.softcap) for s in shapes] == [
        (512, True, -1, 50.0),
        (8192, True, 4095, 50.0),
    ]


def test_keys_seen_are_the_keys_some_row_sees():
    for (nq, nk), (left, right), chunk, causal in itertools.product(
        [(1, 1), (1, 70), (9, 1), (5, 23), (23, 5), (19, 70), (70, 19), (37, 37), (0, 5), (5, 0)],
        SIDES,
        (0, 1, 4, 16),
        (False, True),
    ):
        want = int(local_mask(nq, nk, causal=causal, left=left, right=right, chunk=chunk).any(0).sum())
        got = keys_seen(nq, nk, causal=causal, left=left, right=right, chunk=chunk)
        assert got == want, (nq, nk, left, right, chunk, causal)


def test_decode_under_a_window_is_credited_with_the_windows_bytes():
    family = get("decode")
    window, plain = (
        decode_suite((8,), (32768,), 32, 8, 128, (0, 64), window_size=w)[1] for w in ((4095, 0), (-1, -1))
    )
    assert (window.window_left, window.window_right, window.paged) == (4095, -1, True)
    assert bench.credited(family, window, "tunegen") == 2.0 * 8 * 4096 * 8 * 128 * 2
    assert bench.credited(family, plain, "tunegen") == 2.0 * 8 * 32768 * 8 * 128 * 2
    assert decode_suite((8,), (4096,), window_size=(4095, 0))[0].window_left == -1, "the whole cache"


def test_rows_carry_the_features():
    shape = Shape(1, 64, 8, 4096, 64, True).featured((127, 0), sinks=True)
    row = rows.Row.of("flex", "bf16", shape, 1.0, 1.0, 0.0, "", "H100", "2026-11-24")
    assert (row.window_left, row.window_right, row.attention_chunk, row.softcap, row.sinks) == (
        127,
        -1,
        0,
        0.0,
        True,
    )


def test_the_report_counts_a_featured_rows_flops_as_the_bench_did(tmp_path):
    """Written to CSV and read back, a row of a window or chunk keeps them, and the report's
    roofline counts the pairs attended, not N²/2."""
    shapes = [
        Shape(4, 64, 8, 4096, 64, True).featured((127, 0), sinks=True),
        Shape(1, 40, 8, 16384, 128, True).featured(attention_chunk=8192),
        Shape(2, 16, 8, 8192, 256, True).featured(softcap=50.0),
    ]
    written = [rows.Row.of("tunegen", "bf16", s, 1.0, s.flops() / 1e9, 0.0, "", "H200", "d") for s in shapes]
    rows.write_rows(written, tmp_path / "prefill.csv")
    read = report.load_results([tmp_path / "prefill.csv"])
    assert [m.flops for m in read] == [s.flops() for s in shapes]
    assert [m.tflops for m in read] == [r.tflops for r in written]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the kernel under the interpreter"
)
def test_the_bench_runs_the_features_and_sdpa_says_why_not(monkeypatch):
    """tunegen (interpreted) and FlexAttention (eager: see tests/kernels/test_peers_local.py) pass
    the float64 check with a window, a cap and sinks on a ragged length; SDPA is n/a, saying why."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(rows, "interleaved_ms", lambda calls: dict.fromkeys(calls, 1.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    shape = Shape(1, 4, 2, 45, 16, False).featured((7, 0), softcap=5.0, sinks=True)
    inputs = bench.prefill_inputs(shape, torch.float32, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        results = rows.check_then_time(bench.prefill_calls(shape, ["tunegen", "flex", "sdpa-math"], inputs))
    assert results["tunegen"][0] == results["flex"][0] == 1.0, results
    assert results["tunegen"][1] < 1e-5 and results["flex"][1] < 1e-5
    assert results["sdpa-math"] == (
        None,
        None,
        "n/a (scaled_dot_product_attention takes none of window_size, softcap, sinks)",
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["prefill", "--window", "5"], "expected LEFT,RIGHT: two integers"),
        (["prefill", "--window", "-2,0"], "each at least -1"),
        (["prefill", "--chunk", "-1"], "--chunk"),
        (["prefill", "--softcap", "-1"], "--softcap"),
        (["decode", "--window", "1,2,3"], "expected LEFT,RIGHT"),
    ],
)
def test_the_options_refuse_what_means_nothing(args, said):
    from tunegen.cli.main import main

    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2 and said in result.output, result.output


def test_the_commands_pass_the_features_and_show_them(monkeypatch):
    """`bench prefill` hands the suite's shapes their features and shows them beside each row's
    speed and SDPA's reason; `bench decode --window` asks for windowed Problems."""
    from tunegen.cli import bench as command
    from tunegen.cli.main import main

    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    seen = {}

    def fake_prefill(shapes, names, **_):
        seen["shapes"] = shapes
        sdpa = "n/a (scaled_dot_product_attention takes none of window_size, sinks)"
        return [
            rows.Row.of(name, "bf16", s, 1.0 if ms else None, ms, 0.0, "" if ms else sdpa, "H200", "d")
            for s in shapes
            for name, ms in zip(names, (300.0, None), strict=True)
        ]

    monkeypatch.setattr(bench, "bench_prefill", fake_prefill)
    args = ["bench", "prefill", "--seqlens", "4096", "--head-dims", "64", "--causal", "both"]
    result = CliRunner().invoke(main, [*args, "--window", "127,0", "--sinks", "--impl", "tunegen,sdpa-cudnn"])
    assert result.exit_code == 0, result.output
    assert seen["shapes"] == [Shape(4, 32, 32, 4096, 64, True).featured((127, 0), sinks=True)]
    assert "127,-1" in result.output and "300" in result.output
    assert "sdpa-cudnn: n/a (scaled_dot_product_attention takes none of window_size, sinks)" in result.output

    def fake_cases(problems, **_):
        seen["problems"] = problems
        return []

    monkeypatch.setattr(bench, "bench_cases", fake_cases)
    args = ["bench", "decode", "--batches", "8", "--cache-lengths", "32768", "--page-sizes", "0"]
    result = CliRunner().invoke(main, [*args, "--window", "4095,0"])
    assert result.exit_code == 0, result.output
    assert [(p.window_left, p.window_right) for p in seen["problems"]] == [(4095, -1)]
