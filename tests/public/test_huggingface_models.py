"""attn_implementation="tunegen" runs current models' attention as transformers' eager one does:
tiny random Mistral (a sliding window), Gemma 2 (windows on alternate layers, the logit cap),
Gemma 3 (windows on five layers of six), gpt-oss (windows and sinks, head dim 64) and Qwen2-MoE
(a window its layers keep rather than pass), on logits over prompts longer than their windows, on
a training step's gradients and on cached greedy generation past them; what it cannot read (packed
sequences, a window no layer passes, Llama 4's chunked layers) is refused by name."""

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


def _qwen2_moe():
    """Qwen2-MoE keeps its window on the layer (`self.sliding_window`) and passes none to the
    attention function: the layer's window must run all the same."""
    moe = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
    window = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2}
    config = transformers.Qwen2MoeConfig(
        **COMMON, **moe, **window, **layers, shared_expert_intermediate_size=32
    )
    return transformers.Qwen2MoeForCausalLM(config)


MODELS = {
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gpt-oss": _gpt_oss,
    "qwen2-moe": _qwen2_moe,
}


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


def test_gradients_match_eager(model):
    """A training step's gradients through the windows, the cap and the sinks: every parameter's (the
    sinks' too) as eager attention gives them."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(3))
    grads = {}
    for implementation in ("eager", "tunegen"):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[implementation] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert grads["tunegen"].keys() == grads["eager"].keys()
    for name, ref in grads["eager"].items():
        err = float((grads["tunegen"][name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert err < 1e-4, (name, err)


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


def test_what_the_integration_cannot_read_is_refused_not_run_unmasked():
    """Packed sequences (positions restarting, no cache: a block-diagonal mask), and a config that
    names a window its layers never pass (PhiMoE), raise by name."""
    tunegen.huggingface.register()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=1)).eval()
    llama.set_attn_implementation("tunegen")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(10), torch.arange(10)])[None]
    packed = "attention_mask: tunegen runs causal or full attention without a mask"
    with pytest.raises(ValueError, match=packed), torch.no_grad():
        llama(input_ids=ids, position_ids=positions, use_cache=False)
    config = transformers.PhimoeConfig(
        **COMMON, num_hidden_layers=1, num_local_experts=2, num_experts_per_tok=1, sliding_window=8
    )
    phimoe = transformers.PhimoeForCausalLM(config).eval()
    phimoe.set_attn_implementation("tunegen")
    with (
        pytest.raises(ValueError, match="sliding_window: this model's config names a window"),
        torch.no_grad(),
    ):
        phimoe(input_ids=ids)
