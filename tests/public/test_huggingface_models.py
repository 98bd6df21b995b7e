"""attn_implementation="tunegen" runs current models' attention as transformers' eager one does:
tiny random Mistral (a sliding window), Gemma 2 (windows on alternate layers, the logit cap),
Gemma 3 (windows on five layers of six) and gpt-oss (windows and sinks, head dim 64), on logits
over prompts longer than their windows and on cached greedy generation past them; Llama 4's chunked
layers are refused by name."""

from __future__ import annotations

import os

import pytest
import torch

import tunegen.huggingface

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need the interpreter"
)
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _mistral():
    config = transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=8)
    return transformers.MistralForCausalLM(config)


def _gemma(config_type, model_type, layers, **extra):
    """A tiny Gemma: 16-dim heads, windows of 8 keys on its sliding layers."""
    config = config_type(
        **COMMON, num_hidden_layers=layers, head_dim=16, sliding_window=8, query_pre_attn_scalar=16, **extra
    )
    return model_type(config)


def _gemma2():
    # a cap small enough to bend the scores of a random model
    return _gemma(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        2,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=30.0,
    )


def _gemma3():
    return _gemma(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, 6)


def _gpt_oss():
    config = transformers.GptOssConfig(
        **{**COMMON, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        head_dim=64,
        num_hidden_layers=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=8,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # sinks that matter: transformers initialises them near zero
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    return model


MODELS = {"mistral": _mistral, "gemma2": _gemma2, "gemma3": _gemma3, "gpt-oss": _gpt_oss}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    tunegen.huggingface.register()
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


def _logits(model, implementation, ids):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_logits_match_eager(model):
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, "eager", ids)
    out = _logits(model, "tunegen", ids)
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_cached_generation_matches_eager(model):
    ids = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    outs = {}
    for implementation in ("eager", "tunegen"):
        model.set_attn_implementation(implementation)
        outs[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert torch.equal(outs["tunegen"], outs["eager"])


def test_llama4s_chunked_layers_are_refused_by_name():
    tunegen.huggingface.register()

    class Layer(torch.nn.Module):
        config = transformers.Llama4TextConfig(
            num_hidden_layers=1, layer_types=["chunked_attention"], attention_chunk_size=16
        )
        layer_idx = 0

    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="attention_chunk: transformers passes chunked layers"):
        tunegen.huggingface.attention_forward(Layer(), q, q, q, None)
