"""The memory calculator's arithmetic, on the seed's Llama-2 70B example."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.measure.memory import MODELS, report


def test_llama2_70b_numbers():
    r = report(MODELS["llama2-70b"], seqlen=4096, dtype="fp16")
    mha, gqa, mqa = r.kv_bytes_per_token_per_layer.values()
    assert mha == 32 * 1024, "2 (K, V) x 64 heads x 128 x 2 bytes"
    assert r.kv_bytes_per_sequence["MHA"] == 32 * 1024 * 80 * 4096 == 10_737_418_240
    assert (gqa, mqa) == (mha // 8, mha // 64), "GQA 8 and MQA save 8x and 64x"
    assert r.scores_bytes_per_layer == 64 * 4096 * 4096 * 2
    assert r.tiled_state_bytes_per_layer == 64 * 4096 * 4


def test_cli_memory():
    text = CliRunner().invoke(main, ["memory", "--preset", "llama2-70b", "--seqlen", "4096"]).output
    assert "32.0 KiB" in text and "10.0 GiB" in text and "2.0 GiB" in text
    out = CliRunner().invoke(main, ["memory", "--preset", "gpt2", "--batch", "8", "--format", "json"]).output
    assert json.loads(out)["kv_bytes_batch"]["MHA"] == 8 * 12 * 4096 * 2 * 12 * 64 * 2
    bad = CliRunner().invoke(main, ["memory", "--preset", "llama9"])
    assert bad.exit_code != 0 and "expected one of" in bad.output


def test_bad_arguments():
    with pytest.raises(ValueError, match="seqlen: expected a positive int"):
        report(MODELS["gpt2"], seqlen=0)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        report(MODELS["gpt2"], seqlen=8, dtype="int4")
