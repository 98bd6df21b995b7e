"""The command line refuses what makes no sense before doing any work: a usage error (exit 2, no
traceback) that names the option and says what was expected. Page sizes are 0 (contiguous, where
allowed) or any multiple of 16; a dry run says when --trials asks for more than it evaluates; and
an error is printed whole."""

from __future__ import annotations

import os

import pytest
import torch
import triton
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.tuning import presets

TUNE = ["tune", "--dry-run", "--shape", "4,2,32"]
DECODE = [*TUNE, "--family", "decode"]
REFUSED = [
    # tune
    ([*TUNE, "--seqlens", "0"], "--seqlens", "each at least 1, got 0"),
    ([*TUNE, "--seqlens", "-5"], "--seqlens", "got -5"),
    ([*TUNE, "--seqlens", ","], "--seqlens", "comma-separated integers"),
    ([*TUNE, "--seqlens", "512,x"], "--seqlens", "comma-separated integers"),
    ([*TUNE, "--tokens", "0"], "--tokens", "0 is not in the range"),
    ([*DECODE, "--batches", "0"], "--batches", "each at least 1, got 0"),
    ([*DECODE, "--page-size", "-16"], "--page-size", "0 or a positive multiple of 16, got -16"),
    ([*DECODE, "--page-size", "24"], "--page-size", "0 or a positive multiple of 16, got 24"),
    ([*TUNE, "--page-size", "64"], "--page-size", "applies to --family decode"),
    ([*TUNE, "--batches", "4"], "--batches", "applies to --family decode"),
    ([*DECODE, "--tokens", "4096"], "--tokens", "decode sweeps --batches"),
    ([*DECODE, "--causal", "no"], "--causal", "decode is causal"),
    ([*TUNE, "--seed", "-1"], "--seed", "not in the range"),
    ([*TUNE, "--trials", "40"], "--trials", "a dry run (no GPU, or --dry-run) evaluates at most 4"),
    ([*TUNE[:2], "--preset", "llama9"], "--preset", "expected one of"),
    ([*TUNE[:2], "--shape", "6,4,64"], "--shape", "heads must be a multiple of kv_heads"),
    ([*TUNE[:2], "--preset", "gemma2-9b", "--sinks"], "--sinks", "adds a feature to each --shape"),
    ([*TUNE[:2], "--window", "127,0"], "--window", "adds a feature to each --shape"),
    ([*TUNE[:2], "--chunk", "8192"], "--chunk", "a --preset carries its model's own layer kinds"),
    ([*TUNE, "--window", "-2,0"], "--window", "each at least -1, got -2"),
    ([*TUNE, "--window", "127"], "--window", "expected LEFT,RIGHT"),
    ([*TUNE, "--chunk", "-8"], "--chunk", "-8 is not in the range x>=0"),
    ([*TUNE, "--softcap", "-1"], "--softcap", "not in the range x>=0"),
    # render
    (["render", "prefill", "--heads", "0"], "--heads", "0 is not in the range"),
    (["render", "prefill", "--heads", "8", "--kv-heads", "3"], "--kv-heads", "a divisor of the query heads"),
    (["render", "prefill", "--kv-heads", "0"], "--kv-heads", "0 is not in the range"),
    (["render", "backward", "--head-dim", "0"], "--head-dim", "not in the range 1<=x<=256"),
    (["render", "prefill", "--head-dim", "512"], "--head-dim", "not in the range 1<=x<=256"),
    # memory
    (["memory", "--layers", "0"], "--layers", "0 is not in the range"),
    (["memory", "--heads", "-8"], "--heads", "not in the range"),
    (["memory", "--head-dim", "0"], "--head-dim", "0 is not in the range"),
    (["memory", "--kv-heads", "3"], "--kv-heads", "a divisor of the query heads (64)"),
    (["memory", "--seqlen", "0"], "--seqlen", "0 is not in the range"),
    (["memory", "--batch", "0"], "--batch", "0 is not in the range"),
    # bench
    (["bench", "prefill", "--seqlens", "0"], "--seqlens", "each at least 1, got 0"),
    (["bench", "prefill", "--seqlens", ","], "--seqlens", "comma-separated integers"),
    (["bench", "prefill", "--head-dims", "64,0"], "--head-dims", "each from 1 to 256, got 0"),
    (["bench", "prefill", "--tokens", "0"], "--tokens", "0 is not in the range"),
    (["bench", "prefill", "--hidden", "0"], "--hidden", "0 is not in the range"),
    (["bench", "prefill", "--hidden", "128"], "--hidden", "at least the largest head dim (256)"),
    (["bench", "prefill", "--kv-heads", "3"], "--kv-heads", "a divisor of the query heads"),
    (["bench", "backward", "--seqlens", "-5"], "--seqlens", "got -5"),
    (["bench", "backward", "--kv-heads", "0"], "--kv-heads", "0 is not in the range"),
    (["bench", "decode", "--batches", "0"], "--batches", "each at least 1, got 0"),
    (["bench", "decode", "--cache-lengths", "0"], "--cache-lengths", "each at least 1, got 0"),
    (["bench", "decode", "--page-sizes", "0,24"], "--page-sizes", "0 or a positive multiple of 16, got 24"),
    (["bench", "decode", "--page-sizes", "-16"], "--page-sizes", "got -16"),
    (["bench", "decode", "--heads", "0"], "--heads", "0 is not in the range"),
    (["bench", "decode", "--kv-heads", "5"], "--kv-heads", "a divisor of the query heads (32)"),
    (["bench", "decode", "--head-dim", "0"], "--head-dim", "not in the range"),
    (["bench", "fp8", "--seqlens", ","], "--seqlens", "comma-separated integers"),
    (["bench", "fp8", "--batches", "0"], "--batches", "each at least 1, got 0"),
    (["bench", "fp8", "--cache-lengths", "-1"], "--cache-lengths", "got -1"),
    (["bench", "fp8", "--page-sizes", "40"], "--page-sizes", "got 40"),
    (["bench", "fp8", "--tokens", "0"], "--tokens", "0 is not in the range"),
    (["bench", "fp8", "--hidden", "64"], "--hidden", "at least the largest head dim (128)"),
]


