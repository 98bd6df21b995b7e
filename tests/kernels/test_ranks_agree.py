"""Ranks agree: two processes of a torch.distributed job (gloo, on the CPU under Triton's
interpreter) serve the same Variant for a Problem although a faster Winner for it is recorded
between rank 0's first call and rank 1's: rank 1 serves from the snapshot rank 0 took, shared
through the job's store. A snapshot taken without torch.distributed does see the new Winner; a
job whose store cannot be used serves each rank's own reading, with a warning."""

from __future__ import annotations

import datetime
import multiprocessing
import socket

import pytest
import torch.distributed as dist

import tunegen
from helpers import qkv, record_winner
from tunegen.calls.prefill import PrefillCall
from tunegen.kernels import dispatch, snapshot

# Two Variants as explain() shows them (a float16 Problem on the interpreter): the knobs its search
# space offers a choice in, and those off their defaults; the Winners hold the same.
SLOW = {"block_m": 16, "block_n": 16, "num_stages": 1, "load": "ptr"}
FAST = {**SLOW, "block_m": 32}
TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, results, recorded) -> None:
    """One rank: join the job, wait (rank 1) until the new Winner is recorded, report the Variant
    its first call serves."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        if rank == 1 and not recorded.wait(TIMEOUT_S):
            raise TimeoutError("the new Winner was never recorded")
        results.put((rank, tunegen.explain(*qkv())["variant"]))
        dist.barrier()  # rank 0 hosts the job's store: it stays until rank 1 has used it
    finally:
        dist.destroy_process_group()


def test_every_rank_serves_the_first_ranks_snapshot(user_db, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks inherit it, and user_db's TUNEGEN_DB
    problem = PrefillCall.dense(*qkv()).problem(qkv()[0]).as_dict()
    record_winner(user_db, problem, SLOW, ms=2.0)
    context = multiprocessing.get_context("spawn")
    results, recorded = context.Queue(), context.Event()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, port, results, recorded)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        first = results.get(timeout=TIMEOUT_S)
        record_winner(user_db, problem, FAST, ms=0.5)  # replaces the slower Winner for this Problem
        recorded.set()
        second = results.get(timeout=TIMEOUT_S)
        for p in ranks:
            p.join(TIMEOUT_S)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    assert (first, second) == ((0, SLOW), (1, SLOW))
    dispatch.forget()
    assert tunegen.explain(*qkv())["variant"] == FAST, "a snapshot of its own would have the new Winner"


def test_without_the_jobs_store_each_rank_reads_for_itself(user_db, monkeypatch):
    def no_store():
        raise RuntimeError("this backend has no store")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", no_store)
    monkeypatch.setattr(snapshot, "_store_failed", False)
    record_winner(user_db, PrefillCall.dense(*qkv()).problem(qkv()[0]).as_dict(), SLOW)
    with pytest.warns(UserWarning, match="cannot share tuned winners.*no store"):
        assert tunegen.explain(*qkv())["variant"] == SLOW
