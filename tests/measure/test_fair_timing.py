"""Every implementation is timed the same way (issue 27): an SDPA peer's backend is chosen once
around its timing, never by each timed call; the defaults sweeps time in the bench's interleaved
rounds; a peer of an FP8-cache decode is credited with the 16-bit bytes it reads; and the fair
rerun's summary reads what its steps write. All but the last run on the CPU: SDPA's math and
flash backends run there, and the GPU's clock is stood in for."""

from __future__ import annotations

import collections
import contextlib
import csv
import functools
import importlib
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_GPU

from tunegen.kernels import dispatch, peers
from tunegen.kernels.families import base, get
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.reference import attention_reference
from tunegen.measure import bench, report, rows
from tunegen.measure.suites import fp8_decode_suite
from tunegen.tuning import timing
from tunegen.tuning.rounds import balanced_rounds, round_order

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FLAGS = {
    "MATH": torch.backends.cuda.math_sdp_enabled,
    "FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled,
    "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled,
    "CUDNN_ATTENTION": torch.backends.cuda.cudnn_sdp_enabled,
}


@pytest.fixture
def sdpa_spy(monkeypatch):
    """Counts the entries into `sdpa_kernel` per backend, and records which backends were enabled
    at each SDPA call."""
    entered: dict[str, int] = {}
    enabled: list[set[str]] = []
    real_kernel, real_sdpa = torch.nn.attention.sdpa_kernel, torch.nn.functional.scaled_dot_product_attention

    @contextlib.contextmanager
    def counting(backend):
        entered[backend.name] = entered.get(backend.name, 0) + 1
        with real_kernel(backend):
            yield

    def spying(*args, **kwargs):
        enabled.append({name for name, flag in FLAGS.items() if flag()})
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", counting)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spying)
    return types.SimpleNamespace(entered=entered, enabled=enabled)