@pytest.mark.parametrize(("args", "option", "expected"), REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_what_makes_no_sense_is_refused_by_option(args, option, expected):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), "a usage error, not a traceback"
    assert (
        f"Invalid value for {option}:" in result.output or f"Invalid value for '{option}':" in result.output
    )
    assert expected in result.output, result.output


@pytest.mark.parametrize("pages", ["0,16,48,80,112,144,208", "32"])
def test_every_multiple_of_16_is_a_page_size(monkeypatch, pages):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("decode", "fp8"):
        result = CliRunner().invoke(main, ["bench", command, "--page-sizes", pages])
        assert "Invalid value" not in result.output and "bench needs a CUDA GPU" in result.output


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="dry runs use the interpreter")
def test_a_dry_run_caps_the_default_trials_and_says_so(tmp_path, monkeypatch):
    """`tunegen tune` with the default --trials works on a machine without a GPU: the dry run's
    cap applies, and the first line says what it is."""
    monkeypatch.setattr(presets, "DRY_RUN_TRIALS", 1)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    result = CliRunner().invoke(main, [*TUNE, "--seqlens", "512", "--workers", "1", "--db", url])
    assert result.exit_code == 0, result.output
    assert "(at most 1 trials per Problem)" in result.output and "inserted" in result.output


def test_errors_are_printed_whole():
    """The Hopper class renders with this installation's Triton: its warp-specialized schedule
    renders where Triton has Gluon, and an error names the version it was given, never a blank."""
    result = CliRunner().invoke(
        main, ["render", "prefill", "--gpu", "hopper", "--variant", '{"schedule":"ws"}']
    )
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6):
        assert result.exit_code == 0 and "schedule" in result.output and '"ws"' in result.output, (
            result.output
        )
    else:
        assert result.exit_code == 2 and f"not {triton.__version__}" in result.output
    ws = '{"schedule": "ws", "block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}'
    wrong = CliRunner().invoke(main, ["render", "prefill", "--gpu", "ampere", "--variant", ws])
    assert wrong.exit_code == 2 and wrong.output.rstrip().endswith("not ampere (8, 0)"), wrong.output


def test_render_switches_schedules_and_names_bad_knobs():
    """Knobs of the schedule left behind go back to their defaults; JSON that is not an object of
    knobs is refused by option."""
    fa2 = '{"schedule": "fa2", "block_m": 32}'
    result = CliRunner().invoke(main, ["render", "prefill", "--gpu", "hopper", "--variant", fa2])
    assert result.exit_code == 0 and "BLOCK_M = tl.constexpr(32)" in result.output, result.output
    for text in ("[64]", "block_m=64"):
        bad = CliRunner().invoke(main, ["render", "prefill", "--variant", text])
        assert bad.exit_code == 2 and "--variant: expected a JSON object of knobs" in bad.output
