"""Tuning's compile workers bind kernels to meta tensors (launcher.compiled_for_meta): they compile
for the GPU without making a CUDA context, and must write the very cache entry the timing
worker's launch on real tensors looks up, else every trial compiles again on the GPU's lane.

Checked here on a stand-in GPU host (an H100's facts given to the process, a CUDA and a Triton
driver that fail whatever they are asked, but for the driver's launcher class, which records the
launchers made): each family's compile task on meta tensors, then in
a fresh process the same kernels bound to real tensors, which must find every kernel in
Triton's cache and compile nothing."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import types
from pathlib import Path

from tunegen.kernels.families import get
from tunegen.kernels.gpu import DeviceFacts, Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import interpreting

H100 = DeviceFacts(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    L2_cache_size=50 * 2**20,
    shared_memory_per_block_optin=232448,
    shared_memory_per_block=49152,
)

PROBLEMS = {
    # the Hopper schedule (Gluon), GQA, a length no block divides, persistent (its grid reads the
    # SM count) and grouped (an argument read from the L2 cache's size)
    "prefill-ws": Problem("prefill", "bfloat16", 128, True, 8, 2, 2, 333, 333, return_lse=True),
    # FlashAttention-2's loop (Triton) at an odd head dim
    "prefill-fa2": Problem("prefill", "float16", 80, False, 4, 4, 1, 200, 200),
    "prefill-fp8": Problem("prefill", "bfloat16", 128, False, 4, 2, 1, 256, 256, fp8=True),
    "backward-ws": Problem("backward", "bfloat16", 64, True, 4, 2, 2, 300, 300),
    "decode-paged": Problem("decode", "float16", 128, False, 8, 2, 3, 1, 1000, paged=True, page_size=64),
    "decode-fp8": Problem(
        "decode", "bfloat16", 128, False, 8, 2, 3, 1, 1000, paged=True, page_size=64, fp8=True
    ),
}
# Knobs off the family's default for the Problem: the Hopper schedules, which long Problems get.
KNOBS = {
    "prefill-ws": {"schedule": "ws", "consumers": 2, "pingpong": True, "block_n": 128, "num_stages": 2},
    "prefill-fa2": {},
    "prefill-fp8": {},
    "backward-ws": {"schedule": "ws", "kv_regs": True, "num_stages": 2},
    "decode-paged": {},
    "decode-fp8": {},
}
PERSISTENT = {"prefill-ws": {"persistent": True, "order": "grouped"}}


def _stand_in(cache: str) -> tuple[Gpu, list]:
    """This process as a tuning compile worker on an H100 host sees it: Triton's cache in `cache`,
    told what it compiles for (gpu.set_meta_device), and a CUDA that fails whatever it is asked, as
    the worker must ask it nothing (not even the current device: that initializes CUDA). Returns
    the Gpu and the list of the launchers made, as the driver's launcher class records them."""
    os.environ["TRITON_CACHE_DIR"] = cache
    import torch
    import triton

    from tunegen.kernels import gpu

    def asked(*args, **kwargs):
        raise AssertionError("CUDA was asked something")

    launchers = []

    class Driver:
        get_current_device = get_current_stream = get_current_target = get_device_capability = asked

        def launcher_cls(self, src, metadata):
            launchers.append(src.fn.__name__)

    triton.runtime.driver.set_active(Driver())
    for name in ("current_device", "get_device_properties", "get_device_capability", "_lazy_init"):
        setattr(torch.cuda, name, asked)
    gpu.set_meta_device(H100)
    return H100.gpu(), launchers


def _cubins(cache: str) -> int:
    return len(list(Path(cache).rglob("*.cubin")))


