"""Where a tuning worker's start goes on a GPU host (issue 37): how long CUDA contexts take when
many processes make them at once, what `tunegen tune` does before its ranks start, and what a
compile worker's first compile costs against its second, with and without the compiler warmed
before the fork; and that its compiles (on meta tensors) make no CUDA context and write what the
timing worker's launch on real tensors then finds in Triton's cache. Run from a process that has
not touched CUDA; prints a table, writes JSON.

    python3 worker_startup.py -o results/worker_startup_h200x2.json
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import multiprocessing
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tunegen.kernels.compiler import ready_to_fork, warm_compiler
from tunegen.kernels.families import get
from tunegen.kernels.gpu import DeviceFacts, set_meta_device
from tunegen.tuning import ranks, trial
from tunegen.tuning.presets import preset, problems
from tunegen.tuning.zygote import usable


def _context(start: float, device: int, out: multiprocessing.Queue) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)  # as a rank's workers see their GPU
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    out.put(time.time() - start)


def contexts(count: int, gpus: int) -> list[float]:
    """Seconds from a common start until each of `count` forked processes had its context
    (spread over `gpus` devices)."""
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()
    start = time.time()
    procs = [fork.Process(target=_context, args=(start, i % gpus, out)) for i in range(count)]
    for p in procs:
        p.start()
    times = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    return times


def _context_made() -> bool:
    """Whether this process holds device 0's primary CUDA context (asked of the driver itself,
    which makes none to answer)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


def _cubins() -> int:
    return len(list(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")))


def _compiles(payloads: list[dict], out: multiprocessing.Queue) -> None:
    """A compile worker's tasks, timed, then whether they made a CUDA context."""
    steps = {}
    for i, payload in enumerate(payloads):
        t = time.time()
        profile = cProfile.Profile()
        try:
            steps[f"status {i}"] = profile.runcall(trial.compile_task, payload)["status"]
        except Exception as exc:  # as a worker reports it
            steps[f"status {i}"] = f"{type(exc).__name__}: {exc}"[:120]
        steps[f"compile {i}"] = time.time() - t
        if i == 0:  # where a first compile's time goes, by cumulative time
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
            steps["profile 0"] = text.getvalue().splitlines()[-32:]
    steps["context made"] = _context_made()
    out.put(steps)


def _real_binds(payloads: list[dict], out: multiprocessing.Queue) -> None:
    """The timing worker's side: a context, then each Variant on real inputs, bound and run once;
    the kernels it compiled itself (none if the compile worker's entries were found)."""
    steps = {}
    torch.empty(1, device="cuda")
    for i, payload in enumerate(payloads):
        _, case = trial._case(payload)
        before, t = _cubins(), time.time()
        case.launch()
        torch.cuda.synchronize()
        steps[f"bind and run {i}"] = time.time() - t
        steps[f"compiled again {i}"] = _cubins() - before
    out.put(steps)


def first_compiles(payloads: list[dict], warm: bool, facts: DeviceFacts) -> dict:
    """A forked process's compile of each payload, then a second one's launch of each on real
    inputs; with `warm`, a forked parent first gets ready as the host and a rank's zygote do
    (Triton's key and driver, the device's facts, the compiler warmed; no CUDA)."""
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()

    def child() -> None:
        if warm:  # as the host, then a rank's zygote, do before the compile workers are forked
            t = time.time()
            ready_to_fork()
            set_meta_device(facts)
            warm_compiler((facts.major, facts.minor))
            print(f"  ready to fork: {time.time() - t:.2f} s", flush=True)
        for target in (_compiles, _real_binds):
            p = fork.Process(target=target, args=(payloads, out))
            p.start()
            p.join()

    holder = fork.Process(target=child)
    holder.start()
    steps = {**out.get(), **out.get()}
    holder.join()
    return steps


START = """
import json, time
t = [time.time()]
import tunegen.cli.main
t.append(time.time())
from tunegen.tuning import host, presets, ranks, timeline
from tunegen.tuning.tuner import TuneOptions
t.append(time.time())
ranks.cuda_devices()
t.append(time.time())
steps = ("tunegen.cli", "tune's imports", "devices, this process getting ready meanwhile")
print(json.dumps({**dict(zip(steps, [b - a for a, b in zip(t, t[1:])])), "printed": time.time()}))
"""

# What the host does while its devices child asks CUDA (ranks._get_ready), each part timed
# alone, and the devices child alone.
PARTS = """
import json, multiprocessing, time
import tunegen.cli.main
import triton.backends
from triton.runtime.cache import triton_key
from tunegen.kernels.gpu import driver_version
from tunegen.tuning import ranks
steps = {}
t = time.time(); triton_key(); steps["Triton's key"] = time.time() - t
t = time.time(); triton.backends.backends["nvidia"].driver(); steps["Triton's CUDA driver"] = time.time() - t
t = time.time(); driver_version(); steps["nvidia-smi"] = time.time() - t
fork = multiprocessing.get_context("fork")
t = time.time(); child = fork.Process(target=ranks._devices); child.start(); child.join()
steps["devices child alone"] = time.time() - t
print(json.dumps(steps))
"""


def command_start() -> dict:
    """What `tunegen tune` does before its ranks start, each step timed in a fresh process: its
    imports, then the host's devices (asked in a forked child); and the slowest imports."""
    steps = json.loads(
        subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, check=True).stdout
    )
    steps["exit"] = time.time() - steps.pop("printed")
    steps.update(
        json.loads(
            subprocess.run([sys.executable, "-c", PARTS], capture_output=True, text=True, check=True).stdout
        )
    )
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import tunegen.cli.main"], capture_output=True, text=True
    ).stderr
    rows = [
        line.split("|") for line in traced.splitlines() if line.startswith("import time:") and "|" in line
    ]
    cumulative = sorted(((int(r[1]), r[2].rstrip()) for r in rows if r[1].strip().isdigit()), reverse=True)
    steps["slowest imports (cumulative s)"] = [(name.strip(), us / 1e6) for us, name in cumulative[:12]]
    return steps


