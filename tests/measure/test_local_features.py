"""benchmarks/local_features.py's parts that need no GPU: the shapes issue 32 names, with their
features in canonical form and their plain twins; the decode Problems; the targets read from
measurements; the markdown it writes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("local_features")
    sys.modules.pop("local_features", None)


def test_the_cases_are_the_issues_shapes(script):
    cases = {c.name: c for c in script.prefill_cases()}
    sizes = lambda s: (s.batch, s.heads, s.kv_heads, s.seqlen, s.head_dim, s.causal)
    window = cases["window 4096 N=16384"].shape
    assert sizes(window) == (1, 32, 8, 16384, 128, True) and window.features == {"window_size": (4095, -1)}
    for n, batch in ((4096, 4), (16384, 1)):
        gpt_oss = cases[f"gpt-oss window 128 + sinks N={n}"].shape
        assert sizes(gpt_oss) == (batch, 64, 8, n, 64, True)
        assert gpt_oss.features == {"window_size": (127, -1), "sinks": True}
    assert cases["Gemma 2 9B cap N=8192"].shape.features == {"softcap": 50.0}
    assert sizes(cases["Gemma 2 27B cap N=4096"].shape) == (4, 32, 16, 4096, 128, True)
    both = cases["Gemma 2 9B window 4096 + cap N=8192"].shape
    assert both.features == {"window_size": (4095, -1), "softcap": 50.0} and both.head_dim == 256
    assert "Gemma 2 9B window 4096 + cap N=4096" not in cases, "there the window holds every key"
    llama4 = cases["Llama 4 chunk 8192 N=16384"]
    assert sizes(llama4.shape) == (1, 40, 8, 16384, 128, True) and llama4.shape.attention_chunk == 8192
    for case in cases.values():
        assert sizes(case.plain) == sizes(case.shape) and case.plain.features == {}
    assert sorted({c.part for c in cases.values()}) == ["a", "b", "c", "e"]


def test_decode_asks_for_the_window_then_the_whole_cache(script):
    problems = script.decode_problems()
    assert [(p.window_left, p.paged, p.batch, p.seqlen_k) for p in problems] == [
        (4095, False, 8, 32768),
        (4095, True, 8, 32768),
        (-1, False, 8, 32768),
        (-1, True, 8, 32768),
    ]


def _row(part, case, impl, us, **extra):
    return {"part": part, "case": case, "impl": impl, "us": us, "note": "", **extra}


def test_the_targets_read_the_measurements(script):
    records = [
        _row("a", "A", "tunegen", 1500.0, window_left=4095, max_abs_diff_vs_flex=0.01),
        _row("a", "A", "flex", 2400.0),
        _row("a", "A", "tunegen plain", 3300.0),
        _row("b", "B", "tunegen", 100.0, window_left=127),
        _row("b", "B", "flex", 120.0),
        _row("c", "C", "tunegen", 1050.0, window_left=-1),
        _row("c", "C", "tunegen plain", 1000.0),
        _row("c", "CW", "tunegen", None, window_left=4095, note="n/a (no kernel)"),
        _row(
            "d",
            "D",
            "tunegen",
            50.0,
            window_left=4095,
            rate=2700.0,
            copy_gbps=3000.0,
            copy_same_traffic_gbps=2800.0,
        ),
        _row("d", "D whole", "tunegen", 400.0, rate=2700.0, copy_gbps=3000.0, copy_same_traffic_gbps=2900.0),
    ]
    got = {(g["case"], g["what"]): (g["value"], g["bound"], g["met"]) for g in script.targets(records)}
    assert got[("A", "tunegen us")] == (1500.0, "<= 1600", True)
    assert got[("A", "Flex / tunegen")] == (1.6, "", None)
    assert got[("A", "tunegen / plain causal")] == (1500 / 3300, "", None)
    assert got[("B", "Flex / tunegen")] == (pytest.approx(1.2), ">= 1.3", False)
    assert got[("C", "tunegen / plain causal")] == (1.05, "<= 1.1", True)
    assert got[("CW", "Flex / tunegen")] == (None, "", None)
    assert got[("D", "GB/s / copy GB/s")] == (0.9, ">= 0.9", True)
    assert got[("D", "GB/s / GB/s of a copy of the same traffic")] == (2700 / 2800, "", None)
    assert not any(case == "D whole" for case, _ in got), "the whole cache has no target"
    text = script.markdown(records, script.targets(records), {"gpu": "H100"})
    assert "| a | A | tunegen | 1500 | - | - | 1.0e-02 |  |" in text
    assert "| b | B | Flex / tunegen | 1.2 | >= 1.3 | NO |" in text
    assert text.startswith("# Issue 32") and "gpu H100" in text
