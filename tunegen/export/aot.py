"""`tunegen export --format aot`: Winners compiled ahead of time by Triton's AOT compiler
(triton.tools.compile) into cubins with C launchers, for C/C++ serving stacks.

Each kernel is compiled twice, for arguments whose pointers and strides are multiples of 16 and
for any arguments; triton.tools.link joins the two behind one entry point, `<name>_default`,
which takes the first whose conditions the call meets. A manifest lists each kernel's Problem,
GPU, Variant, files, entry point and arguments. No GPU is needed: the compiler asks the active
driver only for the target and each argument's C type, and a stand-in answers both.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import multiprocessing
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegen.export.folders import staged
from tunegen.export.provenance import provenance
from tunegen.export.selection import Selected, Selection, Skipped
from tunegen.kernels.compiler import TRITON_DTYPES
from tunegen.kernels.releases import COMPILE_OPTIONS
from tunegen.kernels.render import interpreting

FORMAT = "tunegen-aot"
VERSION = 1
# The launch grid of each family's kernel, as C over its arguments (the `launch` functions of the
# templates compute the same); families that launch several kernels are not compiled.
GRIDS = {"prefill": ("n_m_blocks * n_bh", "1", "1")}
# What a caller passes for each argument of the prefill kernel (templates/attention_fwd.py.j2).
ARGUMENTS = {
    "prefill": {
        "Q, K, V": "device pointers: (batch, heads, seqlen, head_dim) tensors, or packed (total, heads, "
        "head_dim) for varlen Problems, in the Problem's dtype; K and V have heads_kv heads",
        "O": "device pointer to the output, shaped like Q",
        "LSE": "device pointer to the float32 natural-log log-sum-exp (batch, heads_q, seqlen_q), or "
        "(heads_q, total_q) for varlen; 0 when the Problem has return_lse false (it is never read)",
        "qk_scale": "the softmax scale times log2(e) = 1.4426950408889634 (the kernel works in base 2)",
        "stride_{q,k,v,o}{b,h,n}": "element strides of batch, head and token (0 for the batch of varlen)",
        "stride_lb, stride_lh": "element strides of LSE's batch and head (0 without LSE)",
        "n_heads": "query heads",
        "n_bh": "batch * query heads",
        "n_m_blocks": "ceil(seqlen_q / variant.block_m); varlen: ceil(max_seqlen_q / variant.block_m)",
        "seqlen_q, seqlen_k": "query and key lengths (not varlen)",
        "cu_seqlens_q, cu_seqlens_k": "device pointers to int32 batch + 1 offsets (varlen)",
    }
}


@dataclasses.dataclass(frozen=True)
class AotJob:
    name: str
    source: str
    dtype: str
    capability: tuple[int, int]
    folder: str
    grid: tuple[str, str, str]


@dataclasses.dataclass(frozen=True)
class AotResult:
    """The files one compile produced (relative to its folder), or the compiler's error."""

    name: str
    args: list[dict[str, str]] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)
    cubins: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    num_warps: int = 0
    num_stages: int = 0
    error: str | None = None


class OfflineDriver:
    """What triton.tools.compile asks the active driver: the target, and each argument's C type.
    An fp32 scalar is declared float: Triton 3.4 to 3.7 declare it double while the cubin reads
    4 bytes (the kernel would see the low half of the double)."""

    def __init__(self, capability: tuple[int, int]) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    def get_current_target(self) -> Any:
        return self.target

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return "float" if ty == "fp32" else ty_to_cpp(ty)


@contextlib.contextmanager
def _keeping_compiled(kept: list) -> Iterator[None]:
    """Keep what triton.compile returns inside the block (triton.tools.compile writes only C),
    compiled with the options every launch pins (releases.COMPILE_OPTIONS)."""
    import triton

    compile_ = triton.compile

    def keep(src: Any, target: Any = None, options: dict | None = None, **kwargs: Any) -> Any:
        kept.append(compile_(src, target=target, options={**(options or {}), **COMPILE_OPTIONS}, **kwargs))
        return kept[-1]

    triton.compile = keep
    try:
        with warnings.catch_warnings():
            # Triton 3.9 says its fusion default will change; the options above pin it.
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            yield
    finally:
        triton.compile = compile_


