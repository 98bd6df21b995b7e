"""The features of current models in the Problem (window, chunk, softcap, sinks): part of the key
only where asked for, so that every stored key stays what it was; checked where a Problem is read;
counted in FLOPs; and refused by every family until its templates render them."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import H100
from tunegen.kernels import masks
from tunegen.kernels.database import problem_from_dict
from tunegen.kernels.families import base, get
from tunegen.kernels.problem import MODEL_FEATURES, Problem, problem_text
from tunegen.kernels.render import render

PLAIN = Problem("prefill", "bfloat16", 128, True, 32, 8, 4, 4096, 4096)
# The key this Problem was stored under before the features existed: it must never change.
PLAIN_KEY = (
    '{"aligned":true,"batch":4,"causal":true,"dtype":"bfloat16","family":"prefill","fp8":false,'
    '"head_dim":128,"num_heads_kv":8,"num_heads_q":32,"page_size":0,"paged":false,"return_lse":false,'
    '"seqlen_k":4096,"seqlen_q":4096,"varlen":false}'
)
GEMMA2 = dataclasses.replace(PLAIN, window_left=4095, softcap=True)
GPT_OSS = dataclasses.replace(PLAIN, head_dim=64, num_heads_q=64, window_left=127, sinks=True)
LLAMA4 = dataclasses.replace(PLAIN, attention_chunk=8192)


def test_a_problem_without_the_features_keeps_its_stored_key():
    assert PLAIN.to_json() == PLAIN_KEY
    assert not PLAIN.model_features and not PLAIN.local
    assert set(MODEL_FEATURES) <= {f.name for f in dataclasses.fields(Problem)}


@pytest.mark.parametrize("problem", [GEMMA2, GPT_OSS, LLAMA4], ids=["gemma2", "gpt-oss", "llama4"])
def test_a_feature_enters_the_key_only_where_asked_for(problem):
    data = problem.as_dict()
    assert {k: data[k] for k in problem.model_features} == problem.model_features
    assert not set(MODEL_FEATURES) - set(problem.model_features) & set(data)
    assert problem_from_dict(data) == problem
    assert problem.to_json() != PLAIN_KEY and problem.local


def test_a_stored_problem_reads_with_or_without_the_default_fields():
    explicit = {**PLAIN.as_dict(), **MODEL_FEATURES}
    assert problem_from_dict(explicit) == problem_from_dict(PLAIN.as_dict()) == PLAIN
    assert problem_from_dict(explicit).as_dict() == PLAIN.as_dict()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"window_left": -2}, "problem.window_left: expected -1 (unbounded) or a size >= 0, got -2"),
        ({"window_right": -5, "causal": False}, "problem.window_right: expected -1 (unbounded)"),
        ({"window_right": 3}, "problem.window_right: expected -1 with causal"),
        ({"attention_chunk": -1}, "problem.attention_chunk: expected 0 (no chunks) or a size > 0"),
        ({"softcap": 50.0}, "softcap"),
    ],
)
def test_bad_feature_values_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        problem_from_dict({**PLAIN.as_dict(), **change})


def test_flops_count_the_pairs_a_window_or_chunk_leaves():
    per_pair = 4.0 * PLAIN.batch * PLAIN.num_heads_q * PLAIN.head_dim
    assert PLAIN.flops() == per_pair * 4096 * 4096 / 2
    window = dataclasses.replace(PLAIN, window_left=100)
    pairs = sum(min(i, 100) + 1 for i in range(4096))  # causal: the row's key and up to 100 before
    assert window.flops() == per_pair * pairs
    assert masks.attended_pairs(4096, 4096, causal=True, left=100) == pairs
    chunk = dataclasses.replace(PLAIN, causal=False, attention_chunk=1000)
    assert chunk.flops(seqlen_q=3000, seqlen_k=3000) == per_pair * 3 * 1000 * 1000
    assert dataclasses.replace(PLAIN, softcap=True).flops() == PLAIN.flops()


def test_problem_text_names_the_features():
    assert problem_text(GEMMA2.as_dict()).endswith("causal window(4095,-1) softcap")
    assert problem_text(GPT_OSS.as_dict()).endswith("causal window(127,-1) sinks")
    assert problem_text(LLAMA4.as_dict()).endswith("causal chunk 8192")
    assert "window" not in problem_text(PLAIN.as_dict())


def test_no_family_builds_a_kernel_that_would_ignore_them():
    """A family whose templates render none of them (as the backward's did before its loops rendered
    them all) refuses to build a kernel for them rather than one that would ignore them."""

    class Blind(type(get("backward"))):
        model_features = frozenset()

    problem = dataclasses.replace(GPT_OSS, family="backward")
    variant = Blind().default_variant(dataclasses.replace(problem, window_left=-1, sinks=False), H100)
    with pytest.raises(ValueError, match=r"the backward kernels do not render \['sinks', 'window_left'\]"):
        base.build(Blind(), variant, problem, H100)
    assert get("backward").model_features == set(MODEL_FEATURES)


def test_prefill_renders_them_on_both_schedules():
    """The prefill family renders every feature (`Family.model_features`), on the Hopper schedule
    too, with its window's masks in a branch of one loop or in copies of the loop around the
    unmasked one."""
    fam = get("prefill")
    assert fam.model_features == set(MODEL_FEATURES)
    plain = fam.default_variant(dataclasses.replace(GPT_OSS, window_left=-1, sinks=False), H100)
    assert plain.schedule == "ws"
    unmasked = "for j in range(gl.maximum(full_lo, lo + 1), gl.maximum(full_hi, lo + 1)):"
    for branch in (False, True):
        source = render(
            fam.template, "prefill", plain.replace(mask_branch=branch), fam.features(GPT_OSS, H100)
        )
        assert (unmasked in source.source) != branch
    assert fam.default_variant(GPT_OSS, H100).schedule == "ws"
    assert get("decode").model_features == set(MODEL_FEATURES)


def test_fp8_prefill_renders_none_of_them_and_an_fp8_cache_all():
    """The tuner skips what `unrendered` names (no Variant of FP8 prefill takes a window), and an
    FP8 cache decodes with every feature."""
    fp8 = dataclasses.replace(GPT_OSS, fp8=True)
    assert base.unrendered(get("prefill"), fp8) == (
        "the prefill kernels do not render ['sinks', 'window_left'] for FP8 in this release"
    )
    assert base.unrendered(get("prefill"), GPT_OSS) is None
    cache = dataclasses.replace(GPT_OSS, family="decode", seqlen_q=1, fp8=True)
    assert base.unrendered(get("decode"), cache) is None
