"""Model presets: each model's kinds of attention layer with its real head counts, windows and
chunks; the Problems a run tunes for them (one per layer kind, a window or chunk only where it
leaves keys out); the dry run's tiny windows; and `tunegen tune` over a feature preset and a
--shape with features, end to end under the interpreter, skipping what a family does not render."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.families import prefill
from tunegen.kernels.problem import Problem
from tunegen.tuning.presets import FULL, LayerKind, dry_run, parse_shape, preset, problems
from tunegen.tuning_db import Store

INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="dry runs run kernels under the interpreter"
)
# transformers' sliding_window N is FlashAttention's window (N - 1, 0): its masks keep
# kv_idx > q_idx - N (masking_utils.sliding_window_overlay) and its flash path passes
# (N - 1, N - 1) with causal=True (modeling_flash_attention_utils.py), transformers 5.24.
GEMMA2 = (LayerKind(4095, 0, softcap=True), LayerKind(softcap=True))
GEMMA3 = (LayerKind(1023, 0), FULL)
GPT_OSS = (LayerKind(127, 0, sinks=True), LayerKind(sinks=True))
REAL = [
    # The presets from before layer kinds, unchanged: one full layer kind each. mistral-7b is
    # v0.2/v0.3, whose configs set no sliding_window.
    ("llama3-8b", (32, 8, 128), (FULL,)),
    ("llama3-70b", (64, 8, 128), (FULL,)),
    ("mistral-7b", (32, 8, 128), (FULL,)),
    ("qwen2.5-7b", (28, 4, 128), (FULL,)),
    ("gpt2", (12, 12, 64), (FULL,)),
    # src/transformers/models/mistral/configuration_mistral.py: its defaults are Mistral-7B-v0.1's,
    # sliding_window 4096 on every layer.
    ("mistral-7b-v0.1", (32, 8, 128), (LayerKind(4095, 0),)),
    # src/transformers/models/gemma2/configuration_gemma2.py (defaults: the 2B; sliding_window 4096
    # on even layers, attn_logit_softcapping 50 on all) and convert_gemma2_weights_to_hf.py
    # (gemma_9b_config, gemma_27b_config).
    ("gemma2-2b", (8, 4, 256), GEMMA2),
    ("gemma2-9b", (16, 8, 256), GEMMA2),
    ("gemma2-27b", (32, 16, 128), GEMMA2),
    # src/transformers/models/gemma3/convert_gemma3_weights.py (_VARIANTS: sliding_window 512 on
    # the 1B, 1024 above, no softcap); configuration_gemma3.py: five sliding layers to one full.
    ("gemma3-1b", (4, 1, 256), (LayerKind(511, 0), FULL)),
    ("gemma3-4b", (8, 4, 256), GEMMA3),
    ("gemma3-12b", (16, 8, 256), GEMMA3),
    ("gemma3-27b", (32, 16, 128), GEMMA3),
    # src/transformers/models/gpt_oss/configuration_gpt_oss.py (defaults: the 120B, 36 layers;
    # sliding_window 128 on even layers, sinks on all); the 20B's Hub config.json differs in its
    # layers (24) and experts only.
    ("gpt-oss-20b", (64, 8, 64), GPT_OSS),
    ("gpt-oss-120b", (64, 8, 64), GPT_OSS),
    # src/transformers/models/llama4/configuration_llama4.py (Llama4TextConfig, defaults: Scout):
    # attention_chunk_size 8192 on the layers with RoPE, every fourth (no_rope_layer_interval 4) full.
    ("llama4-scout", (40, 8, 128), (LayerKind(-1, 0, 8192), FULL)),
]


@pytest.mark.parametrize(("name", "heads", "layers"), REAL, ids=[name for name, _, _ in REAL])
def test_presets_carry_their_models_heads_and_layer_kinds(name, heads, layers):
    model = preset(name)
    assert (model.heads, model.kv_heads, model.head_dim) == heads and model.layers == layers


def test_each_layer_kind_gets_its_problems_with_a_window_only_where_it_leaves_keys_out():
    """Gemma 2 at N = 4096: the window holds every key, so its sliding layers are its global ones
    (one Problem); at 8192 they differ. The backward gets the same Problems."""
    got = problems([preset("gemma2-9b")], seqlens=(4096, 8192))
    assert [(p.seqlen_q, p.batch, p.model_features) for p in got] == [
        (4096, 4, {"softcap": True}),
        (8192, 2, {"window_left": 4095, "softcap": True}),
        (8192, 2, {"softcap": True}),
    ]
    assert all(p.causal and (p.num_heads_q, p.num_heads_kv, p.head_dim) == (16, 8, 256) for p in got)
    backward = problems([preset("gemma2-9b")], seqlens=(4096, 8192), family="backward")
    assert [p.model_features for p in backward] == [p.model_features for p in got]
    # Decode: a window of 128 keys leaves none out of a 128-key cache, one of 129.
    decode = problems([preset("gpt-oss-20b")], family="decode", seqlens=(128, 129), batches=(1,))
    assert [(p.seqlen_k, p.model_features) for p in decode] == [
        (128, {"sinks": True}),
        (256, {"window_left": 127, "sinks": True}),
        (256, {"sinks": True}),
    ]
    # Chunks of 8192 hold every key of 8192: Llama 4's chunked layers are its full ones there.
    scout = problems([preset("llama4-scout")], seqlens=(8192, 16384), causal=(False, True))
    assert [(p.causal, p.seqlen_q, p.attention_chunk) for p in scout] == [
        (True, 8192, 0),
        (True, 16384, 8192),
        (False, 8192, 0),
        (False, 16384, 0),
        (True, 16384, 0),
    ], "chunked layers are causal whatever the run asks; the full ones are asked both ways"


def test_a_dry_run_shrinks_windows_and_chunks_to_leave_keys_out_of_its_tiny_shape():
    sliding, full = (dry_run(p) for p in problems([preset("gpt-oss-20b")], seqlens=(16384,)))
    assert (sliding.num_heads_q, sliding.num_heads_kv, sliding.seqlen_k) == (8, 1, 32)
    assert sliding.model_features == {"window_left": 8, "sinks": True} and full.model_features == {
        "sinks": True
    }
    chunked = problems([preset("llama4-scout")], seqlens=(16384,), family="decode", batches=(1,))[0]
    assert dry_run(chunked).seqlen_k == 64 and dry_run(chunked).model_features == {"attention_chunk": 32}
    assert dry_run(problems([parse_shape("4,2,32", LayerKind(2, 5))], causal=(False,))[0]).model_features == {
        "window_left": 2,
        "window_right": 5,
    }


def test_layer_kinds_are_checked_as_the_public_calls_check_them():
    with pytest.raises(ValueError, match=r"window_size: expected two ints of at least -1"):
        LayerKind(window_left=-2)
    with pytest.raises(ValueError, match=r"attention_chunk: expected an int >= 0"):
        LayerKind(attention_chunk=-1)


@INTERPRETED
def test_a_dry_run_tunes_a_feature_preset_and_a_shape_with_features(tmp_path):
    """gpt-oss's sliding layers (window and sinks) and its full ones, and a --shape given a window
    and a cap, each get a verified Winner under the interpreter."""
    url = f"sqlite:///{tmp_path / 'features.db'}"
    args = ["tune", "--dry-run", "--preset", "gpt-oss-20b", "--shape", "4,2,32", "--window", "7,0"]
    result = CliRunner().invoke(
        main, [*args, "--softcap", "30", "--seqlens", "1024", "--trials", "1", "--workers", "1", "--db", url]
    )
    assert result.exit_code == 0, result.output
    assert "window(8,-1) sinks" in result.output and "window(7,-1) softcap" in result.output
    with Store(url) as store:
        tuned = sorted(
            (w.family, w.problem["head_dim"], str(Problem(**w.problem).model_features))
            for w in store.winners()
        )
    assert tuned == [
        ("prefill", 32, "{'window_left': 7, 'softcap': True}"),
        ("prefill", 64, "{'sinks': True}"),
        ("prefill", 64, "{'window_left': 8, 'sinks': True}"),
    ]


@INTERPRETED
def test_problems_a_family_does_not_render_are_skipped_with_the_reason(tmp_path, monkeypatch):
    """The tuner skips such a Problem before any process starts and tunes the next one, which
    keeps its own place in the table."""
    monkeypatch.setattr(prefill.PrefillFamily, "model_features", frozenset({"window_left"}))
    url = f"sqlite:///{tmp_path / 'skip.db'}"
    args = ["tune", "--dry-run", "--preset", "gpt-oss-20b", "--shape", "4,2,32", "--seqlens", "1024"]
    result = CliRunner().invoke(main, [*args, "--trials", "1", "--workers", "1", "--db", url])
    assert result.exit_code == 0, result.output
    skipped = "skipped: the prefill kernels do not render ['sinks'] in this release"
    assert result.output.count(skipped) == 2, result.output
    with Store(url) as store:
        assert [w.problem["head_dim"] for w in store.winners()] == [32]
