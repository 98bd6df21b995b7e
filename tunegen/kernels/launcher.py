"""Launching kernels at the driver's cost: each rendered module binds its kernels once per launch
key, and later calls go straight to the compiled kernel.

A Triton `kernel[grid](*args)` binds and specializes every argument, builds a cache key and looks
the compiled kernel up on every call: tens of microseconds of Python on a GPU whose kernel may
take ten. A rendered module's `bind` does that once for a set of arguments (their launch key:
shapes, strides, dtypes, device, 16-byte alignment) and returns a function that, for any later
arguments with the same key, computes only what changes (pointers, the scale) and calls each
compiled kernel's own launcher, `CompiledKernel.run`, with the grid and every other argument
fixed. Everything that launches a kernel goes through here: dispatch, the tuner's timing,
exported packages (which carry a copy of this module) and the interpreter (which takes Triton's
ordinary path, as does `TUNEGEN_LAUNCH=generic`). Every launch compiles with the options that
`releases.COMPILE_OPTIONS` pins.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton

from tunegen.kernels.gpu import DeviceFacts, meta_device_given, meta_facts
from tunegen.kernels.releases import COMPILE_OPTIONS


def _call_cache_size(text: str | None) -> int:
    """TUNEGEN_CALL_CACHE's value: a positive number of bound calls, else (with a warning) 1024."""
    try:
        size = int(text if text is not None else 1024)
    except ValueError:
        size = 0
    if size < 1:
        warnings.warn(
            f"TUNEGEN_CALL_CACHE: expected a positive number of bound calls, got {text!r}; using 1024",
            stacklevel=2,
        )
        return 1024
    return size


# Bound calls each cache keeps (TUNEGEN_CALL_CACHE when tunegen is imported): a rendered module's
# launches per launch key, and the public calls' per input signature. Past it, the least recently
# used is dropped and binds again if it comes back. A bound call holds no tensor of the call that
# bound it, so the bound is on host memory and binding time only.
CALL_CACHE_SIZE = _call_cache_size(os.environ.get("TUNEGEN_CALL_CACHE"))