def _on_meta(cache: str, payloads: list[dict]) -> list[tuple[str, int]]:
    """Each payload's compile task as a worker runs it: its status and the cubins then cached."""
    _, launchers = _stand_in(cache)
    from tunegen.tuning.trial import compile_task

    out = []
    for payload in payloads:
        made = len(launchers)
        result = compile_task(payload)
        # Each compiled kernel's launcher is made where it compiles, not on its first launch.
        assert len(launchers) > made, payload
        out.append((result["status"], _cubins(cache)))
    import sys

    import torch

    # What a template reads of the device, it reads of the current CUDA device for meta tensors:
    # the L2 cache's size sets an argument Triton specializes on.
    rendered = [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]
    helpers = [m.__dict__["_l2_bytes"] for m in rendered if "_l2_bytes" in m.__dict__]
    l2 = {f(torch.device("meta")) for f in helpers}
    assert l2 == {H100.L2_cache_size}, l2
    # Computing on meta tensors goes through torch's references, whose first use imports
    # torch._dynamo: 1.3-1.6 s of a worker's first compile. The cases make their meta inputs
    # without computing.
    assert "torch._dynamo" not in sys.modules
    return out


def _on_real_tensors(cache: str, payloads: list[dict]) -> list[int]:
    """Each payload's kernels bound to real (CPU) tensors of the same shapes, compiled as a
    launch would specialize them, in a fresh process: the cubins cached after each."""
    gpu, _ = _stand_in(cache)
    import torch

    from tunegen.kernels import launcher
    from tunegen.kernels.families import base

    # The timing worker reads its real device's properties: the H100's.
    launcher.device_properties = lambda device: H100

    meta = launcher.bound

    def bound(kernel, grid, args, *, device, **options):
        # Real tensors (16-byte aligned CPU memory), compiled the way a meta bind compiles.
        return meta(kernel, grid, args, device=torch.device("meta"), **options)

    launcher.bound = bound
    counts = []
    for payload in payloads:
        problem = Problem(**payload["problem"])
        family = get(problem.family)
        kernel = base.build(family, family.variant_type.from_json(payload["variant"]), problem, gpu)
        binding = dataclasses.replace(kernel, launch=kernel.bind)
        family.case(problem, binding, torch.device("cpu"), payload["seed"]).launch()
        counts.append(_cubins(cache))
    return counts


def _in_fresh_process(fn, *args):
    spawn = multiprocessing.get_context("spawn")
    with interpreting(False), concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(fn, *args).result()


def test_meta_compiles_are_what_real_launches_find(tmp_path):

    gpu = H100.gpu()
    payloads = []
    for name, problem in PROBLEMS.items():
        family = get(problem.family)
        for knobs in (KNOBS[name], {**KNOBS[name], **PERSISTENT.get(name, {})}):
            variant = dataclasses.replace(family.default_variant(problem, gpu), **knobs)
            assert family.constraint(variant, problem, gpu) is None, (name, variant)
            payload = {"problem": problem.as_dict(), "variant": variant.to_json(), "seed": 1}
            payload["backend"] = "cuda"
            if payload not in payloads:
                payloads.append(payload)
    cache = str(tmp_path)
    compiled = _in_fresh_process(_on_meta, cache, payloads)
    assert [status for status, _ in compiled] == ["ok"] * len(payloads), compiled
    counts = [count for _, count in compiled]
    assert all(b > a for a, b in zip([0, *counts], counts, strict=False)), ("each compiled something", counts)
    assert _in_fresh_process(_on_real_tensors, cache, payloads) == [counts[-1]] * len(payloads), (
        "real tensors found every kernel the meta ones compiled"
    )


def test_the_target_a_meta_compile_takes_is_the_one_triton_computes_for_the_device():
    """A compile worker takes its target from the facts it was given; the timing worker, from
    Triton's driver asking CUDA. Were they different, every trial would compile again where it is
    timed (the test above cannot see it: both its processes are given the facts)."""
    from triton.backends.nvidia.driver import CudaDriver

    from tunegen.kernels.launcher import _Streamless

    asked = types.SimpleNamespace(get_current_device=lambda: 0, get_device_capability=lambda device: (9, 0))
    assert _Streamless(object(), H100).get_current_target() == CudaDriver.get_current_target(asked)
