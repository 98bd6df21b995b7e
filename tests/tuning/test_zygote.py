"""Workers forked by a zygote: started from a clean copy of the tuning process, with what a spawned
worker gets (TRITON_INTERPRET, its cores), none of its parent's pipes, and spawned instead once
the zygote is gone; the host's CUDA devices read without touching CUDA in this process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import HAS_CUDA

from tunegen.kernels.gpu import interpreting
from tunegen.tuning import ranks
from tunegen.tuning import zygote as zygote_module
from tunegen.tuning.workers import Worker, WorkerPool
from tunegen.tuning.zygote import Zygote, usable

pytestmark = pytest.mark.skipif(not usable(), reason="workers are forked on Linux by a process without CUDA")


def _about(payload):
    fd = payload["fd"]
    try:
        os.fstat(fd)
        inherited = True
    except OSError:
        inherited = False
    return {
        "status": "ok",
        "pid": os.getpid(),
        "parent": os.getppid(),
        "interpret": interpreting(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "inherited": inherited,
    }


def test_a_forked_worker_gets_what_a_spawned_one_does_and_no_more():
    """And a worker for the mode this process's Triton was not imported in is spawned."""
    read, write = os.pipe()  # a pipe of this process's made before the zygote: not the workers'
    zygote = Zygote()
    cpus = (sorted(os.sched_getaffinity(0))[-1],)
    try:
        for interpret in (zygote.interpret, not zygote.interpret):
            worker = Worker(interpret=interpret, cpus=cpus, zygote=zygote)
            try:
                got = worker.call(_about, {"fd": write}, timeout=60)
            finally:
                worker.close()
            assert got["interpret"] == interpret
            assert got["cpus"] == list(cpus)
            if interpret != zygote.interpret:  # Triton here was imported for the other mode
                assert got["parent"] == os.getpid(), "spawned"
                continue
            assert got["parent"] == zygote.pid and got["pid"] != zygote.pid
            assert not got["inherited"], "the zygote closed its parent's pipes"
    finally:
        zygote.close()
        os.close(read)
        os.close(write)


def _matmul(payload):
    a = torch.randn(8, 128, 128, dtype=torch.float64)
    return {"status": "ok", "sum": float((a @ a).sum())}


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs CPU ops on two threads or more")
def test_a_forked_worker_runs_cpu_ops_after_its_ancestor_ran_them_on_threads():
    """GNU OpenMP's threads, started here by a parallel op, do not survive the forks: a worker's
    float64 reference would wait for them for good unless it runs its CPU ops on one thread."""
    a = torch.randn(8, 128, 128, dtype=torch.float64)
    (a @ a).sum()
    zygote = Zygote()
    worker = Worker(interpret=zygote.interpret, zygote=zygote)
    try:
        assert worker.call(_matmul, {}, timeout=30)["status"] == "ok"
    finally:
        worker.close()
        zygote.close()


def test_exit_codes_and_pids_are_reported_and_the_dead_are_reaped():
    zygote = Zygote()
    try:
        worker = Worker(interpret=zygote.interpret, zygote=zygote)
        first = worker._process
        os.kill(first.pid, signal.SIGKILL)
        first.join(30)
        assert first.exitcode == -signal.SIGKILL and not first.is_alive()
        worker._restart()  # what a call that found it dead does
        assert worker._process.pid != first.pid and worker._process.is_alive()
        worker.close()
        assert worker._process.exitcode == 0, "asked to stop, it ends cleanly"
        assert zygote.wait(os.getpid(), 0) == (True, None), "not one of its workers"
    finally:
        zygote.close()


def _hang(_payload):
    time.sleep(60)