def _facts() -> DeviceFacts:
    """Device 0's facts, asked in a forked child (this process must not touch CUDA)."""
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()
    child = fork.Process(target=lambda: out.put(ranks._devices()[0]))
    child.start()
    facts = out.get(timeout=60)  # raises where the child died without an answer
    child.join()
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--no-contexts", action="store_true", help="only the first compiles")
    args = parser.parse_args()
    assert usable(), "run from a process that has not touched CUDA"
    gpus = int(os.popen("nvidia-smi -L | wc -l").read().strip() or 1)
    os.environ["TUNEGEN_CACHE_DIR"] = tempfile.mkdtemp()
    results: dict = {"command start": command_start(), "contexts": [], "compiles": []}
    print(json.dumps(results["command start"], indent=1), flush=True)
    for count in () if args.no_contexts else (1, 8, 17, 34):
        times = contexts(count, gpus)
        row = {"count": count, "first": times[0], "median": statistics.median(times), "last": times[-1]}
        results["contexts"].append(row)
        print(
            f"contexts {count:2d}: first {times[0]:.2f}, median {row['median']:.2f}, last {times[-1]:.2f} s"
        )
    problem = problems([preset("llama3-8b")])[-1]
    family = get(problem.family)
    facts = _facts()
    gpu = facts.gpu()
    space = family.search_space(problem, gpu)
    default = family.default_variant(problem, gpu)
    flipped = {"pingpong": not default.pingpong} if default.schedule == "ws" else {"num_warps": 4}
    other = family.variant_type.from_json(json.dumps({**json.loads(default.to_json()), **flipped}))
    for warm in (False, True):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        payloads = [
            {"problem": problem.as_dict(), "variant": v.to_json(), "backend": "cuda", "seed": 0}
            for v in (default, other)
        ]
        steps = first_compiles(payloads, warm, facts)
        results["compiles"].append({"warm": warm, **steps})
        shown = {k: v for k, v in steps.items() if k != "profile 0"}
        print(f"first compiles, {'warmed' if warm else 'cold'}: {shown}", flush=True)
    results["space"] = {k: len(v) for k, v in space.items()}
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
