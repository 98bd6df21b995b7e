"""Dispatch serves Winners: exact Problem, else the nearest bucket with the same features, else
the default; from a snapshot of the Winners read once per process and Gpu (until forget()), with
ties broken by a stable rule; once per Problem, then a dict lookup. explain() says which and why.
(tests/kernels/test_ranks_agree.py: the ranks of a torch.distributed job share one snapshot.)"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

import tunegen
from helpers import REL_TOL, qkv, record_winner, rel_err
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch, snapshot
from tunegen.kernels.families.prefill import PrefillVariant
from tunegen.kernels.reference import attention_reference


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("TUNEGEN_DB", url)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.forget()
    yield url
    dispatch.forget()


TUNED = {
    "block_m": 16,
    "block_n": 16,
    "num_warps": 4,
    "num_stages": 1,
    "causal_split": False,
    "load": "desc",
    "order": "head_inner",
    "reverse_m": True,
    "p_fp8": True,
    "v_trans": False,
}


def test_default_without_winners():
    info = tunegen.explain(*qkv(), causal=True)
    assert info["source"] == "default" and info["winner"] is None and "default" in info["reason"]
    assert info["gpu"] == "triton-interpreter" and info["problem"]["causal"] is True


def test_an_exact_winner_is_served_and_computes_the_same_function(fresh):
    q, k, v = qkv()
    problem = tunegen.explain(q, k, v, causal=True)["problem"]
    dispatch.forget()
    record_winner(fresh, problem, TUNED)
    info = tunegen.explain(q, k, v, causal=True)
    assert info["source"] == "winner" and not info["stale"]
    # explain() shows the knobs that apply: not num_warps (one candidate on the interpreter, at
    # its default) nor the FP8 knobs; the schedule's, which the Winner lacks, take their defaults.
    shown = {k: v for k, v in TUNED.items() if k not in ("num_warps", "p_fp8", "v_trans")}
    assert info["variant"] == shown and PrefillVariant.from_json(shown) == PrefillVariant(**TUNED)
    out = tunegen.attention(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True, scale=32**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]


def test_the_nearest_bucket_with_the_same_features(fresh):
    q, k, v = qkv(n=40)  # bucket 64
    problem = tunegen.explain(q, k, v)["problem"]
    dispatch.forget()
    record_winner(fresh, {**problem, "seqlen_q": 256, "seqlen_k": 256}, TUNED)
    record_winner(fresh, {**problem, "seqlen_q": 32, "seqlen_k": 32}, {**TUNED, "block_n": 32})
    record_winner(fresh, {**problem, "causal": True}, {**TUNED, "block_m": 32})  # other features: never used
    info = tunegen.explain(q, k, v)
    assert (
        info["source"] == "nearest" and info["variant"]["block_n"] == 32 and info["variant"]["block_m"] == 16
    )
    assert "2x32x32" in info["reason"]


def test_a_winner_more_than_one_doubling_away_is_not_used(fresh):
    q, k, v = qkv(n=40)  # bucket 64
    problem = tunegen.explain(q, k, v)["problem"]
    dispatch.forget()
    record_winner(fresh, {**problem, "seqlen_q": 256, "seqlen_k": 256}, TUNED)  # two doublings of each length
    info = tunegen.explain(q, k, v)
    assert info["source"] == "default" and "more than one size doubling away" in info["reason"]


def test_a_winner_from_another_triton_is_used_with_one_warning(fresh):
    q, k, v = qkv()
    problem = tunegen.explain(q, k, v)["problem"]
    dispatch.forget()
    record_winner(fresh, problem, TUNED, triton_version="2.9.9")
    with pytest.warns(dispatch.StaleWinnerWarning, match="tuned under Triton 2.9.9"):
        out = tunegen.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.StaleWinnerWarning)
        tunegen.attention(q, k, v)  # the warning came once
    info = tunegen.explain(q, k, v)
    assert info["stale"] and info["source"] == "winner" and "stale" in info["reason"]
    ref, _ = attention_reference(q, k, v, causal=False, scale=32**-0.5)
    assert rel_err(out, ref) < REL_TOL[torch.float16]


def test_a_winner_this_release_cannot_take_is_skipped(fresh):
    q, k, v = qkv()
    problem = tunegen.explain(q, k, v)["problem"]
    dispatch.forget()
    record_winner(fresh, problem, {**TUNED, "warp_specialize": True})
    assert tunegen.explain(q, k, v)["source"] == "default"


def test_an_unusable_database_falls_back_to_defaults_loudly(tmp_path, monkeypatch):
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    monkeypatch.setenv("TUNEGEN_DB", f"sqlite:///{tmp_path / 'junk.db'}")
    with pytest.warns(UserWarning, match="tuned winners unavailable"):
        info = tunegen.explain(*qkv())
    assert info["source"] == "default" and "database unavailable" in info["reason"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tunegen: tuned winners unavailable")
        info = tunegen.explain(*qkv(n=100))  # another Problem: the same snapshot, no second warning
    assert info["source"] == "default" and "database unavailable" in info["reason"]


def test_the_database_is_read_once_per_process_and_gpu(monkeypatch, caplog):
    opened = []
    real = snapshot.open_store
    monkeypatch.setattr(snapshot, "open_store", lambda *a, **kw: opened.append(1) or real(*a, **kw))
    with caplog.at_level(logging.INFO, logger="tunegen"):
        for n in (40, 100, 40, 100):  # two Problems (buckets 64 and 128)
            tunegen.attention(*qkv(n=n))
    assert len(opened) == 1, "one reading of every Winner for the Gpu, at the first call"
    assert sum("tunegen dispatch" in r.message for r in caplog.records) == 2, "one choice per Problem"
    dispatch.forget()
    tunegen.attention(*qkv())
    assert len(opened) == 2, "forget() drops the snapshot too"


def test_a_winner_recorded_after_the_first_use_waits_for_forget(fresh):
    first, later = qkv(n=40), qkv(n=100)
    assert tunegen.explain(*first)["source"] == "default"  # the Gpu's snapshot is taken here
    record_winner(fresh, PrefillCall.dense(*later).problem(later[0]).as_dict(), TUNED)
    info = tunegen.explain(*later)
    assert info["source"] == "default", "a Problem first met after the Winner was recorded: the same snapshot"
    dispatch.forget()
    assert tunegen.explain(*later)["source"] == "winner"


@pytest.mark.parametrize("kind", ["exact", "nearest"])
def test_ties_do_not_depend_on_the_order_winners_were_recorded(tmp_path, monkeypatch, kind):
    """Two Winners that tie on distance, Triton version, origin and time: recorded A then B in one
    database and B then A in another, both give the same choice."""
    q, k, v = qkv(n=40)  # bucket 64
    problem = tunegen.explain(q, k, v)["problem"]
    if kind == "exact":  # one Problem tuned under two other Triton versions
        a = (problem, TUNED, "3.0.0")
        b = (problem, {**TUNED, "block_n": 32}, "3.1.0")
    else:  # one doubling below and one above the call's bucket
        a = ({**problem, "seqlen_q": 32, "seqlen_k": 32}, TUNED, None)
        b = ({**problem, "seqlen_q": 128, "seqlen_k": 128}, {**TUNED, "block_n": 32}, None)
    chosen = []
    for name, order in (("ab", (a, b)), ("ba", (b, a))):
        url = f"sqlite:///{tmp_path / name}.db"
        for tuned_for, variant, triton_version in order:
            record_winner(url, tuned_for, variant, triton_version)
        monkeypatch.setenv("TUNEGEN_DB", url)
        dispatch.forget()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dispatch.StaleWinnerWarning)
            info = tunegen.explain(q, k, v)
        chosen.append((info["source"], info["variant"], info["winner"]["problem"]))
    assert chosen[0] == chosen[1] and chosen[0][0] == ("winner" if kind == "exact" else "nearest")


def test_explain_takes_varlen_arguments_and_the_fallback():
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in qkv())
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    info = tunegen.explain(q, k, v, cu, cu, 25, 25, causal=True)
    assert info["problem"]["varlen"] is True and info["source"] == "default"
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        tunegen.explain(q, k, v, cu, cu[:2], 25, 25)


def test_explain_reports_the_torch_fallback(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tunegen.explain(*qkv())["source"] == "torch"


def test_choices_are_dataclasses():
    q, k, v = qkv()
    tunegen.attention(q, k, v)
    (choice,) = dispatch._CHOICES.values()
    assert dataclasses.is_dataclass(choice) and choice.kernel.variant.family == "prefill"


def test_the_shipped_h100_winners_are_served_and_valid(tmp_path, monkeypatch):
    """Every shipped Winner parses, passes its family's checks on the GPU it was tuned on, and is
    what a lookup for its Problem on that GPU finds when the user's database is empty. (The H100
    table holds none today: its defaults are the measured best; see its provenance.)"""
    from tunegen.kernels import snapshot
    from tunegen.kernels.families import get
    from tunegen.kernels.gpu import Gpu
    from tunegen.kernels.problem import Problem
    from tunegen.tuning_db import shipped_store

    monkeypatch.setenv("TUNEGEN_DB", f"sqlite:///{tmp_path / 'empty.db'}")
    shipped = shipped_store().winners()
    for w in shipped:
        gpu = Gpu(
            w.gpu.name,
            tuple(int(x) for x in w.gpu.capability.split(".")),
            w.gpu.sm_count,
            w.gpu.smem_per_block,
            w.triton_version,
            w.torch_version,
            w.gpu.backend,
        )
        problem = Problem(**w.problem)
        family = get(w.family)
        family.check_variant(family.variant_type.from_json(w.variant), problem, gpu)
        taken = snapshot.for_gpu(gpu)
        assert [x.variant for part in taken.matching(problem) for x in part] == [w.variant]
        assert dispatch.select(problem, gpu, taken).winner == w