def _state(pid: int) -> str:
    """The process's state letter: R or S while it runs, Z once it ended; "" once reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].split()[0]
    except OSError:
        return ""


def test_the_zygote_outlives_a_sigterm_to_the_process_group():
    """Its signals stay blocked: a SIGTERM to every process of the run (a service manager's stop)
    ends the workers, reported as stopped, and leaves the zygote to fork their replacements."""
    zygote = Zygote()
    worker = Worker(interpret=zygote.interpret, zygote=zygote)
    try:
        os.kill(zygote.pid, signal.SIGTERM)
        threading.Timer(1.0, os.kill, (worker._process.pid, signal.SIGTERM)).start()
        result = worker.call(_hang, {}, timeout=60)
        assert result["status"] == "stopped" and "exit code -15" in result["reason"], result
        assert _state(zygote.pid) in ("R", "S") and worker._process._zygote is zygote
        assert worker.call(_about, {"fd": -1}, timeout=60)["parent"] == zygote.pid
    finally:
        worker.close()
        zygote.close()


def test_a_hung_worker_is_killed_even_once_the_zygote_is_gone():
    zygote = Zygote()
    worker = Worker(interpret=zygote.interpret, zygote=zygote)
    try:
        hung = worker._process.pid
        os.kill(zygote.pid, signal.SIGKILL)
        os.waitpid(zygote.pid, 0)
        assert worker.call(_hang, {}, timeout=1)["reason"] == "timed out after 1 s"
        deadline = time.monotonic() + 10
        while _state(hung) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(hung) in ("", "Z"), "killed through its pidfd, its parent gone"
        assert worker.call(_about, {"fd": -1}, timeout=60)["parent"] == os.getpid(), "then spawned"
    finally:
        worker.close()
        zygote.close()


def _mark():
    os.environ["TUNEGEN_TEST_WARMED"] = "1"


def _fail():
    raise RuntimeError("a warm-up that fails")


def _warmed(_payload):
    return {"status": "ok", "warmed": os.environ.get("TUNEGEN_TEST_WARMED")}


def _stall():
    time.sleep(60)
    _mark()


@pytest.mark.parametrize("warm", [_mark, _fail, _stall])
def test_the_zygote_warms_up_after_its_first_worker_and_a_failed_or_slow_warm_up_is_cut(warm, monkeypatch):
    """The first worker (the timing one) is forked at once; the ones after it inherit the warm-up,
    which the next worker waits for no longer than WARM_S."""
    monkeypatch.setattr(zygote_module, "WARM_S", 1.0)
    zygote = Zygote(warm)
    start = time.monotonic()
    workers = [Worker(interpret=zygote.interpret, zygote=zygote) for _ in range(2)]
    assert time.monotonic() - start < 30
    try:
        first, second = (w.call(_warmed, {}, timeout=60) for w in workers)
        assert first["warmed"] is None and first["status"] == second["status"] == "ok"
        assert second["warmed"] == ("1" if warm is _mark else None)
        assert workers[1]._process._zygote is zygote, "forked: the zygote survived its warm-up"
    finally:
        for worker in workers:
            worker.close()
        zygote.close()


def test_workers_are_spawned_once_the_zygote_is_gone():
    zygote = Zygote()
    os.kill(zygote.pid, signal.SIGKILL)
    os.waitpid(zygote.pid, 0)
    pool = WorkerPool(2, interpret=True, zygote=zygote, start=1)
    try:
        got = pool.submit(_about, {"fd": -1}, timeout=60).result()
        assert got["parent"] == os.getpid(), "spawned by this process"
    finally:
        pool.close()
        zygote.close()


@pytest.mark.skipif(HAS_CUDA, reason="the test process has asked CUDA already (conftest)")
def test_the_hosts_devices_are_read_without_cuda_here():
    assert ranks.cuda_devices() == []
    assert usable(), "asking left this process able to fork workers that use CUDA"


@pytest.mark.skipif(HAS_CUDA, reason="the test process has asked CUDA already (conftest)")
def test_a_failure_getting_ready_beside_the_device_query_is_raised_where_its_answer_is_awaited(monkeypatch):
    """The thread that gets this process ready to fork while the child asks CUDA fails: the
    caller learns it where it waits for the devices, and the child is gone."""

    def fail():
        raise ValueError("no C compiler")

    monkeypatch.setattr(ranks, "_get_ready", fail)
    query = ranks.DeviceQuery()
    with pytest.raises(ValueError, match="no C compiler"):
        query.result()
    assert not multiprocessing.active_children()


def test_a_dry_run_from_a_process_whose_triton_compiles_spawns_interpreting_workers(tmp_path):
    """`tunegen tune --dry-run` where TRITON_INTERPRET is not set: Triton is imported to compile,
    and forked workers could not interpret (each trial would be recorded as failed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    url = f"sqlite:///{tmp_path / 'dry.db'}"
    args = ["--dry-run", "--shape", "4,2,32", "--seqlens", "512", "--causal", "no", "--gpus", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "tunegen.cli.main", "tune", *args, "--db", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with sqlite3.connect(tmp_path / "dry.db") as db:
        assert db.execute("SELECT reason FROM tunegen_failures").fetchall() == [], "no trial failed"
        assert db.execute("SELECT COUNT(*) FROM tunegen_winners").fetchone() == (1,)
