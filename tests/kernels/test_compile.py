"""Every default Variant compiles for real GPU targets (no GPU needed: Triton lowers to a cubin
anywhere), within the shared memory the target has; the interpreter alone would miss errors
such as non-constexpr globals that only the compiler rejects."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
from pathlib import Path

import triton

from tunegen.kernels.compiler import CompileJob, compile_many
from tunegen.kernels.families import decode, prefill
from tunegen.kernels.families.operands import ws_block_d
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import interpreting, render

TARGETS = {
    "hopper": Gpu("H100", (9, 0), 132, 232448, triton.__version__, "", "cuda"),
    "ampere": Gpu("A100", (8, 0), 108, 166912, "", "", "cuda"),
}
CASES = [
    ("bfloat16", 64, False, False, False),
    ("bfloat16", 128, True, False, True),
    ("float16", 80, True, True, True),
    ("bfloat16", 256, False, False, False),
    ("bfloat16", 192, True, True, False),
    ("float32", 128, True, False, True),
]
# Local memory (spills) a kernel that compiled without spilling on Triton 3.6 may take on any
# checked release; the kernels below that spill today (float32 prefill at head dim 128, the
# backward's dK/dV pass at 80, 128 and 256) are reported by benchmarks/results/issue28_h100.md.
SPILL_BOUND = 64


def _job(gpu, problem, variant=None):
    variant = variant or prefill.FAMILY.default_variant(problem, gpu)
    rendered = render(prefill.FAMILY.template, "prefill", variant, prefill.FAMILY.features(problem, gpu))
    return CompileJob(rendered, problem.dtype, gpu.capability)


def test_default_variants_compile_and_oversized_ones_are_caught():
    jobs, limits = [], []
    for gpu in TARGETS.values():
        for dtype, d, causal, varlen, lse in CASES:
            problem = Problem(
                "prefill", dtype, d, causal, 16, 4, 4, 4096, 4096, varlen=varlen, return_lse=lse
            )
            jobs.append(_job(gpu, problem))
            limits.append(gpu.smem_per_block)
        # A chunk over a paged cache (pages of 64: the Hopper schedule's blocks of 64 keys).
        paged = Problem(
            "prefill", "bfloat16", 128, True, 16, 4, 4, 2048, 16384, varlen=True, paged=True, page_size=64
        )
        jobs.append(_job(gpu, paged))
        limits.append(gpu.smem_per_block)
    for gpu in TARGETS.values():
        for paged, splits, lse in ((False, 1, True), (True, 4, True), (True, 1, False), (False, 8, False)):
            problem = Problem(
                "decode",
                "bfloat16",
                128,
                True,
                32,
                8,
                16,
                2,
                4096,
                paged=paged,
                page_size=64 if paged else 0,
                return_lse=lse,
            )
            variant = decode.DecodeVariant(block_n=64, num_splits=splits, num_warps=4, num_stages=2)
            rendered = render(decode.FAMILY.template, "decode", variant, decode.FAMILY.features(problem, gpu))
            jobs.append(CompileJob(rendered, "bfloat16", gpu.capability))
            limits.append(gpu.smem_per_block)
    oversized = prefill.PrefillVariant(block_m=128, block_n=128, num_warps=8, num_stages=2)
    jobs.append(
        _job(TARGETS["hopper"], Problem("prefill", "bfloat16", 256, False, 8, 8, 4, 4096, 4096), oversized)
    )
    reports = compile_many(jobs, workers=2)
    for job, limit, report in zip(jobs, limits, reports, strict=False):
        assert report.error is None, (job.rendered.source.splitlines()[3], report.error)
        assert 0 < report.shared_bytes <= limit
        assert report.local_bytes is not None
        if job.dtype != "float32":
            assert report.local_bytes <= SPILL_BOUND, (
                job.rendered.source.splitlines()[3],
                report.local_bytes,
            )
    assert reports[-1].shared_bytes > TARGETS["hopper"].smem_per_block


def test_fp8_variants_compile_for_hopper_with_e4m3_tensor_cores():
    """FP8 prefill runs its products as e4m3 wgmma on sm_90 (the second as bf16 with p_fp8 off),
    for either layout of V and either load path; decode over an e4m3 cache compiles too."""
    hopper = TARGETS["hopper"]
    problem = Problem("prefill", "bfloat16", 128, True, 32, 8, 4, 4096, 4096, fp8=True, return_lse=True)
    variants = [prefill.FAMILY.default_variant(problem, hopper)] + [
        prefill.PrefillVariant(
            block_m=128, block_n=64, num_warps=8, num_stages=3, load=load, v_trans=vt, p_fp8=pf
        )
        for load, vt, pf in (("ptr", False, True), ("desc", False, True), ("ptr", True, False))
    ]
    jobs = [_job(hopper, problem, variant) for variant in variants]
    cache = Problem("decode", "bfloat16", 128, True, 32, 8, 16, 1, 4096, paged=True, page_size=64, fp8=True)
    variant = decode.DecodeVariant(block_n=64, num_splits=4, num_warps=4, num_stages=2)
    rendered = render(decode.FAMILY.template, "decode", variant, decode.FAMILY.features(cache, hopper))
    jobs.append(CompileJob(rendered, "bfloat16", hopper.capability))
    reports = compile_many(jobs, workers=2)
    for job, report in zip(jobs, reports, strict=True):
        assert report.error is None, (job.rendered.source.splitlines()[3], report.error)
        assert 0 < report.shared_bytes <= hopper.smem_per_block
        assert report.local_bytes is not None and report.local_bytes <= SPILL_BOUND, report.local_bytes
    for variant, report in zip(variants, reports, strict=False):
        assert any(m.startswith("wgmma") and m.endswith(".e4m3.e4m3") for m in report.mma), report.mma
        assert any(m.endswith(".bf16.bf16") for m in report.mma) == (not variant.p_fp8), report.mma


def test_the_features_of_current_models_compile_without_spilling():
    """The prefill defaults with a window, chunks, the cap and sinks (gpt-oss's, Gemma 2's and Llama
    4's forms, and all four at once, dense and packed: the Hopper schedule on sm_90 where it runs,
    FA2's loop elsewhere), and decode with them (contiguous and paged caches), compile for sm_90
    and sm_80 as the defaults do."""
    features = [
        {"window_left": 127, "sinks": True},
        {"window_left": 4095, "softcap": True},
        {"attention_chunk": 8192},
        {"window_left": 63, "window_right": 31, "attention_chunk": 256, "softcap": True, "sinks": True},
    ]
    jobs = []
    for gpu in TARGETS.values():
        for changes, varlen in itertools.product(features, (False, True)):
            causal = "window_right" not in changes
            problem = Problem(
                "prefill",
                "bfloat16",
                64,
                causal,
                64,
                8,
                2,
                4096,
                4096,
                varlen=varlen,
                return_lse=True,
                **changes,
            )
            jobs.append(_job(gpu, problem))
        gemma2 = {"window_left": 4095, "softcap": True, "sinks": True}
        jobs.append(_job(gpu, Problem("prefill", "bfloat16", 128, True, 32, 16, 1, 16384, 16384, **gemma2)))
    for gpu in TARGETS.values():
        for changes, paged in itertools.product(features, (False, True)):
            problem = Problem(
                "decode", "bfloat16", 64, True, 64, 8, 16, 1, 8192, paged=paged, page_size=64 if paged else 0,
                return_lse=True, **{k: v for k, v in changes.items() if k != "window_right"},
            )  # fmt: skip
            variant = decode.FAMILY.default_variant(problem, gpu)
            rendered = render(decode.FAMILY.template, "decode", variant, decode.FAMILY.features(problem, gpu))
            jobs.append(CompileJob(rendered, problem.dtype, gpu.capability))
    for job, report in zip(jobs, compile_many(jobs, workers=2), strict=True):
        assert report.error is None, (job.rendered.source.splitlines()[3], report.error)
        assert report.local_bytes is not None and report.local_bytes <= SPILL_BOUND, report.local_bytes


def test_ws_variants_compile_for_sm90_with_wgmma_and_without_spilling():
    """The Hopper schedule is Gluon: it compiles offline for sm_90 like the rest, with its products
    as wgmma (m64 by block_n, and by the head-dim tile's part), what the installed release's
    constraint admits spills at most 64 bytes (releases differ: see tunegen.kernels.releases), and
    ptxas reuses no register an asynchronous product reads from (`sass.operand_clobbers`)."""
    gpu = TARGETS["hopper"]
    ws = prefill.PrefillVariant(schedule="ws", block_n=128, consumers=2, pingpong=True, overlap=True)
    grouped = dataclasses.replace(ws, block_n=64, num_stages=3, order="grouped")
    pair = dataclasses.replace(ws, block_n=64, consumers=1, pingpong=False, ctas_per_sm=2)
    dynamic = {"persistent": True, "dynamic": True}
    branch = {"mask_branch": True}
    parts = {"block_n": 64, "pingpong": False, "q_regs": True}
    cases = [  # dtype, head dim, causal, KV heads, lse, variant
        ("bfloat16", 128, True, 4, True, ws),
        ("float16", 128, False, 16, False, dataclasses.replace(ws, consumers=1, pingpong=False)),
        ("bfloat16", 64, True, 16, True, dataclasses.replace(ws, consumers=3, block_n=64, persistent=True)),
        ("bfloat16", 64, False, 1, True, dataclasses.replace(ws, block_m=128, block_n=64, producer_regs=40)),
        ("bfloat16", 128, True, 16, False, grouped),
        ("bfloat16", 64, True, 8, True, dataclasses.replace(ws, consumers=3, overlap=False, reverse_m=True)),
        ("e4m3", 128, True, 4, True, ws),
        ("e4m3", 128, False, 16, False, dataclasses.replace(ws, num_stages=4, persistent=True)),
        ("e4m3", 64, True, 16, True, dataclasses.replace(ws, consumers=3, overlap=False, order="grouped")),
        (
            "e4m3",
            128,
            False,
            4,
            True,
            dataclasses.replace(ws, pingpong=False, overlap=False, persistent=True),
        ),
        (
            "e4m3",
            128,
            True,
            16,
            False,
            dataclasses.replace(ws, pingpong=False, overlap=False, order="grouped"),
        ),
        ("bfloat16", 128, True, 4, True, dataclasses.replace(ws, q_stages=2, **dynamic)),
        ("bfloat16", 64, True, 16, False, dataclasses.replace(pair, q_stages=2, **dynamic)),
        ("e4m3", 128, True, 16, True, dataclasses.replace(ws, order="grouped", **dynamic)),
        ("bfloat16", 128, True, 4, False, dataclasses.replace(ws, q_stages=2, **branch, **dynamic)),
        ("bfloat16", 64, True, 16, True, dataclasses.replace(ws, consumers=3, overlap=False, **branch)),
        ("bfloat16", 64, False, 16, True, dataclasses.replace(ws, pingpong=False, stream_k=True, **dynamic)),
        ("float16", 128, False, 4, False, dataclasses.replace(ws, q_stages=2, stream_k=True, **dynamic)),
        ("bfloat16", 128, True, 4, True, dataclasses.replace(ws, o_store="registers", q_stages=2, **dynamic)),
        ("bfloat16", 256, True, 4, True, dataclasses.replace(ws, block_n=64, o_store="registers", **dynamic)),
        ("float16", 256, False, 16, False, dataclasses.replace(ws, block_n=32, num_stages=3)),
        (
            "bfloat16",
            192,
            True,
            4,
            True,
            dataclasses.replace(ws, block_n=64, pingpong=False, o_store="q_slot"),
        ),
        (
            "float16",
            160,
            False,
            16,
            False,
            dataclasses.replace(ws, block_n=64, num_stages=3, o_store="q_slot"),
        ),
        (
            "bfloat16",
            192,
            False,
            4,
            True,
            dataclasses.replace(ws, **parts, pv_pair=True, o_store="registers"),
        ),
    ]
    admitted, jobs = [], []
    for case in cases:
        dtype, d, causal, kv_heads, lse, variant = case
        fp8 = dtype == "e4m3"  # e4m3 inputs, bf16 output
        dtype = "bfloat16" if fp8 else dtype
        problem = Problem("prefill", dtype, d, causal, 16, kv_heads, 2, 4096, 4096, fp8=fp8, return_lse=lse)
        if prefill.FAMILY.constraint(variant, problem, gpu) is None:
            admitted.append(case)
            jobs.append(_job(gpu, problem, variant))
    assert len(admitted) >= 4, "each checked release admits most of these"
    reports = compile_many(jobs, workers=2)
    for (dtype, d, *_, variant), job, report in zip(admitted, jobs, reports, strict=True):
        assert report.error is None, (job.rendered.source.splitlines()[3], report.error)
        assert 0 < report.shared_bytes <= gpu.smem_per_block
        assert report.local_bytes is not None and report.local_bytes <= SPILL_BOUND, report.local_bytes
        # No instruction writes the registers a product still reads (P, or the query rows).
        assert report.clobbers == (), (job.rendered.source.splitlines()[3], report.clobbers)
        operand, k = {"bfloat16": ("bf16", 16), "float16": ("f16", 16), "e4m3": ("e4m3", 32)}[dtype]
        for n in (variant.block_n, ws_block_d(d)[1] * (2 if variant.pv_pair else 1)):
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{operand}.{operand}" in report.mma, (
                report.mma
            )
        if ws_block_d(d)[1] < ws_block_d(d)[0]:  # in parts: no product spans the whole tile
            assert not [m for m in report.mma if "m64n192" in m or "m64n256" in m], report.mma


def _warm_twice(cache: str) -> tuple[list[tuple[int, int]], bool]:
    os.environ["TRITON_CACHE_DIR"] = cache
    from tunegen.kernels.compiler import warm_compiler

    written = []
    for _ in range(2):
        warm_compiler((9, 0))
        (cubin,) = Path(cache).rglob("*.cubin")
        written.append((cubin.stat().st_ino, cubin.stat().st_mtime_ns))
    return written, "TRITON_ALWAYS_COMPILE" in os.environ


def test_warming_the_compiler_compiles_past_the_cache_and_leaves_the_environment(tmp_path):
    with (
        interpreting(False),
        concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        written, left = pool.submit(_warm_twice, str(tmp_path)).result()
    assert written[0] != written[1], "compiled again, not read from Triton's cache"
    assert not left, "TRITON_ALWAYS_COMPILE restored"


def _ready_without_cuda() -> tuple[bool, bool, str, int, str | None]:
    import sys
    import threading

    import torch
    import triton
    import triton.backends.nvidia.driver as nvidia

    from tunegen.kernels.compiler import ready_to_fork

    def asked(*args, **kwargs):
        raise AssertionError("CUDA was asked something")

    class Utils:  # the driver's utility module, which a C compiler builds against libcuda
        pass

    torch.cuda.is_available = torch.cuda.device_count = torch.cuda._lazy_init = asked
    sys.modules["triton.runtime.driver"]._create_driver = asked  # Triton's own choice asks CUDA
    nvidia.CudaUtils = Utils  # the real driver's constructor runs, with this module
    from triton.runtime.cache import triton_key

    failure = ready_to_fork()
    hashed = triton_key.cache_info().currsize == 1
    made = type(triton.runtime.driver.active).__name__
    return hashed, torch.cuda.is_initialized(), made, threading.active_count(), failure


def test_getting_ready_to_fork_hashes_triton_and_makes_its_driver_asking_cuda_nothing():
    """The host does, once, what every rank and worker forked from it would do before its first
    kernel, and must leave CUDA untouched and no thread running: a process forked after any CUDA
    question cannot use it, and one forked beside a thread may inherit a lock held for good."""
    with (
        interpreting(False),
        concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        hashed, initialized, made, threads, failure = pool.submit(_ready_without_cuda).result()
    assert failure is None
    assert hashed, "Triton's key computed here, for the forks to inherit"
    assert not initialized
    assert made == "CudaDriver", "the NVIDIA driver made directly and made the active one"
    assert threads == 1, "the hashing thread has ended"