@pytest.fixture
def gpu_clock(monkeypatch):
    """do_bench stood in for: each timing calls the function 20 times and reads 1 ms."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def do_bench(fn, warmup, rep, return_mode):
        for _ in range(20):
            fn()
        return 1.0

    monkeypatch.setattr(timing.triton.testing, "do_bench", do_bench)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 4, 32, 16, generator=gen) for _ in range(3))


def test_check_then_time_chooses_each_peers_backend_once_not_per_call(sdpa_spy, gpu_clock):
    q, k, v = _inputs()
    ref, _ = attention_reference(q, k, v, causal=True, scale=16**-0.5)
    error = lambda out: float((out.double() - ref).norm() / ref.norm())
    names = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION"}
    calls = {name: (functools.partial(peers.sdpa(name, True), q, k, v), error, 1e-4) for name in names}
    results = rows.check_then_time(calls)
    assert all(ms == 1.0 and note == "" for ms, _, note in results.values()), results
    rounds = len(calls)
    each_ran = collections.Counter(frozenset(e) for e in sdpa_spy.enabled)
    assert each_ran == {frozenset({backend}): 1 + rounds * 20 for backend in names.values()}
    # once for the check, once around each round's timing: not once for each of the 41 calls
    assert sdpa_spy.entered == dict.fromkeys(names.values(), 1 + rounds)


def test_per_call_timing_enters_the_peers_setting_once(sdpa_spy, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "ROUND_S", 1e9)  # every round makes its 50 calls, however slow the CPU
    call = functools.partial(peers.sdpa("sdpa-math", False), *_inputs())
    assert timing.per_call_us([call], graph=False, min_calls=50, impl="sdpa-math") > 0
    assert len(sdpa_spy.enabled) >= 5 * 50 and sdpa_spy.entered == {"MATH": 1}
    assert all(e == {"MATH"} for e in sdpa_spy.enabled)


def test_a_peer_called_outside_the_harness_still_runs_only_its_backend(sdpa_spy):
    call = functools.partial(peers.sdpa("sdpa-flash", False), *_inputs())
    for _ in range(3):
        call()
    assert sdpa_spy.entered == {"FLASH_ATTENTION": 3} and sdpa_spy.enabled == [{"FLASH_ATTENTION"}] * 3
    assert all(flag() for flag in FLAGS.values()), "every backend enabled again afterwards"


def test_eager_and_graph_times_each_peer_under_its_own_name(monkeypatch):
    problem = fp8_decode_suite(batches=(1,), cache_lengths=(4096,), page_sizes=(0,))[1]
    seen = []
    monkeypatch.setattr(bench, "per_call_us", lambda calls, graph, impl: seen.append((impl, graph)) or 10.0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(L2_cache_size=1))
    case = base.Case(None, float, {"sdpa-cudnn": float, "sdpa-flash": float}, float, public=((), {}))
    names = ["tunegen", "sdpa-cudnn", "sdpa-flash"]
    times = bench.eager_and_graph(problem, None, case, names, torch.device("cpu"), 0)
    assert times == dict.fromkeys(names, (10.0, 10.0))
    assert seen == [(name, graph) for name in names for graph in (False, True)]


def test_fp8_cache_decode_peers_are_credited_with_the_bytes_they_read(monkeypatch):
    """The peers run on the e4m3 cache's dequantized 16-bit copy: 2 bytes an element, not 1."""
    bf16, fp8 = fp8_decode_suite(batches=(1,), cache_lengths=(4096,), page_sizes=(0,))
    family = get("decode")
    elements = 2 * 4096 * 8 * 128
    assert bench.credited(family, fp8, "tunegen") == elements
    assert (
        bench.credited(family, fp8, "sdpa-cudnn") == 2 * elements == bench.credited(family, bf16, "tunegen")
    )
    case = base.Case(lambda: None, lambda: 0.0, {"sdpa-cudnn": lambda: None}, float, public=((), {}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench, "cuda_gpu", lambda _: interpreter_gpu())
    monkeypatch.setattr(dispatch, "kernel_for", lambda problem, gpu: None)
    monkeypatch.setattr(family, "case", lambda *_: case)
    monkeypatch.setattr(bench, "check_then_time", lambda calls: {name: (0.5, 0.0, "") for name in calls})
    monkeypatch.setattr(
        bench, "eager_and_graph", lambda p, k, c, names, d, s: dict.fromkeys(names, (50.0, 25.0))
    )
    got = {r["impl"]: r for r in bench.bench_cases([fp8])}
    for impl, size in (("tunegen", 1), ("sdpa-cudnn", 2)):
        gbps = elements * size / 0.5 / 1e6
        assert got[impl]["rate"] == pytest.approx(gbps), impl
        assert (got[impl]["eager_rate"], got[impl]["graph_rate"]) == pytest.approx((10 * gbps, 20 * gbps))


def test_the_report_reads_fp8_cache_peers_as_16_bit():
    row = {
        "family": "decode", "dtype": "bfloat16", "head_dim": 128, "causal": True, "num_heads_q": 32,
        "num_heads_kv": 8, "batch": 1, "seqlen_q": 1, "seqlen_k": 4096, "unit": "GB/s", "ms": 0.02,
        "rate": 1.0, "note": "", "gpu": "g", "triton": "3.6.0", "torch": "2.11", "date": "d", "fp8": True,
    }  # fmt: skip
    ours, peer = (
        report.measurement({**row, "impl": "tunegen"}),
        report.measurement({**row, "impl": "sdpa-cudnn"}),
    )
    assert (
        ours.impl == "tunegen (e4m3 KV cache)"
        and peer.impl == "sdpa-cudnn (16-bit copy of the e4m3 KV cache)"
    )
    assert peer.bytes == 2 * ours.bytes


def test_fewer_rounds_still_start_by_equal_shares(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "median_ms", lambda fn, impl, **_: order.append(impl) or 1.0)
    calls = {name: float for name in "abcdef"}
    assert timing.interleaved_ms(calls, rounds=3) == dict.fromkeys("abcdef", 1.0)
    assert ["".join(order[i : i + 6]) for i in (0, 6, 12)] == ["abfced", "cdbeaf", "efdacb"]
    with pytest.raises(ValueError, match="rounds: expected at least 1 round, got 0"):
        timing.interleaved_ms(calls, rounds=0)


@pytest.mark.parametrize("count", range(1, 10))
def test_balanced_rounds_time_each_call_early_and_late_behind_every_other(count):
    """Over `balanced_rounds` rounds each round times every call, each call's mean position is the
    same, and each call follows every other one, not the same one in every round as a plain
    rotation would leave it; for an even count, a Latin square (each call once in every position)
    where each call follows each other exactly once."""
    rounds = balanced_rounds(count)
    assert rounds == (count + count % 2 if count > 1 else 1)
    rows = [round_order(count, i, rounds) for i in range(rounds)]
    assert all(sorted(row) == list(range(count)) for row in rows)
    assert len({sum(row.index(call) for row in rows) for call in range(count)}) == 1
    pairs = [(row[k], row[k + 1]) for row in rows for k in range(count - 1)]
    for call in range(count):
        assert {before for before, after in pairs if after == call} == set(range(count)) - {call}
    if count % 2 == 0:
        assert all(sorted(column) == list(range(count)) for column in zip(*rows, strict=True))
        assert len(set(pairs)) == len(pairs) == count * (count - 1)
    assert round_order(0, 0, 3) == []


@pytest.fixture
def benchmarks_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield
    for name in ("sweep", "fair_summary"):
        sys.modules.pop(name, None)


def test_the_sweeps_time_their_candidates_in_the_benchs_interleaved_rounds(benchmarks_path, monkeypatch):
    sweep = importlib.import_module("sweep")
    order = []
    monkeypatch.setattr(timing, "median_ms", lambda fn, impl, **_: order.append(impl) or fn())
    records = [{"impl": "sdpa-cudnn"}, {"variant": {"block_m": 64}}, {"variant": {"block_m": 128}}]
    sweep.time_in_rounds([(rec, lambda ms=ms: ms) for rec, ms in zip(records, (3.0, 1.0, 2.0), strict=True)])
    assert [rec["ms"] for rec in records] == [3.0, 1.0, 2.0]
    assert order[::3] == ["sdpa-cudnn", "candidate 1", "candidate 2"], "each first in one round"
    assert len(order) == 3 * sweep.ROUNDS
    for script in ("prefill_defaults", "decode_defaults", "backward_defaults", "fp8_defaults"):
        source = (BENCHMARKS / f"{script}.py").read_text()
        assert "time_in_rounds(timed)" in source and "median_ms" not in source, script


def test_the_fair_summary_reads_back_the_committed_claims(benchmarks_path, tmp_path):
    """Fed the files the claims were made from, the summary finds the claims as written."""
    fair_summary = importlib.import_module("fair_summary")
    results = BENCHMARKS / "results"
    shutil.copy(results / "launch_h100_run3.json", tmp_path / "fair_launch.json")
    shutil.copy(results / "decode_bench_h100.csv", tmp_path / "fair_decode.csv")
    with (results / "prefill_ws_h100_bench.csv").open() as fh:
        short = [r for r in csv.DictReader(fh) if int(r["seqlen"]) <= 1024]
    with (tmp_path / "fair_prefill.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(short[0]))
        writer.writeheader()
        writer.writerows(short)
    text = fair_summary.summarize(tmp_path)
    assert "missing: nothing." in text
    assert "| B=1: 3.2 to 3.4 times cuDNN's eager call at cache 4096 | 3.41x (dispatch_overhead.py)" in text
    assert "| below cuDNN at N <= 1024 (0.82 to 0.96) | 0.82 to 0.96 |" in text
    assert "| 1 | 4096 | contiguous | 853 / 651 / 1134 | 558 / 224 / 852 | 864 / 205 / 1374 | n/a |" in text
    (tmp_path / "fair_decode.csv").unlink()
    assert "missing: fair_decode.csv." in fair_summary.summarize(tmp_path)


@pytest.mark.gpu
@NEEDS_GPU
def test_bench_decode_credits_each_implementation_with_what_it_reads_on_the_gpu():
    """On an FP8 cache tunegen's rate counts the e4m3 bytes, a peer's those of the 16-bit copy it
    reads; kernel, eager and graph rates alike."""
    problems = fp8_decode_suite(batches=(1,), cache_lengths=(4096,), page_sizes=(0,))
    family = get("decode")
    timed = [r for r in bench.bench_cases(problems) if r["ms"]]
    assert "tunegen" in {r["impl"] for r in timed} and len({r["impl"] for r in timed}) >= 2, timed
    for r in timed:
        work = bench.credited(family, problems[r["fp8"]], r["impl"])
        assert r["rate"] == pytest.approx(work / r["ms"] / 1e6), r
        for kind in ("eager", "graph"):
            if r[f"{kind}_us"]:
                assert r[f"{kind}_rate"] == pytest.approx(work / r[f"{kind}_us"] / 1e3), r
