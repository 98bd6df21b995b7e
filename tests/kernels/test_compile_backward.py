"""The backward's kernels compile for sm_90 without a GPU: FlashAttention-2's loops within the
shared memory, the Hopper schedule within its register constraint (plain and with the features of
current models), and its walk in pairs with one barrier a step."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import re

import pytest
import triton
from test_compile import SPILL_BOUND, TARGETS

from tunegen.kernels import releases
from tunegen.kernels.compiler import CompileJob, compile_many
from tunegen.kernels.families import backward
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import interpreting, render

# The backward's Hopper schedule within its register constraint (families/backward_ws.py).
WS_BACKWARD_SPILL_BOUND = 256


def test_backward_kernels_compile_for_hopper():
    """The backward's preprocess, dK/dV and dQ kernels (dQ separate and by atomics; GQA, varlen,
    padded head dims, float32) compile for sm_90 within its shared memory."""
    gpu = TARGETS["hopper"]
    family = backward.FAMILY
    cases = [  # dtype, head dim, causal, varlen, dq_mode, kernels
        ("bfloat16", 128, True, False, "separate", ("preprocess", "dkdv", "dq")),
        ("float16", 80, True, True, "atomic", ("dkdv",)),
        ("float32", 64, False, True, "separate", ("dq",)),
        ("bfloat16", 256, False, False, "separate", ("dkdv",)),
    ]
    jobs = []
    for dtype, d, causal, varlen, dq_mode, kernels in cases:
        problem = Problem("backward", dtype, d, causal, 32, 8, 2, 4096, 4096, varlen=varlen)
        variant = backward.loops_default(problem, gpu)
        if dq_mode == "atomic":
            variant = variant.replace(
                dq_mode=dq_mode, dq_block_m=variant.dkdv_block_m, dq_block_n=variant.dkdv_block_n
            )
        assert family.constraint(variant, problem, gpu) is None
        rendered = render(family.template, "backward", variant, family.features(problem, gpu))
        jobs += [CompileJob(rendered, dtype, gpu.capability, kernel) for kernel in kernels]
    for job, report in zip(jobs, compile_many(jobs, workers=2), strict=True):
        assert report.error is None, (job.kernel, job.rendered.source.splitlines()[3], report.error)
        assert 0 < report.shared_bytes <= gpu.smem_per_block
        if job.kernel != "dkdv":
            assert report.local_bytes is not None and report.local_bytes <= SPILL_BOUND, job.kernel


def test_backward_hopper_schedule_compiles_within_its_constraint():
    """The backward's Hopper schedule (its default at head dims 64 and 128, causal and not, GQA;
    dQ by atomics, deterministic by either dQ path; a partition per consumer warpgroup; the walk
    in pairs and not; without a causal mask the split tail's launch too) and its row-wise kernels
    compile for sm_90 on the installed release, within shared memory and the spill bound its
    register constraint was calibrated to."""
    gpu = dataclasses.replace(TARGETS["hopper"], triton_version=triton.__version__)
    family = backward.FAMILY
    jobs = []
    for d, causal, changes in (
        (128, True, {}),
        (64, False, {}),
        (128, False, {"dq_write": "atomic", "deterministic": True, "split_tail": False}),
        (64, True, {"deterministic": True}),
        (128, True, {"split_warpgroups": True, "paired_walk": False}),
        (64, False, {"split_warpgroups": True, "paired_walk": False}),
        (128, False, {"paired_walk": True, "split_warpgroups": False}),
        (64, True, {"paired_walk": False}),
    ):
        problem = Problem("backward", "bfloat16", d, causal, 32, 8, 2, 4096, 4096)
        variant = family.default_variant(problem, gpu).replace(**changes)
        assert variant.schedule == "ws" and family.constraint(variant, problem, gpu) is None
        rendered = render(family.template, "backward", variant, family.features(problem, gpu))
        kernels = ("preprocess", "main", "postprocess") + (("tail",) if variant.split_tail else ())
        jobs += [CompileJob(rendered, "bfloat16", gpu.capability, kernel) for kernel in kernels]
    for job, report in zip(jobs, compile_many(jobs, workers=2), strict=True):
        assert report.error is None, (job.kernel, job.rendered.source.splitlines()[3], report.error)
        gluon = job.kernel in ("main", "tail")
        assert report.shared_bytes <= gpu.smem_per_block and (not gluon or report.shared_bytes > 0)
        assert report.local_bytes is not None and report.local_bytes <= WS_BACKWARD_SPILL_BOUND, job.kernel


def test_backward_hopper_schedule_compiles_with_the_features():
    """The backward's Hopper schedule with a window, chunks, the cap and sinks (their defaults, and
    fixed-order dQ by either path; a split tail under the cap) and the preprocess that writes the
    sinks' gradient compile for sm_90 on the installed release within shared memory; they spill at
    most the bound of the plain kernels, or on Triton 3.9, whose plain kernels already spill 200-416
    bytes at head dim 128, 512 (offline compiles of 3.6, 3.7.1 and 3.9, 2026-11-28)."""
    gpu = dataclasses.replace(TARGETS["hopper"], triton_version=triton.__version__)
    family = backward.FAMILY
    bound = WS_BACKWARD_SPILL_BOUND if releases.of(triton.__version__).version < (3, 9) else 512
    jobs = []
    for d, causal, features, changes in (
        (128, True, {"window_left": 4095, "softcap": True}, {}),
        (64, True, {"window_left": 127, "sinks": True}, {}),
        (128, True, {"window_left": 4095, "softcap": True}, {"deterministic": True, "dq_write": "atomic"}),
        (64, False, {"attention_chunk": 8192}, {"deterministic": True}),
        (128, False, {"softcap": True, "sinks": True}, {}),
        (128, False, {"window_left": 300, "window_right": 200, "attention_chunk": 1024, "sinks": True}, {}),
    ):
        problem = Problem("backward", "bfloat16", d, causal, 32, 8, 2, 4096, 4096, **features)
        variant = family.default_variant(problem, gpu).replace(**changes)
        assert variant.schedule == "ws" and family.constraint(variant, problem, gpu) is None
        rendered = render(family.template, "backward", variant, family.features(problem, gpu))
        kernels = ("preprocess", "main") + (("tail",) if variant.split_tail else ())
        jobs += [CompileJob(rendered, "bfloat16", gpu.capability, kernel) for kernel in kernels]
    assert any(job.kernel == "tail" for job in jobs)
    for job, report in zip(jobs, compile_many(jobs, workers=2), strict=True):
        assert report.error is None, (job.kernel, job.rendered.source.splitlines()[4], report.error)
        assert report.shared_bytes <= gpu.smem_per_block
        assert report.local_bytes is not None and report.local_bytes <= bound, job.kernel


def _barriers_between_arrivals(job: CompileJob) -> list[int]:
    from tunegen.kernels.compiler import compile_kernel

    marks = re.findall(r"cp\.async\.mbarrier\.arrive|\bbar\.sync\b", compile_kernel(job).asm["ptx"])
    runs = "".join("a" if m.startswith("cp") else "b" for m in marks).split("a")[1:-1]
    return [len(run) for run in runs]


@pytest.mark.skipif(
    releases.of(triton.__version__).version >= (3, 9),
    reason="3.9 puts barriers of its own in a step (before P's conversion, before dQ's adds)",
)
@pytest.mark.parametrize("causal", [False, True])
def test_paired_walk_leaves_one_barrier_a_step(causal):
    """What paired_walk is for: in the walk of head dim 64 (its default on 3.6), between one
    step's per-thread arrivals on the ring's "empty" and the next's, the PTX holds a single CTA
    barrier, the one before dQ; the knob off, three (benchmarks/results/issue30_ws_barriers_*)."""
    gpu = dataclasses.replace(TARGETS["hopper"], triton_version=triton.__version__)
    problem = Problem("backward", "bfloat16", 64, causal, 16, 8, 2, 4096, 4096)
    variant = backward.FAMILY.default_variant(problem, gpu).replace(split_warpgroups=False, paired_walk=True)
    rendered = render(backward.FAMILY.template, "backward", variant, backward.FAMILY.features(problem, gpu))
    with (
        interpreting(False),
        concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        job = CompileJob(rendered, "bfloat16", (9, 0), "main")
        runs = pool.submit(_barriers_between_arrivals, job).result()
    assert runs and min(runs) == 1, runs
