"""Rendering is pure, readable, cached by content hash, and renders Problem features away."""

from __future__ import annotations

import ast

import pytest
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.families import prefill
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import cache_dir, load, render, template_hash

HOPPER = Gpu("H100", (9, 0), 132, 232448, "3.6.0", "2.11", "cuda")


def _render(variant=None, **features):
    problem = Problem(
        **{
            "family": "prefill",
            "dtype": "bfloat16",
            "head_dim": 128,
            "causal": False,
            "num_heads_q": 8,
            "num_heads_kv": 8,
            "batch": 1,
            "seqlen_q": 1024,
            "seqlen_k": 1024,
            **features,
        }
    )
    variant = variant or prefill.PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return render(prefill.FAMILY.template, "prefill", variant, prefill.FAMILY.features(problem, HOPPER))


def test_rendering_is_pure_and_named_by_content():
    a, b = _render(), _render()
    assert a.source == b.source and a.digest == b.digest
    other = _render(prefill.PrefillVariant(block_m=64))
    assert other.digest != a.digest
    ast.parse(a.source)


def test_features_are_rendered_away():
    plain = _render().source
    assert "diag" not in plain and "LSE + " not in plain and "cu_seqlens" not in plain and "d_ok" not in plain
    causal = _render(causal=True).source
    assert "diag = seqlen_k - seqlen_q" in causal
    assert "cu_seqlens_q" in _render(varlen=True).source
    assert "tl.store(ptr_lse" in _render(return_lse=True).source
    assert "d_ok = offs_d < HEAD_DIM" in _render(head_dim=80).source
    assert "GROUP = tl.constexpr(4)" in _render(num_heads_kv=2).source
    assert "make_tensor_descriptor" in _render(prefill.PrefillVariant(load="desc")).source
    assert "make_tensor_descriptor" not in _render(prefill.PrefillVariant(load="ptr")).source


def test_ws_features_are_rendered_away():
    ws = prefill.PrefillVariant(schedule="ws", block_n=128, consumers=2, pingpong=True, overlap=True)
    plain = _render(ws).source
    assert "from triton.experimental import gluon" in plain and "@gluon.jit" in plain
    assert "diag" not in plain and "gl.store(ptr_lse" not in plain and "group_heads" not in plain
    assert "diag = seqlen_k - seqlen_q" in _render(ws, causal=True).source
    assert "gl.store(ptr_lse" in _render(ws, return_lse=True).source
    assert "GROUP = gl.constexpr(4)" in _render(ws, num_heads_kv=2).source
    assert "group_heads" in _render(ws.replace(order="grouped", reverse_m=True), causal=True).source
    assert "turn_bars.index(cid), phase)" in plain
    assert "turn_bars.index(cid), phase)" not in _render(ws.replace(pingpong=False)).source
    assert "if seqlen_k > 0:" in plain and "if seqlen_k > 0:" not in _render(ws.replace(overlap=False)).source
    one_loop = "for j in range(1, n_blocks):"
    assert one_loop in _render(ws.replace(mask_branch=True)).source and one_loop not in plain
    assert "MAXNREG = None" in plain
    two = ws.replace(consumers=1, pingpong=False, block_n=64, ctas_per_sm=2)
    assert "MAXNREG = 128" in _render(two).source
    ast.parse(plain)


def test_cache_file_holds_the_source():
    rendered = _render(head_dim=64)
    module = load(rendered, interpret=True)
    path = cache_dir() / f"{rendered.module_name}.py"
    assert path.read_text() == rendered.source
    assert module.BLOCK_M.value == 128, "the module holds the Variant it was rendered for"
    assert template_hash(prefill.FAMILY.template) in rendered.source


def test_variant_json_round_trip_and_validation():
    v = prefill.PrefillVariant(block_m=128, block_n=32, load="desc", order="head_inner", reverse_m=True)
    assert prefill.PrefillVariant.from_json(v.to_json()) == v
    assert v.to_json() == prefill.PrefillVariant.from_json(v.as_dict()).to_json()
    with pytest.raises(ValueError, match="unknown knobs"):
        prefill.PrefillVariant.from_json('{"block_q": 64}')
    with pytest.raises(ValueError, match="block_m: expected a power of two"):
        prefill.PrefillVariant(block_m=96)
    with pytest.raises(ValueError, match="load: expected one of"):
        prefill.PrefillVariant(load="tma")


def test_cli_render_prints_the_source():
    result = CliRunner().invoke(
        main, ["render", "prefill", "--head-dim", "128", "--causal", "--gpu", "hopper"]
    )
    assert result.exit_code == 0, result.output
    assert "def attn_fwd(" in result.output and "diag = seqlen_k - seqlen_q" in result.output
    ast.parse(result.output)
    custom = CliRunner().invoke(
        main, ["render", "prefill", "--gpu", "hopper", "--variant", '{"block_m": 64, "schedule": "fa2"}']
    )
    assert "BLOCK_M = tl.constexpr(64)" in custom.output
    bad = CliRunner().invoke(main, ["render", "prefill", "--variant", '{"block_m": 65}'])
    assert bad.exit_code != 0 and "block_m: expected a power of two" in bad.output
