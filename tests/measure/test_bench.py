"""The bench's own implementations, run where they can be: under the interpreter on CPU."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import tunegen
from tunegen.kernels.reference import attention_reference
from tunegen.measure import bench, rows
from tunegen.measure.suites import Shape


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the kernel under the interpreter"
)
@pytest.mark.parametrize("causal", [False, True])
def test_tunegen_default_runs_the_default_variant_and_is_right(causal, monkeypatch):
    from tunegen.kernels.families import base, prefill
    from tunegen.kernels.gpu import interpreter_gpu
    from tunegen.kernels.problem import Problem

    built = []
    real_build = base.build
    monkeypatch.setattr(
        base, "build", lambda f, variant, p, g: built.append(variant) or real_build(f, variant, p, g)
    )
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 24, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 45, 24, generator=gen, dtype=torch.float16) for _ in range(2))
    shape = Shape(2, 4, 2, 37, 24, causal)
    call = bench._implementations(["tunegen-default"], shape, q.device)["tunegen-default"]
    out = call(q, k, v)
    ref, _ = attention_reference(q, k, v, causal=causal, scale=24**-0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    problem = Problem(**tunegen.explain(q, k, v, causal=causal)["problem"])
    assert built and built[-1] == prefill.FAMILY.default_variant(problem, interpreter_gpu())


def test_unknown_implementations_are_named():
    with pytest.raises(ValueError, match="impl: expected tunegen, tunegen-default or one of"):
        bench._implementations(["nope"], Shape(1, 1, 1, 16, 16, False), torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_all_needs_a_gpu(tmp_path):
    from click.testing import CliRunner

    from tunegen.cli.main import main

    result = CliRunner().invoke(main, ["bench", "all", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "bench needs a CUDA GPU" in result.output
    assert not (tmp_path / "out").exists()


def test_interleaved_timing_times_every_call_as_often_early_as_late(monkeypatch):
    """GPU clocks drift under load, so each implementation is timed as often early as late (three
    calls: four rounds) and reported by its median; a call's times never mix with another's."""
    from tunegen.tuning import timing

    order = []
    monkeypatch.setattr(timing, "median_ms", lambda fn, **_: order.append(fn.__name__) or fn())
    calls = {name: (lambda ms=ms, name=name: ms) for name, ms in (("a", 3.0), ("b", 1.0), ("c", 2.0))}
    for name, fn in calls.items():
        fn.__name__ = name
    times = timing.interleaved_ms(calls)
    assert times == {"a": 3.0, "b": 1.0, "c": 2.0}
    rounds = [order[i : i + 3] for i in range(0, 12, 3)]
    assert len(order) == 12 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert {sum(r.index(name) for r in rounds) for name in "abc"} == {4}


def test_check_then_time_times_only_what_is_right(monkeypatch):
    """A refusal and a wrong answer become notes and are never timed; the rest are timed together."""
    timed = []
    monkeypatch.setattr(
        rows, "interleaved_ms", lambda calls: timed.append(sorted(calls)) or dict.fromkeys(calls, 1.0)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def refuse():
        raise RuntimeError("no kernel for this shape\nmore")

    def refuse_as_sdpa_does():  # SDPA explains each backend it rules out, then raises
        warnings.warn(  # as PyTorch 2.11 gives it from C++
            "Memory efficient kernel not used because: (Triggered internally at "
            "/pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:986.)",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn(
            "For dense input, both fused kernels require query, key and value to have the same num_heads.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("Flash attention has been runtime disabled.", UserWarning, stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probing prints nothing
        results = rows.check_then_time(
            {
                "ok": (lambda: 0.001, float, 0.01),
                "wrong": (lambda: 0.5, float, 0.01),
                "refuses": (refuse, float, 0.01),
                "sdpa": (refuse_as_sdpa_does, float, 0.01),
            }
        )
    assert timed == [["ok"]]
    assert results["ok"] == (1.0, 0.001, "")
    assert results["wrong"][0] is None and results["wrong"][2] == "wrong: relative error 5.00e-01"
    assert results["refuses"] == (None, None, "n/a (no kernel for this shape)")
    assert results["sdpa"] == (
        None,
        None,
        "n/a (For dense input, both fused kernels require query, key and value to have the same num_heads.)",
    )
