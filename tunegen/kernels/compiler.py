"""Compiling rendered kernels for a GPU target without the GPU: Triton lowers to a cubin on any
machine, so compile errors and shared-memory overflows show up on a CPU-only machine or CI.

Compiles run in fresh worker processes: Triton fixes at import whether its own library
functions are interpreted, so a process that ran kernels under TRITON_INTERPRET=1 cannot
compile for a GPU, and compiling is CPU-bound work worth spreading over cores anyway.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tunegen.kernels import sass
from tunegen.kernels.environ import environment
from tunegen.kernels.releases import COMPILE_OPTIONS
from tunegen.kernels.render import Rendered, interpreting, load

if TYPE_CHECKING:
    from triton.compiler.compiler import CompiledKernel

TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What compiling one kernel for one target produced: shared memory, the tensor-core
    instructions in its PTX (whether FP8 products run as e4m3 wgmma, for one), the registers per
    thread it launches with and the local memory (spills) its cubin uses, on sm_90 the
    instructions that write registers an asynchronous wgmma still reads (`sass.operand_clobbers`;
    None where not looked for), or the compiler's error."""

    capability: tuple[int, int]
    shared_bytes: int | None
    error: str | None = None
    mma: tuple[str, ...] = ()
    registers: int | None = None
    local_bytes: int | None = None
    clobbers: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel of a rendered module for one target: the module's KERNEL, or with `kernel` the
    one its KERNELS names (templates with several kernels, such as the backward's)."""

    rendered: Rendered
    dtype: str
    capability: tuple[int, int]
    kernel: str | None = None


def compile_kernel(job: CompileJob) -> CompiledKernel:
    """Triton's compiled kernel (PTX, cubin, metadata) of one rendered kernel, compiled in this
    process (which must never have interpreted a kernel); raises the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = load(job.rendered, interpret=False)
    if job.kernel is None:
        kernel = module.KERNEL
        types, constexprs = module.signature(TRITON_DTYPES[job.dtype])
    else:
        kernel = module.KERNELS[job.kernel]
        types, constexprs = module.signature(TRITON_DTYPES[job.dtype], job.kernel)
    # As a launch on 16-byte aligned tensors would: pointers and strides divisible by 16,
    # which is what lets Triton pipeline the loads (and what sizes shared memory).
    aligned = [
        (i,)
        for i, name in enumerate(kernel.arg_names)
        if name.startswith("stride_") or types[name].startswith("*")
    ]
    attrs = {index: [["tt.divisibility", 16]] for index in aligned}
    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(kernel, types, constexprs=constexprs, attrs=attrs)
    else:
        source = ASTSource(kernel, types, constexprs=constexprs, attrs=attrs)
    arch = job.capability[0] * 10 + job.capability[1]
    # Modules of several kernels may launch each with knobs of its own (OPTIONS per kernel).
    options = getattr(module, "OPTIONS", {}).get(job.kernel) or {
        "num_warps": module.NUM_WARPS,
        "num_stages": module.NUM_STAGES,
    }
    options = {**COMPILE_OPTIONS, **options}
    if getattr(module, "MAXNREG", None) is not None:
        options["maxnreg"] = module.MAXNREG
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_for(job: CompileJob) -> CompileReport:
    """Compile one rendered kernel in this process (which must never have interpreted a kernel)."""
    try:
        compiled = compile_kernel(job)
    except Exception as exc:  # the compiler's verdict is the result
        return CompileReport(job.capability, None, f"{type(exc).__name__}: {exc}")
    mma = tuple(sorted(set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*", compiled.asm["ptx"]))))
    registers, local = _resource_usage(compiled.asm["cubin"])
    clobbers = None
    if job.capability >= (9, 0) and (code := sass.cubin_tool("nvdisasm", "-c", compiled.asm["cubin"])):
        clobbers = tuple(sass.operand_clobbers(code))
    return CompileReport(
        job.capability,
        int(compiled.metadata.shared),
        mma=mma,
        registers=registers,
        local_bytes=local,
        clobbers=clobbers,
    )


def ready_to_fork() -> str | None:
    """Do once here what each process forked from this one would otherwise do before its first
    kernel (2 x H200 host, 2026-11-26): hash Triton's own files into the key of every cache
    lookup (0.6 s), and make Triton's CUDA driver, whose utility module a C compiler builds into
    an empty cache (0.3 s). The driver is made directly: Triton's own choice of a driver asks
    CUDA whether it has devices, after which no forked process could use CUDA. Where the driver
    cannot be made (no CUDA library), the forks make theirs as before; returns why."""
    import triton.backends
    from triton.runtime.cache import triton_key

    # Mostly file reads and hashing, which release the GIL, beside the C compiler's build.
    hashing = threading.Thread(target=triton_key, name="tunegen-triton-key")
    hashing.start()
    try:
        triton.runtime.driver.set_active(triton.backends.backends["nvidia"].driver())
    except Exception as exc:  # the forks make theirs, asking CUDA: slower, never wrong
        return f"{type(exc).__name__}: {exc}"
    finally:
        hashing.join()
    return None


def warm_compiler(capability: tuple[int, int]) -> None:
    """Compile a tiny kernel for `capability` in this process, past Triton's cache (rewriting one
    fixed entry of it), so that the processes forked from it after start with the compiler
    loaded (LLVM, the NVIDIA backend, ptxas's version): on an H200 host (2026-11-26) a forked
    worker's first compile of a Hopper Variant took 4.3 s cold, 3.4 s after this. Needs no GPU."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def iota(out, n: tl.constexpr):
        tl.store(out + tl.arange(0, n), tl.arange(0, n))

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    with environment("TRITON_ALWAYS_COMPILE", "1"):  # a cached copy would load no compiler
        triton.compile(ASTSource(iota, {"out": "*i32"}, constexprs={"n": 16}), target=target)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers per thread at launch and local-memory bytes (spills, stack) of a cubin, from
    cuobjdump."""
    text = sass.cubin_tool("cuobjdump", "-res-usage", cubin)
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text or ""))
    if "REG" not in usage:
        return None, None
    return int(usage["REG"]), int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))


def compile_many(jobs: Sequence[CompileJob], workers: int | None = None) -> list[CompileReport]:
    """Compile `jobs` across fresh processes (Triton not in interpreter mode there), in order."""
    if not jobs:
        return []
    context = multiprocessing.get_context("spawn")
    with interpreting(False), concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(compile_for, jobs))
