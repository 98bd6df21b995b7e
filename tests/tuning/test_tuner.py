"""The tuner under the interpreter: the machinery end to end (search, verification, recording,
resume, failures never retried, fleet workers sharing a study, workers surviving crashes)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

import optuna
import pytest
from click.testing import CliRunner

from tunegen.cli.main import main
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families import prefill
from tunegen.kernels.families.base import choose
from tunegen.kernels.gpu import interpreter_gpu
from tunegen.kernels.reference import TOLERANCE
from tunegen.tuning.presets import dry_run, parse_shape, preset, problems
from tunegen.tuning.samplers import make_sampler
from tunegen.tuning.study import study_name
from tunegen.tuning.tuner import TuneOptions, Tuner
from tunegen.tuning.workers import Worker, WorkerPool
from tunegen.tuning_db import FailureRecord, Store

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="tuner tests run kernels under the interpreter"
)
GPU = interpreter_gpu()
PROBLEM = dry_run(problems([parse_shape("4,2,32")], causal=(False,), seqlens=(1024,))[0])


def _crash(_payload):
    os._exit(3)


def _hang(_payload):
    time.sleep(60)


def _echo(payload):
    return {"status": "ok", "pid": os.getpid(), **payload}


def _nap(payload):
    """Long enough that the pool's two threads hold their workers at once: a fast task may be
    handed back before the second thread takes one, and then both run on the same worker."""
    time.sleep(1.0)
    return _echo(payload)


def test_workers_survive_crashes_and_hangs(zygote):
    worker = Worker(interpret=True, zygote=zygote)
    try:
        first = worker.call(_echo, {"x": 1}, timeout=60)
        assert first["x"] == 1
        crashed = worker.call(_crash, {}, timeout=60)
        assert (
            crashed["status"] == "error"
            and "died" in crashed["reason"]
            and "exit code 3" in crashed["reason"]
        )
        hung = worker.call(_hang, {}, timeout=1)
        assert hung == {"status": "error", "reason": "timed out after 1 s"}
        again = worker.call(_echo, {"x": 2}, timeout=60)
        assert again["x"] == 2 and again["pid"] != first["pid"]
    finally:
        worker.close()
    pool = WorkerPool(2, interpret=True, zygote=zygote)
    try:
        futures = [pool.submit(_nap, {"i": i}, timeout=60) for i in range(5)]
        results = [f.result() for f in futures]
        assert [r["i"] for r in results] == list(range(5)) and len({r["pid"] for r in results}) == 2
    finally:
        pool.close()


def test_search_space_respects_constraints():
    space = prefill.FAMILY.search_space(PROBLEM, GPU)
    assert space["reverse_m"] == [False] and space["order"] == ["m_inner"]
    causal = dataclasses.replace(PROBLEM, causal=True)
    assert prefill.FAMILY.search_space(causal, GPU)["reverse_m"] == [False, True]
    from tunegen.kernels.gpu import Gpu

    h100 = Gpu("H100", (9, 0), 132, 232448, "3.6.0", "2.11", "cuda")
    big = dataclasses.replace(PROBLEM, head_dim=256, batch=1, seqlen_q=4096, seqlen_k=4096)
    too_big = prefill.PrefillVariant(block_m=128, block_n=64, num_warps=8, num_stages=3)
    assert "shared memory" in prefill.FAMILY.constraint(too_big, big, h100)
    spilling = prefill.PrefillVariant(block_m=128, block_n=128, num_warps=4, num_stages=2)
    assert "registers" in prefill.FAMILY.constraint(spilling, dataclasses.replace(big, head_dim=128), h100)
    assert prefill.FAMILY.constraint(prefill.PrefillVariant(block_m=128, num_warps=8), big, h100) is None


def test_presets_and_shapes():
    assert preset("llama3-70b").heads == 64 and preset("qwen2.5-7b").kv_heads == 4
    with pytest.raises(ValueError, match="preset: expected one of"):
        preset("llama9")
    with pytest.raises(ValueError, match="shape: heads must be a multiple"):
        parse_shape("6,4,64")
    ps = problems([preset("gpt2")], causal=(False, True), seqlens=(512, 16384))
    assert [(p.causal, p.seqlen_q, p.batch) for p in ps] == [
        (False, 512, 32),
        (False, 16384, 1),
        (True, 512, 32),
        (True, 16384, 1),
    ]


def test_tune_records_a_verified_interpreter_winner_and_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    options = TuneOptions(trials=2, sampler="tpe", workers=1, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        first = tuner.tune(PROBLEM)
    assert first.winner is not None and first.recorded == "inserted" and first.evaluated == 2
    assert first.winner.gpu.backend == "interpreter" and first.winner.rel_err < TOLERANCE[PROBLEM.dtype]
    with Tuner(GPU, dataclasses.replace(options, trials=3)) as tuner:
        resumed = tuner.tune(PROBLEM)
    assert resumed.evaluated == 3, "a resumed study continues where it stopped"
    with Store(url) as store:
        (w,) = store.winners()
        assert w.median_ms == min(first.winner.median_ms, resumed.winner.median_ms)
    study = optuna.load_study(study_name=study_name(GPU, PROBLEM, "tpe"), storage=url)
    assert len([t for t in study.trials if t.user_attrs.get("evaluated")]) == 3
    default = prefill.FAMILY.default_variant(PROBLEM, GPU)
    space = prefill.FAMILY.search_space(PROBLEM, GPU)
    asked = choose(prefill.FAMILY, space, lambda name, _: getattr(default, name))
    assert study.trials[0].params == asked, "the default goes first"


def test_failed_variants_are_not_retried(tmp_path):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    space = prefill.FAMILY.search_space(PROBLEM, GPU)
    bad = prefill.PrefillVariant(block_m=16, block_n=16, num_warps=4, num_stages=1, load="ptr")
    with Store(url) as store:
        store.record_failure(
            FailureRecord(
                gpu_record(GPU),
                "prefill",
                PROBLEM.as_dict(),
                bad.as_dict(),
                GPU.triton_version,
                "wrong: planted",
            )
        )
    grid = 1
    for values in space.values():
        grid *= len(values)
    with Tuner(GPU, TuneOptions(trials=grid, sampler="grid", workers=2, url=url, trial_timeout=300)) as tuner:
        outcome = tuner.tune(PROBLEM)
    study = optuna.load_study(study_name=study_name(GPU, PROBLEM, "grid"), storage=url)
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert any("failed before: wrong: planted" in t.user_attrs.get("reason", "") for t in pruned)
    assert outcome.evaluated == grid - 1
    assert all(
        t.user_attrs.get("variant") != bad.to_json() for t in study.trials if t.user_attrs.get("evaluated")
    )


def _fleet_worker(url):
    options = TuneOptions(trials=8, sampler="grid", workers=1, url=url, trial_timeout=300)
    with Tuner(GPU, options) as tuner:
        tuner.tune(PROBLEM)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_fleet_workers_share_one_study_without_duplicates(tmp_path, backend, request):
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'fleet.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    Store(url).close()
    optuna.create_study(
        study_name=study_name(GPU, PROBLEM, "grid"),
        storage=url,
        sampler=make_sampler("grid", 0, prefill.FAMILY.search_space(PROBLEM, GPU)),
    )
    context = multiprocessing.get_context("spawn")
    fleet = [context.Process(target=_fleet_worker, args=(url,)) for _ in range(2)]
    for process in fleet:
        process.start()
    for process in fleet:
        process.join(600)
        assert process.exitcode == 0
    study = optuna.load_study(study_name=study_name(GPU, PROBLEM, "grid"), storage=url)
    evaluated = [t.user_attrs["variant"] for t in study.trials if t.user_attrs.get("evaluated")]
    assert len(evaluated) == len(set(evaluated)) == 8, "each Variant evaluated exactly once across the fleet"
    owners = {t.user_attrs["owner"] for t in study.trials if t.user_attrs.get("evaluated")}
    assert len(owners) == 2, "both workers took part"


def test_cli_tune_dry_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(
        main,
        [
            "tune",
            "--db",
            url,
            "--shape",
            "4,2,32",
            "--seqlens",
            "512",
            "--causal",
            "no",
            "--trials",
            "2",
            "--workers",
            "1",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tuned on triton-interpreter" in result.output and "inserted" in result.output
    listed = CliRunner().invoke(main, ["list", "--db", url, "--format", "json"])
    assert '"family": "prefill"' in listed.output
    bad = CliRunner().invoke(main, ["tune", "--db", url, "--preset", "llama9", "--dry-run"])
    assert bad.exit_code == 2 and "--preset: expected one of" in bad.output


def test_cli_tunes_the_decode_family_on_a_paged_cache(tmp_path):
    url = f"sqlite:///{tmp_path / 'decode.db'}"
    args = [
        "tune",
        "--db",
        url,
        "--family",
        "decode",
        "--shape",
        "8,2,64",
        "--seqlens",
        "4096",
        "--batches",
        "16",
        "--page-size",
        "32",
        "--trials",
        "2",
        "--workers",
        "1",
        "--dry-run",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "paged" in result.output and "inserted" in result.output and "GB/s" in result.output
    with Store(url) as store:
        (w,) = store.winners(family="decode")
    assert w.problem["page_size"] == 32 and w.problem["seqlen_q"] == 1 and w.gbps is not None
    assert 32 % w.variant["block_n"] == 0, "tiles lie within one page"
