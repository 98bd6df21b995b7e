"""benchmarks/backward_dq_probes.py: the copies it makes of rendered backward modules thin dQ's
reductions as its numbers say (benchmarks/results/issue30_h100.md), and nothing else."""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import re
import sys
from pathlib import Path

import pytest
import triton

from tunegen.kernels.compiler import CompileJob, compile_kernel
from tunegen.kernels.families import backward
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import Rendered, interpreting, render

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HOPPER = Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda")
CALL = re.compile(r"^ *_reduce_add\(", re.M)


@pytest.fixture
def probes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import backward_dq_probes

    yield backward_dq_probes
    for name in ("backward_dq_probes", "backward_ab"):
        sys.modules.pop(name, None)


@pytest.fixture
def base(tmp_path) -> str:
    """The default module at head dim 128 without a causal mask, dQ added from registers, as
    `backward_ab.py render base` would write it into `tmp_path`."""
    source = _rendered(False, dq_write="atomic").source
    (tmp_path / "base_d128_nc.py").write_text(source)
    return source


def _rendered(causal: bool, **changes) -> Rendered:
    problem = Problem("backward", "bfloat16", 128, causal, 16, 16, 1, 4096, 4096)
    variant = backward.FAMILY.default_variant(problem, HOPPER).replace(**changes)
    return render(backward.FAMILY.template, "backward", variant, backward.FAMILY.features(problem, HOPPER))


def _red_count(source: str) -> int:
    rendered = Rendered("backward", source, hashlib.sha256(source.encode()).hexdigest()[:16])
    ptx = compile_kernel(CompileJob(rendered, "bfloat16", (9, 0), "main")).asm["ptx"]
    return len(re.findall(r"red\.global\.add\.v4\.f32", ptx))


def test_probes_guard_or_halve_every_reduction_and_skip_the_tma_path(probes, base, tmp_path):
    (tmp_path / "base_d128_c.py").write_text(_rendered(True, dq_write="tma").source)
    written = probes.make_probes("base", list(probes.PROBES), tmp_path)
    assert sorted(p.name for p in written) == [f"base-{n}_d128_nc.py" for n in sorted(probes.PROBES)]
    calls = len(CALL.findall(base))
    assert calls >= 2
    guards = {"no_reductions": "seqlen_q < 0", "half_steps": "(start_m // BLOCK_M) % 2 == 0"}
    for name, condition in guards.items():
        source = (tmp_path / f"base-{name}_d128_nc.py").read_text()
        compile(source, name, "exec")
        guarded = re.findall(rf"^( *)if {re.escape(condition)}:\n\1    _reduce_add\(", source, re.M)
        assert len(guarded) == len(CALL.findall(source)) == calls, name
    halved = (tmp_path / "base-half_columns_d128_nc.py").read_text()
    compile(halved, "half_columns", "exec")
    assert halved.count("red.global") == 1 and "pack=8" in halved and len(CALL.findall(halved)) == calls
    with pytest.raises(SystemExit, match="probes: expected"):
        probes.make_probes("base", ["quarter"], tmp_path)
    with pytest.raises(SystemExit, match="render the version first"):
        probes.make_probes("other", ["half_steps"], tmp_path)


def test_half_columns_leaves_half_the_vector_reductions_in_the_ptx(probes, base, tmp_path):
    (halved,) = probes.make_probes("base", ["half_columns"], tmp_path)
    with (
        interpreting(False),
        concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        full, half = pool.map(_red_count, [base, halved.read_text()])
    assert full > 0 and half * 2 == full, (full, half)


def test_the_probes_change_the_reductions_and_nothing_else(probes, base, tmp_path):
    """Undoing a probe's edit (its guards, or its `_reduce_add`) gives back the rendered module."""
    fn = re.compile(r"def _reduce_add\(ptrs, values\):.*?\n\n\n", re.S)
    for path in probes.make_probes("base", list(probes.PROBES), tmp_path):
        source = re.sub(r"^( *)if [^\n]*:\n\1    (_reduce_add\()", r"\1\2", path.read_text(), flags=re.M)
        source = fn.sub(fn.search(base)[0].replace("\\", "\\\\"), source)
        assert source == base, path.name
