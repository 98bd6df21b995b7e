"""attn_implementation="tunegen" runs a (tiny, randomly initialised) Llama like SDPA does."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

import tunegen
import tunegen.huggingface

# CPU SDPA's flash op and its backward, which tunegen takes under the interpreter once active.
OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need the interpreter"
)


@pytest.fixture(scope="module")
def model():
    tunegen.huggingface.register()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def _run(model, implementation, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**kwargs).logits


def test_logits_match_sdpa(model):
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    ref = _run(model, "sdpa", input_ids=ids)
    out = _run(model, "tunegen", input_ids=ids)
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_cached_generation_matches_sdpa(model):
    ids = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("tunegen")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_a_padded_batch_is_refused_not_silently_wrong(model):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with pytest.raises(
        ValueError, match="attention_mask: tunegen runs causal or full attention without a mask"
    ):
        _run(model, "tunegen", input_ids=ids, attention_mask=mask)


@pytest.mark.skipif(
    not hasattr(torch.nn.attention, "register_flash_attention_impl"), reason="no flash-attention registry"
)
def test_sdpa_through_the_flash_provider_matches_eager_with_gradients(model):
    """attn_implementation="sdpa" with tunegen active as PyTorch's flash provider: tunegen runs
    every layer's attention, and the logits and one training step's gradients match eager's."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(4))
    grads = {}
    for implementation in ("eager", "sdpa"):
        trained = copy.deepcopy(model).train()
        trained.set_attn_implementation(implementation)
        if implementation == "sdpa":
            activate_flash_attention_impl("tunegen")
            served = tunegen.explain()["served"]
            served = [served.get(op, 0) for op in OPS]
        try:
            loss = trained(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            if implementation == "sdpa":
                restore_flash_attention_impl()
        grads[implementation] = (loss.detach(), {n: p.grad for n, p in trained.named_parameters()})
    after = [tunegen.explain()["served"][op] for op in OPS]
    layers = model.config.num_hidden_layers
    assert after == [n + layers for n in served], "tunegen ran each layer's attention and its backward"
    (ref_loss, ref), (loss, got) = grads["eager"], grads["sdpa"]
    assert abs(float(loss - ref_loss)) < 1e-5 * abs(float(ref_loss))
    for name, g in got.items():
        assert float((g - ref[name]).norm()) <= 1e-4 * float(ref[name].norm()) + 1e-7, name


@pytest.mark.skipif(
    not hasattr(torch.nn.attention, "register_flash_attention_impl"), reason="no flash-attention registry"
)
def test_cached_generation_through_the_flash_provider_matches_eager(model):
    """Greedy decoding with attn_implementation="sdpa" and tunegen active: the prompt and every
    cached step (one query over the cache, not causal to SDPA) run tunegen and pick eager's tokens."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    model.set_attn_implementation("eager")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    served = tunegen.explain()["served"].get(OPS[0], 0)
    activate_flash_attention_impl("tunegen")
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    finally:
        restore_flash_attention_impl()
    assert torch.equal(out, ref)
    assert tunegen.explain()["served"][OPS[0]] >= served + model.config.num_hidden_layers * 5