class Calls:
    """A map of bound calls that keeps the `size` (default CALL_CACHE_SIZE) most recently used.

    A hit costs one lookup and a stamp (an ordered dict's move to the end would hash the key
    twice more, a microsecond of the fast path's budget on the GPU machines' CPUs); past `size`,
    the least recently used eighth is dropped at once, so the scan that finds it is paid once per
    `size // 8` new keys, each of which costs a bind anyway."""

    __slots__ = ("_clock", "_items", "size")

    def __init__(self, size: int | None = None) -> None:
        self.size = size or CALL_CACHE_SIZE
        self._items: dict[Hashable, list] = {}  # key -> [call, stamp of its last use]
        self._clock = itertools.count()

    def get(self, key: Hashable) -> Callable[..., Any] | None:
        """The call kept under `key` (now the most recently used), or None."""
        entry = self._items.get(key)
        if entry is None:
            return None
        entry[1] = next(self._clock)
        return entry[0]

    def __setitem__(self, key: Hashable, call: Callable[..., Any]) -> None:
        items = self._items
        items[key] = [call, next(self._clock)]
        if len(items) > self.size:
            by_use = sorted(list(items.items()), key=lambda item: item[1][1])
            for old, _ in by_use[: len(items) - self.size + self.size // 8]:
                items.pop(old, None)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


def direct_launches() -> bool:
    """Whether kernels launch through their compiled launcher (`TUNEGEN_LAUNCH=generic` and the
    interpreter say no)."""
    if os.environ.get("TUNEGEN_LAUNCH", "direct").lower() == "generic":
        return False
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes")


def key_of(*args: Any) -> tuple:
    """A launch key: for each tensor its shape, strides, dtype, device and whether its address is a
    multiple of 16 bytes (Triton specializes on that); other arguments (None, sizes, flags) as they
    are. Equal keys bind to the same launches."""
    tensor = torch.Tensor
    return tuple(
        [
            (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, tensor) else a
            for a in args
        ]
    )


def bound(
    kernel: Any, grid: tuple[int, ...], args: tuple, *, device: torch.device, **options: Any
) -> Callable[..., None]:
    """A function that launches `kernel` on `grid` with `options`, as `kernel[grid](*args, **options)`
    would, for `args` (every parameter of the kernel in order, constexprs too; `options` are
    Triton's, such as num_warps) and any later arguments of the same launch key: compiled (or
    found in Triton's cache) now, for `device`; afterwards each call is the compiled kernel's own
    launch on the current stream of `device`. Where kernels do not launch directly (see
    `direct_launches`), Triton's ordinary path runs on each call. For "meta", the kernel is
    compiled only (see `compiled_for_meta`) and the function does nothing."""
    clash = set(options) & set(getattr(kernel, "arg_names", ()))
    if clash:
        raise ValueError(f"options: {sorted(clash)} are parameters of the kernel; pass them in args")
    options = {**COMPILE_OPTIONS, **options}
    if device.type == "meta":
        compiled_for_meta(kernel, grid, args, options)
        return _nothing
    if device.type != "cuda" or not direct_launches():
        return lambda *a: kernel[grid](*a, **options)
    index = _index(device)
    grid3 = (*grid, 1, 1, 1)[:3]
    with torch.cuda.device(index):
        compiled = kernel.warmup(*args, grid=grid, **options)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        runner = compiled[grid3]  # loads the binary on this device: too much shared memory fails here
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    stream = triton.runtime.driver.active.get_current_stream
    current = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    hooks = triton.knobs.runtime

    gx, gy, gz = grid3

    def launch(*a: Any) -> None:
        if current() != index:
            with torch.cuda.device(index):
                runner(*a)
            return
        # Triton keeps a chain of launch hooks, empty when no profiler has set one (a plain
        # function or None where a user assigned one); with one set, Triton's own runner gives
        # it the launch's metadata.
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        quiet = enter is None or not getattr(enter, "calls", True)
        if quiet and (leave is None or not getattr(leave, "calls", True)):
            run(gx, gy, gz, stream(index), function, metadata, None, None, None, *a)
        else:
            runner(*a)

    return launch


# Programs a persistent grid launches per SM off CUDA (the interpreter): a few, so that each
# program still loops over several tiles of a test's small Problem.
INTERPRETER_PROGRAMS = 4


def resident_programs(kernel: Any, args: tuple, *, device: torch.device, **options: Any) -> int:
    """How many programs of `kernel`, compiled for `args` with `options`, are resident on `device`
    at once: its SMs times the programs one SM holds by registers, shared memory and threads (the
    size of a persistent grid). For "meta" the kernel is compiled only (see `compiled_for_meta`),
    and the count is the SMs': the grid is no part of what is compiled."""
    if device.type == "meta":
        compiled_for_meta(kernel, (1,), args, {**COMPILE_OPTIONS, **options})
        return device_properties(device).multi_processor_count
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = _index(device)
    with torch.cuda.device(index):
        compiled = kernel.warmup(*args, grid=(1,), **{**COMPILE_OPTIONS, **options})
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled[(1, 1, 1)]  # loads the binary, which fills in its register count
    props = torch.cuda.get_device_properties(index)
    threads = compiled.metadata.num_warps * 32
    # Registers are handed out per warp in units of 256.
    per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * threads // 32)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    shared = compiled.metadata.shared
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_shared = smem // (shared + 1024) if shared else 32
    return props.multi_processor_count * max(1, min(by_registers, by_threads, by_shared, 32))


# Steps of a key tile's walk each run of a split tail takes at least: the tail's own launch, its
# K and V loads and the partial dK and dV it passes on cost a few steps' time (the backward on an
# H100, benchmarks/results/issue30_h100.md: runs of 8 steps lost 3% at 1k tokens, of 33 gained).
SPLIT_STEPS_MIN = 32


def split_tail(tiles: int, programs: int, walk: int) -> tuple[int, int]:
    """How a grid of `tiles` equal tiles of `walk` steps each, on `programs` resident programs,
    shares out its last partial wave, stream-K style: (the tiles past the last whole wave, the
    programs that share their steps equally). Each program then takes fewer steps than one tile
    (so its run spans at most two tiles) and at least SPLIT_STEPS_MIN; (0, 0) where the tiles fill
    whole waves or a share would be shorter."""
    split = tiles % programs
    sharers = min(programs, split * walk // SPLIT_STEPS_MIN)
    return (split, sharers) if sharers > split else (0, 0)


def _index(device: torch.device) -> int:
    """A CUDA device's index, the current one for a bare "cuda" and for "meta"."""
    if device.type == "meta" or device.index is None:
        return torch.cuda.current_device()
    return device.index


def device_properties(device: torch.device) -> Any:
    """torch's properties of the CUDA device that kernels for tensors on `device` run on (the
    current one for "meta"); for "meta" in a process given the device it compiles for
    (gpu.set_meta_device), that device's facts, which hold only what compiling reads. Reading
    them makes no CUDA context."""
    facts = meta_device_given() if device.type == "meta" else None
    return facts or torch.cuda.get_device_properties(_index(device))


class _Streamless:
    """Triton's active driver, but for the current stream: a warm-up asks for it before compiling,
    and making a stream handle would make the process's CUDA context. In a process told what it
    compiles for (gpu.set_meta_device), the current device and target too: asking CUDA for them
    would initialize it."""

    def __init__(self, driver: Any, facts: DeviceFacts | None) -> None:
        self._driver = driver
        self._facts = facts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_device(self) -> int:
        return 0 if self._facts else self._driver.get_current_device()

    def get_current_target(self) -> Any:
        if self._facts is None:
            return self._driver.get_current_target()
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self._facts.major * 10 + self._facts.minor, 32)


def compiled_for_meta(kernel: Any, grid: tuple[int, ...], args: tuple, options: dict[str, Any]) -> Any:
    """`kernel` compiled (or found in Triton's cache) for `args` on meta tensors, for the device
    given to gpu.set_meta_device (else the current CUDA device), without touching it: no CUDA
    context, no binary loaded; its launcher is built too. A meta tensor's address is 0, so it
    specializes as the 16-byte aligned tensors of a real launch do, and the entry written is the
    one that launch finds. This is how tuning's compile workers compile (CUDA contexts come two
    to three a second for a whole host, and a binary loaded there would be loaded again where it
    is timed). Too much shared memory fails here as the binary's load would."""
    from triton.runtime.errors import OutOfResources

    drivers = triton.runtime.driver
    active = drivers.active
    drivers.set_active(_Streamless(active, meta_device_given()))
    try:
        compiled = kernel.warmup(*args, grid=grid, **options)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        props = meta_facts()
        limit = props.shared_memory_per_block_optin or props.shared_memory_per_block
        if compiled.metadata.shared > limit:
            raise OutOfResources(compiled.metadata.shared, limit, "shared memory")
        # Its launcher too, which Triton 3.6 builds per signature with a C compiler (0.18 s) into
        # the same cache, else on the first launch where it is timed.
        active.launcher_cls(compiled.src, compiled.metadata)
    finally:
        drivers.set_active(active)
    return compiled


def _nothing(*args: Any) -> None:
    """A bound call over meta tensors: they hold no data, so there is nothing to compute."""


def stream_of(device: torch.device) -> Callable[[], Any]:
    """A function giving the handle of `device`'s current stream (None off CUDA), as launches use."""
    if device.type != "cuda":
        return lambda: None
    index = _index(device)
    current = triton.runtime.driver.active.get_current_stream
    return lambda: current(index)


def rebased(descriptor: Any, base: torch.Tensor | None) -> Any:
    """A copy of a host-side tensor descriptor over another tensor of the same launch key, without
    the constructor's checks (already passed for that key); over None, the template a bound call
    keeps, which holds no tensor of the call that bound it."""
    copy = object.__new__(type(descriptor))
    copy.__dict__.update(descriptor.__dict__)
    copy.base = base
    return copy


def memoized(bind: Callable[..., Callable[..., None]], key: Callable[..., tuple]) -> Callable[..., None]:
    """A rendered module's `launch`: `bind(*args)` once per `key(*args)` (the most recent
    CALL_CACHE_SIZE kept), then the bound call."""
    calls = Calls()

    def launch(*args: Any) -> None:
        k = key(*args)
        call = calls.get(k)
        if call is None:
            call = calls[k] = bind(*args)
        call(*args)

    launch.calls = calls  # type: ignore[attr-defined]
    return launch


# Float32 bytes of workspace kept per (device, stream) between launches (see `workspace`): enough
# for decode's split partials at batch 1 (32 query heads of 128 over 32 splits take 528 KiB), whose
# calls are short enough for an allocation to show (4 to 5 µs each on the H100 machines' CPUs);
# larger workspaces come from PyTorch's allocator for one call and go back to it.
WORKSPACE_KEPT = 2 << 20
# Streams whose workspace is kept (the most recent; a program that makes streams as it goes would
# otherwise keep one per stream it ever used).
WORKSPACE_STREAMS = 8

_WORKSPACES: dict[tuple[int, int], tuple[tuple[torch.Tensor | None, ...], int, int, int]] = {}


def workspace(index: int, stream: int, floats: int, rows: int, counters: int) -> tuple[torch.Tensor, ...]:
    """Scratch for one launch on `stream` (a handle, as `stream_of` gives) of CUDA device `index`:
    float32 tensors of at least `floats` and `rows` elements, and int32 counters (at least
    `counters`) that are zero between launches, which the kernel must keep so (it resets each
    counter it counts on). Launches on one stream run in order, so they share one kept workspace,
    grown as needed up to WORKSPACE_KEPT bytes of float32 (and the counters to the largest call)."""
    kept = _WORKSPACES.get((index, stream))
    if kept is not None and floats <= kept[1] and rows <= kept[2] and counters <= kept[3]:
        return kept[0]  # type: ignore[return-value]
    return _grown(index, stream, floats, rows, counters)


def _grown(index: int, stream: int, floats: int, rows: int, counters: int) -> tuple[torch.Tensor, ...]:
    """`workspace` when the kept one is too small: grow it, or for a workspace past
    WORKSPACE_KEPT, allocate one for this call and keep only the counters."""
    key = (index, stream)
    f32 = {"device": torch.device("cuda", index), "dtype": torch.float32}
    kept = _WORKSPACES.pop(key, None)
    parts, rows_part, counts = kept[0] if kept is not None else (None, None, None)
    if counts is None or counts.numel() < counters:
        least = 0 if counts is None else counts.numel()
        counts = torch.zeros(max(counters, least), device=f32["device"], dtype=torch.int32)
    if 4 * (floats + rows) > WORKSPACE_KEPT:
        one_call = (torch.empty(floats, **f32), torch.empty(rows, **f32), counts)
    else:
        parts, rows_part = _at_least(parts, floats, f32), _at_least(rows_part, rows, f32)
        one_call = (parts, rows_part, counts)
    sizes = [0 if t is None else t.numel() for t in (parts, rows_part, counts)]
    _WORKSPACES[key] = ((parts, rows_part, counts), *sizes)
    while len(_WORKSPACES) > WORKSPACE_STREAMS:
        _WORKSPACES.pop(next(iter(_WORKSPACES)))
    return one_call


def _at_least(kept: torch.Tensor | None, numel: int, options: dict[str, Any]) -> torch.Tensor:
    return kept if kept is not None and kept.numel() >= numel else torch.empty(numel, **options)
