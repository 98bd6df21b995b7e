"""The host code that rendered modules carry (their `bind`, launch helpers and constants) is linted
like the rest of tunegen: ruff, with the project's rules, over the source of every default Variant
across the Problem features each template branches on, on Hopper, Ampere and the interpreter, plus
a sample of every family's search space (the knobs the defaults leave at one value) and the FP8
quantizer. Templates themselves are not Python; what they render is."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tunegen.kernels import quantize
from tunegen.kernels.families import FAMILIES, base
from tunegen.kernels.gpu import Gpu, interpreter_gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import Rendered, render

GPUS = (
    Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda"),
    Gpu("A100", (8, 0), 108, 166912, triton.__version__, "", "cuda"),
    interpreter_gpu(),
)
# The project's rules (pyproject.toml) but for what generated code may do: long lines (a kernel's
# argument lists), import order (rendered imports follow the template's sections) and the kernels'
# one-letter pointer names (Q, K, V, O).
IGNORE = ("E501", "E731", "E741", "I001", "RUF001", "RUF002", "RUF003")
SAMPLE = 40  # Variants sampled from a family's search space per sampled Problem


def _problems() -> list[Problem]:
    prefill = [
        Problem.of(
            family="prefill",
            dtype=dtype,
            head_dim=d,
            causal=causal,
            num_heads_q=8,
            num_heads_kv=kv,
            batch=4,
            seqlen_q=n,
            seqlen_k=n,
            varlen=varlen,
            return_lse=lse,
            aligned=aligned,
        )
        for dtype, d, causal, kv, n, varlen, lse, aligned in itertools.product(
            ("bfloat16", "float32"),
            (64, 80, 128, 192, 256),
            (False, True),
            (8, 2),
            (512, 8192),
            (False, True),
            (False, True),
            (True, False),
        )
        if not (varlen and not aligned)
    ]
    fp8 = [
        dataclasses.replace(p, fp8=True)
        for p in prefill
        if p.dtype == "bfloat16" and p.head_dim in (64, 128, 256) and not p.varlen
    ]
    decode = [
        Problem.of(
            family="decode",
            dtype=dtype,
            head_dim=d,
            causal=True,
            num_heads_q=32,
            num_heads_kv=8,
            batch=b,
            seqlen_q=nq,
            seqlen_k=4096,
            paged=page > 0,
            page_size=page,
            fp8=fp8,
            return_lse=lse,
            aligned=False,
        )
        for dtype, d, b, nq, page, fp8, lse in itertools.product(
            ("bfloat16", "float32"), (64, 128), (1, 64), (1, 4), (0, 64), (False, True), (False, True)
        )
        if not (fp8 and dtype == "float32")
    ]
    # Chunks over a paged cache, in pages that 64-key blocks divide and pages they do not.
    paged = [
        dataclasses.replace(p, paged=True, page_size=page)
        for p, page in itertools.product(prefill[::16], (64, 48))
        if p.varlen and p.dtype == "bfloat16"
    ]
    backward = [dataclasses.replace(p, family="backward", return_lse=False) for p in prefill]
    # The backward's loops with the features of current models (every one, and all at once).
    features = ({"window_left": 127}, {"attention_chunk": 256}, {"softcap": True}, {"sinks": True})
    features += (
        {"window_left": 63, "window_right": 31, "attention_chunk": 256, "softcap": True, "sinks": True},
    )
    backward += [
        dataclasses.replace(p, causal=p.causal and "window_right" not in changes, **changes)
        for p, changes in itertools.product(backward[::8], features)
    ]
    return prefill + fp8 + paged + decode + backward


def _sampled(family, problem: Problem, gpu: Gpu, rng: random.Random):
    """SAMPLE Variants drawn from the family's search space for `problem` (each knob at random, as
    the tuner's first trials are), those the Variant type refuses dropped."""
    space = family.search_space(problem, gpu)
    for _ in range(SAMPLE):
        try:
            yield family.variant_type(**base.choose(family, space, lambda _, values: rng.choice(values)))
        except ValueError:
            continue


def _sources() -> dict[str, Rendered]:
    """Each distinct rendered module, by name: defaults everywhere, samples of each search space
    for every 32nd Problem."""
    rng = random.Random(0)
    out: dict[str, Rendered] = {}
    for i, (problem, gpu) in enumerate(itertools.product(_problems(), GPUS)):
        family = FAMILIES[problem.family]
        variants = [family.default_variant(problem, gpu)]
        if i % 32 == 0:
            variants += _sampled(family, problem, gpu, rng)
        for variant in variants:
            if family.constraint(variant, problem, gpu) is not None:
                continue
            rendered = render(family.template, family.name, variant, family.features(problem, gpu))
            out[f"{family.name}_{rendered.digest}"] = rendered
    for dtype, d, group, hadamard, per_block, gpu in itertools.product(
        ("bfloat16", "float32"), (64, 128), (1, 4), (False, True), (False, True), GPUS
    ):
        rendered = quantize.rendered(dtype, d, group, hadamard, per_block, gpu)
        out[f"quantize_{rendered.digest}"] = rendered
    return out


def host_code(source: str) -> str:
    """`source` with the body of each jit-compiled function (Triton's or Gluon's language, which
    the compile tests check) replaced by a `return` of the module-level names it reads, line numbers
    kept: ruff then checks the host code, and that every name a kernel reads exists."""
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or not any(
            "jit" in ast.unparse(d) for d in node.decorator_list
        ):
            continue
        local = {a.arg for a in node.args.args + node.args.kwonlyargs}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        read = {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        } - local
        first = node.body[0].lineno - 1
        lines[first : node.end_lineno] = [
            " " * node.body[0].col_offset + f"return ({', '.join(sorted(read))},)",
            *[""] * (node.end_lineno - first - 1),
        ]
    return "\n".join(lines) + "\n"


def _ruff() -> list[str]:
    found = shutil.which("ruff")
    if found:
        return [found]
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.skip("ruff is not installed (it comes with the test extra)")
    return [sys.executable, "-m", "ruff"]


def test_rendered_modules_pass_ruff(tmp_path: Path):
    sources = _sources()
    for name, rendered in sources.items():
        (tmp_path / f"{name}.py").write_text(host_code(rendered.source))
    config = Path(__file__).resolve().parents[2] / "pyproject.toml"
    done = subprocess.run(
        [
            *_ruff(),
            "check",
            "--no-cache",
            "--config",
            str(config),
            "--output-format",
            "concise",
            "--ignore",
            ",".join(IGNORE),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert len(sources) > 200, f"only {len(sources)} distinct modules rendered"
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
