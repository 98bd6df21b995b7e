"""What differs between Triton releases lives in tunegen.kernels.releases: the Gluon names the
Hopper schedule renders, its register budget, the numerics every launch pins, and the schedules a
release too old refuses by name (dispatch then serves another)."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch
import triton

from tunegen.kernels import dispatch, launcher, releases, snapshot
from tunegen.kernels import render as render_module
from tunegen.kernels.database import gpu_record
from tunegen.kernels.families import prefill, prefill_ws
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import render
from tunegen.tuning_db import Store, WinnerRecord

H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, "3.6.0", "2.11", "cuda")
PROBLEM = Problem("prefill", "bfloat16", 128, True, 16, 4, 2, 4096, 4096)
WS = prefill.PrefillVariant(schedule="ws", block_m=64, block_n=128, consumers=2, pingpong=True, overlap=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3.6.0", (3, 6)), ("3.7.1", (3, 7)), ("3.9.0+git1a2b3c", (3, 9)), ("3.10", (3, 10)), ("", (0, 0))],
)
def test_versions_read_major_and_minor(text, expected):
    assert releases.version(text) == expected
    assert releases.of(text).version == expected


def test_the_installed_release_is_checked_and_the_range_is_contiguous():
    assert releases.INSTALLED.version == releases.version(triton.__version__)
    assert releases.INSTALLED.checked, f"CI runs checked releases only, not {triton.__version__}"
    minors = [minor for _, minor in releases.CHECKED]
    assert minors == list(range(minors[0], minors[-1] + 1))


def test_an_unchecked_release_warns_once_at_import(monkeypatch):
    monkeypatch.setattr(releases, "INSTALLED", releases.of("3.10.0"))
    with pytest.warns(UserWarning, match=r"checked on Triton 3.6 to 3.9; Triton .* is not among them"):
        releases.warn_if_unchecked()
    monkeypatch.setattr(releases, "INSTALLED", releases.of("3.7.1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        releases.warn_if_unchecked()


@pytest.mark.parametrize(
    ("text", "load", "store"),
    [
        ("3.6.0", "async_copy_global_to_shared", "async_copy_shared_to_global"),
        ("3.7.1", "async_copy_global_to_shared", "async_copy_shared_to_global"),
        ("3.8.0", "async_load", "async_store"),
        ("3.9.0", "async_load", "async_store"),
    ],
)
def test_the_hopper_schedule_renders_each_releases_tma_names(text, load, store):
    """3.9 made the old names stubs that raise; 3.8 has both, 3.6 and 3.7 only the old ones."""
    features = prefill.FAMILY.features(PROBLEM, H100)
    source = render(prefill.FAMILY.template, "prefill", WS, features, releases.of(text)).source
    assert f"# triton: {releases.of(text).name}" in source
    assert source.count(f"tma.{load}(") == 3 and source.count(f"tma.{store}(") == 1
    stale = {"async_copy_global_to_shared", "async_copy_shared_to_global", "async_load", "async_store"}
    assert not any(f"tma.{name}(" in source for name in stale - {load, store})


def test_the_register_budget_is_the_releases():
    """The same Variant is admitted by 3.6's budget and refused by 3.9's, which needs 16 more."""
    tight = dataclasses.replace(WS, consumers=3, pingpong=True, overlap=False)  # 32 left at head dim 64
    problem = dataclasses.replace(PROBLEM, head_dim=64)
    assert tight.consumer_regs - prefill_ws.ws_tile_registers(tight, 64) == 32
    for text, admitted in (("3.6.0", True), ("3.7.1", True), ("3.8.0", True), ("3.9.0", False)):
        found = prefill.FAMILY.constraint(tight, problem, dataclasses.replace(H100, triton_version=text))
        assert (found is None) == admitted, (text, found)
        assert admitted or found.startswith("registers: about 176 per consumer thread, 160 left")


@pytest.mark.parametrize("text", ["3.6.0", "3.7.1", "3.8.0", "3.9.0"])
def test_every_hopper_default_is_within_its_releases_budget(text):
    """Dispatch never serves what the running release's constraint refuses: where a release needs
    more registers than the one a default was measured on, two consumers take its place; FP8
    takes FlashAttention-2's loop at the head dims where the release spills its e4m3 tiles."""
    gpu = dataclasses.replace(H100, triton_version=text)
    release = releases.of(text)
    schedules = set()
    grid = itertools.product((64, 128), (False, True), (False, True), (512, 1024, 4096, 16384))
    for d, causal, fp8, n in grid:
        problem = Problem("prefill", "bfloat16", d, causal, 16384 // n, 16, 16, n, n, fp8=fp8)
        variant = prefill.FAMILY.default_variant(problem, gpu)
        assert prefill.FAMILY.constraint(variant, problem, gpu) is None, (problem, variant)
        schedules.add((fp8, variant.schedule))
        if fp8 and d not in release.ws_fp8_head_dims:
            assert variant.schedule == "fa2"
    assert (False, "ws") in schedules and ((True, "ws") in schedules) == bool(release.ws_fp8_head_dims)


def test_a_release_too_old_for_a_schedule_refuses_it_by_name_and_dispatch_serves_another(user_db):
    old = dataclasses.replace(H100, triton_version="3.5.1")
    with pytest.raises(ValueError, match=r"variant\.schedule: 'ws' is written for Triton >= 3\.6, not 3\.5"):
        prefill.FAMILY.check_variant(WS, PROBLEM, old)
    assert prefill.FAMILY.default_variant(PROBLEM, H100).schedule == "ws"
    assert prefill.FAMILY.default_variant(PROBLEM, old).schedule == "fa2"
    assert "ws" not in prefill.FAMILY.search_space(PROBLEM, old)["schedule"]
    with Store(user_db) as store:
        store.record_winner(
            WinnerRecord(
                gpu=gpu_record(old),
                family="prefill",
                problem=PROBLEM.as_dict(),
                variant=WS.as_dict(),
                median_ms=1.0,
                rel_err=1e-3,
                triton_version="3.6.0",
                torch_version="2.11",
                template_hash="h",
            )
        )
    dispatch.forget()
    served = dispatch.select(PROBLEM, old, snapshot.for_gpu(old))
    assert (served.source, served.variant.schedule) == ("default", "fa2")
    served = dispatch.select(PROBLEM, H100, snapshot.for_gpu(H100))
    assert (served.source, served.variant) == ("winner", WS), "the same Winner where its release runs"


def test_every_launch_pins_fp_fusion(monkeypatch):
    """Off CUDA a bound launch is Triton's ordinary call: it must carry the pinned options too."""
    seen = {}

    class Kernel:
        arg_names = ("x",)

        def __getitem__(self, grid):
            return lambda *args, **options: seen.update(options)

    launcher.bound(Kernel(), (1,), (0,), device=torch.device("cpu"), num_warps=4)(0)
    assert seen == {**releases.COMPILE_OPTIONS, "num_warps": 4}
    assert releases.COMPILE_OPTIONS == {"enable_fp_fusion": True}


@pytest.mark.parametrize(("text", "dims"), [("3.7.1", (64, 128)), ("3.8.0", ()), ("3.9.0", ())])
def test_fp8_on_the_hopper_schedule_is_refused_by_name_where_the_release_spills(text, dims):
    gpu = dataclasses.replace(H100, triton_version=text)
    for d in (64, 128):
        problem = dataclasses.replace(PROBLEM, head_dim=d, fp8=True)
        if d in dims:
            prefill.FAMILY.check_variant(WS, problem, gpu)
        else:
            with pytest.raises(ValueError, match=rf"'ws' takes no FP8 at head dim {d} on Triton 3\.\d"):
                prefill.FAMILY.check_variant(WS, problem, gpu)


def test_an_interpreter_that_cannot_run_the_kernels_says_why(monkeypatch):
    """Triton 3.6's interpreter fails on numpy 2.4 with 'only 0-dimensional arrays can be
    converted': loading a kernel for it names the fix instead."""
    monkeypatch.setattr(releases, "INSTALLED", releases.of("3.6.0"))
    assert releases.interpreter_problem("2.3.5") is None
    assert "needs numpy below 2.4, not 2.4.6" in releases.interpreter_problem("2.4.6")
    monkeypatch.setattr(releases, "INSTALLED", releases.of("3.7.1"))
    assert releases.interpreter_problem("2.4.6") is None
    monkeypatch.setattr(render_module, "interpreter_problem", lambda: "Triton 3.6's interpreter needs numpy")
    rendered = render(prefill.FAMILY.template, "prefill", WS, prefill.FAMILY.features(PROBLEM, H100))
    with pytest.raises(RuntimeError, match="interpreter needs numpy"):
        render_module.load(rendered, interpret=True)
