"""The bench's own implementations, run where they can be: under the interpreter on CPU."""

from __future__ import annotations

import os

import pytest
import torch

import tunegen
from tunegen import bench
from tunegen.reference import attention_reference


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the kernel under the interpreter"
)
@pytest.mark.parametrize("causal", [False, True])
def test_tunegen_default_runs_the_default_variant_and_is_right(causal, monkeypatch):
    from tunegen.families import base, prefill
    from tunegen.gpu import interpreter_gpu
    from tunegen.problem import Problem

    built = []
    real_build = base.build
    monkeypatch.setattr(
        base, "build", lambda f, variant, p, g: built.append(variant) or real_build(f, variant, p, g)
    )
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 24, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 45, 24, generator=gen, dtype=torch.float16) for _ in range(2))
    shape = bench.Shape(2, 4, 2, 37, 24, causal)
    call = bench._implementations(["tunegen-default"], shape, q.device)["tunegen-default"]
    out = call(q, k, v)
    ref, _ = attention_reference(q, k, v, causal=causal, scale=24**-0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    problem = Problem(**tunegen.explain(q, k, v, causal=causal)["problem"])
    assert built and built[-1] == prefill.FAMILY.default_variant(problem, interpreter_gpu())


def test_unknown_implementations_are_named():
    with pytest.raises(ValueError, match="impl: expected tunegen, tunegen-default or one of"):
        bench._implementations(["nope"], bench.Shape(1, 1, 1, 16, 16, False), torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_all_needs_a_gpu(tmp_path):
    from click.testing import CliRunner

    from tunegen.cli.main import main

    result = CliRunner().invoke(main, ["bench", "all", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "bench needs a CUDA GPU" in result.output
    assert not (tmp_path / "out").exists()
