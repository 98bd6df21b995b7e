"""attn_implementation="tunegen" runs a (tiny, randomly initialised) Llama like SDPA does."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

import tunegen.huggingface

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