def _types(module: Any, dtype: str) -> list[tuple[str, str]]:
    """The kernel's arguments with their Triton types. Arguments the rendering left unused (a
    constexpr None) become untyped pointers the caller passes 0 for: the linker's dispatcher
    numbers arguments as the C launcher does, which a constexpr in between would break."""
    types, constexprs = module.signature(dtype)
    kernel = module.KERNEL
    function = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]
    used = {n.id for statement in function.body for n in ast.walk(statement) if isinstance(n, ast.Name)}
    out = []
    for name in kernel.arg_names:
        if name in constexprs:
            if constexprs[name] is not None or name in used:
                raise ValueError(f"{name}: the AOT export takes kernels whose constexpr arguments are unused")
            out.append((name, "*i8"))
        else:
            out.append((name, types[name]))
    return out


def compile_aot(job: AotJob) -> AotResult:
    """Compile and link one kernel into `job.folder` (in a process that never interpreted a kernel)."""
    import triton
    from triton.tools.compile import CompileArgs, compile_kernel

    folder = Path(job.folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{job.name}.py"
    path.write_text(job.source)
    try:
        spec = importlib.util.spec_from_file_location(job.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        types = _types(module, job.dtype)
        driver = OfflineDriver(job.capability)
        triton.runtime.driver.set_active(driver)
        sources, cubins, headers = [], [], []
        for aligned in (True, False):
            signature = [
                f"{ty}:16" if aligned and (ty.startswith("*") or name.startswith("stride_")) else ty
                for name, ty in types
            ]
            kept: list = []
            with _keeping_compiled(kept):
                function, files = compile_kernel(
                    CompileArgs(
                        path=str(path),
                        kernel_name=module.KERNEL.fn.__name__,
                        signature=", ".join(signature),
                        grid=",".join(job.grid),
                        num_warps=module.NUM_WARPS,
                        num_stages=module.NUM_STAGES,
                        out_name=job.name,
                        out_path=folder / job.name,
                    )
                )
            binary = kept[-1].asm["cubin"]
            (folder / f"{function}.cubin").write_bytes(binary)
            cubins.append(
                {
                    "file": f"{function}.cubin",
                    "bytes": len(binary),
                    "function": function,
                    "aligned": aligned,
                    "shared_bytes": int(kept[-1].metadata.shared),
                }
            )
            sources += [f.name for f in files if f.suffix == ".c"]
            headers += [str(f) for f in files if f.suffix == ".h"]
        subprocess.run(
            [sys.executable, "-m", "triton.tools.link", *headers, "-o", str(folder / job.name)],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        return AotResult(job.name, error=f"triton.tools.link failed: {exc.stderr.strip()}")
    except Exception as exc:  # the compiler's verdict is the result
        return AotResult(job.name, error=f"{type(exc).__name__}: {exc}")
    args = [{"name": n, "type": t, "c_type": driver.map_python_to_cpp_type(t)} for n, t in types]
    return AotResult(job.name, args, [f"{job.name}.c", *sources], cubins, module.NUM_WARPS, module.NUM_STAGES)


def kernel_name(selected: Selected) -> str:
    """The C name of a Winner's kernel: family, target, dtype and source hash."""
    major, minor = selected.gpu.capability
    dtype = TRITON_DTYPES[selected.problem.dtype]
    return f"tunegen_{selected.winner.family}_sm{major}{minor}_{dtype}_{selected.rendered.digest[:12]}"


def write_aot(
    selection: Selection, output: Path, workers: int | None = None, *, replace: bool = False
) -> tuple[Path, Selection]:
    """Compile the selected Winners into `output` (an earlier export there only with `replace`)
    with a manifest.json (kernels, and a table from Problem to kernel); returns the manifest and
    the Winners compiled (the others moved to skipped, with the reason)."""
    skipped = list(selection.skipped)
    jobs: dict[str, AotJob] = {}
    wanted: list[Selected] = []
    for s in selection.selected:
        if s.winner.family not in GRIDS:
            skipped.append(
                Skipped(s.winner, f"the AOT export compiles single-kernel families: {sorted(GRIDS)}")
            )
        elif s.gpu.backend != "cuda":
            skipped.append(Skipped(s.winner, f"tuned on {s.gpu.backend}, which is no GPU target"))
        elif getattr(s.variant, "schedule", "fa2") == "ws":
            skipped.append(
                Skipped(
                    s.winner,
                    "schedule 'ws' is a Gluon kernel taking host-side TMA descriptors, which Triton's AOT "
                    "compiler and its C launcher do not take (the python export carries it)",
                )
            )
        else:
            name = kernel_name(s)
            jobs[name] = AotJob(
                name,
                s.rendered.source,
                TRITON_DTYPES[s.problem.dtype],
                s.gpu.capability,
                name,
                GRIDS[s.winner.family],
            )
            wanted.append(s)
    if not jobs:
        raise ValueError(
            "no winners to compile ahead of time: " + "; ".join(sorted({k.reason for k in skipped}))
        )
    with staged(output, replace=replace, whole_folder=True) as root:
        context = multiprocessing.get_context("spawn")
        with interpreting(False), concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            staged_jobs = [dataclasses.replace(job, folder=str(root / job.folder)) for job in jobs.values()]
            results = {r.name: r for r in pool.map(compile_aot, staged_jobs)}
        for result in results.values():
            if result.error is not None:
                shutil.rmtree(root / result.name, ignore_errors=True)
        compiled = [s for s in wanted if results[kernel_name(s)].error is None]
        skipped += [
            Skipped(s.winner, f"Triton's AOT compiler: {results[kernel_name(s)].error}")
            for s in wanted
            if results[kernel_name(s)].error is not None
        ]
        if not compiled:
            raise ValueError(
                "no winner compiled ahead of time: " + "; ".join(sorted({k.reason for k in skipped}))
            )
        info = provenance("aot", [s.winner for s in compiled], sorted({s.template for s in compiled}))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "provenance": info,
            "arguments": {f: ARGUMENTS[f] for f in sorted({s.winner.family for s in compiled})},
            "kernels": {kernel_name(s): _kernel_entry(s, results[kernel_name(s)]) for s in compiled},
            "table": [_table_entry(s) for s in compiled],
            "skipped": [
                {"family": k.winner.family, "problem": k.winner.problem, "reason": k.reason} for k in skipped
            ],
        }
        (root / "provenance.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return output / "manifest.json", Selection(compiled, skipped)


def _kernel_entry(s: Selected, result: AotResult) -> dict[str, Any]:
    """A compiled kernel in the manifest: its files, entry points, arguments and launch shape."""
    folder = result.name
    return {
        "family": s.winner.family,
        "target": f"cuda:{s.gpu.capability[0] * 10 + s.gpu.capability[1]}:32",
        "variant": s.variant.as_dict(),
        "triton_source": f"{folder}/{result.name}.py",
        "header": f"{folder}/{result.name}.h",
        "sources": [f"{folder}/{name}" for name in result.sources],
        "cubins": [{**c, "file": f"{folder}/{c['file']}"} for c in result.cubins],
        "entry": f"{result.name}_default",
        "load": f"load_{result.name}",
        "unload": f"unload_{result.name}",
        "args": result.args,
        "grid": list(GRIDS[s.winner.family]),
        "num_warps": result.num_warps,
        "num_stages": result.num_stages,
    }


def _table_entry(s: Selected) -> dict[str, Any]:
    """A row of the manifest's table: the GPU and Problem a kernel was tuned for, and the Winner."""
    w = s.winner
    return {
        "gpu": {"name": w.gpu.name, "capability": w.gpu.capability},
        "problem": w.problem,
        "kernel": kernel_name(s),
        "median_ms": w.median_ms,
        "tflops": w.tflops,
        "rel_err": w.rel_err,
        "triton_version": w.triton_version,
        "torch_version": w.torch_version,
        "tuned_template_hash": w.template_hash,
        "created_at": w.created_at.isoformat(timespec="seconds"),
    }
