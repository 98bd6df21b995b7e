"""Show that a C program built against `tunegen export --format aot` launches a tuned kernel and
gets the right numbers: export one prefill Winner for this GPU ahead of time, write random
inputs and their float64 reference, build demo.c against the export with the CUDA driver API,
run it (aligned and offset buffers, which take the two compiled specializations) and compare.

    python tests/export/aot_demo/run.py --work /tmp/aot_demo            # on a GPU machine
    python tests/export/aot_demo/run.py --work /tmp/aot_demo --db URL   # with the Winners of URL
    python tests/export/aot_demo/run.py --work /tmp/aot_demo --offline  # no GPU: sm_90, build only

Without --db, the Winner is this GPU's default Variant for the demo Problem, recorded in a
throwaway database (its time is a placeholder: the point is the launch, not the speed). With
--offline the export targets an H100 and the C files are compiled but not linked or run.
Exits non-zero when an output is off by more than tunegen's tolerance for the dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
# demo.c passes exactly these, in this order (the non-varlen prefill kernel).
EXPECTED_ARGS = [
    "Q", "K", "V", "O", "LSE", "qk_scale",
    "stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_kn",
    "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_on",
    "stride_lb", "stride_lh", "n_heads", "n_bh", "n_m_blocks", "seqlen_q", "seqlen_k",
]  # fmt: skip
DTYPE_MACROS = {"float16": "TUNEGEN_FP16", "bfloat16": "TUNEGEN_BF16", "float32": "TUNEGEN_FP32"}


def demo_winner(url: str, gpu) -> None:
    """Record this GPU's default prefill Variant (pointer loads) for the demo Problem in `url`."""
    from tunegen.kernels.database import gpu_record
    from tunegen.kernels.families import prefill
    from tunegen.kernels.problem import Problem
    from tunegen.kernels.render import template_hash
    from tunegen.tuning_db import Store, WinnerRecord

    problem = Problem("prefill", "float16", 64, True, 8, 2, 2, 512, 512)
    variant = prefill.FAMILY.default_variant(problem, gpu).replace(load="ptr")
    with Store(url) as store:
        store.record_winner(
            WinnerRecord(
                gpu=gpu_record(gpu),
                family="prefill",
                problem=problem.as_dict(),
                variant=variant.as_dict(),
                median_ms=1.0,
                rel_err=0.0,
                triton_version=gpu.triton_version,
                torch_version=gpu.torch_version,
                template_hash=template_hash(prefill.FAMILY.template),
            )
        )


def pick(manifest: dict) -> tuple[dict, dict]:
    """A table row the demo can launch (prefill, not varlen, no log-sum-exp) and its kernel."""
    for row in manifest["table"]:
        problem, kernel = row["problem"], manifest["kernels"][row["kernel"]]
        if not problem["varlen"] and not problem["return_lse"]:
            names = [a["name"] for a in kernel["args"]]
            if names != EXPECTED_ARGS:
                raise SystemExit(f"{row['kernel']}: arguments {names}, demo.c passes {EXPECTED_ARGS}")
            return row, kernel
    raise SystemExit("the export holds no non-varlen prefill kernel without log-sum-exp to demonstrate")


def write_inputs(problem: dict, folder: Path, seed: int = 0) -> tuple[list[int], float]:
    """Random q, k, v of the Problem's features at ragged lengths, and their float64 reference."""
    from tunegen.kernels.problem import TORCH_DTYPES
    from tunegen.kernels.reference import attention_reference

    dtype = TORCH_DTYPES[problem["dtype"]]
    batch, hq, hkv, d = 2, problem["num_heads_q"], problem["num_heads_kv"], problem["head_dim"]
    seqlen_q, seqlen_k = problem["seqlen_q"] * 3 // 4 + 5, problem["seqlen_k"] * 3 // 4 + 11
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, h, n, d, generator=gen).to(dtype)
        for h, n in ((hq, seqlen_q), (hkv, seqlen_k), (hkv, seqlen_k))
    )
    scale = 1.0 / math.sqrt(d)
    ref, _ = attention_reference(q, k, v, causal=problem["causal"], scale=scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        (folder / f"{name}.bin").write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
    (folder / "ref.bin").write_bytes(ref.float().contiguous().numpy().tobytes())
    torch.save({"q": q, "k": k, "v": v, "ref": ref}, folder / "inputs.pt")
    return [batch, hq, hkv, seqlen_q, seqlen_k, d], scale


def build(export: Path, kernel: dict, problem: dict, folder: Path, *, link: bool) -> Path:
    """Compile demo.c with the kernel's C files; link against libcuda (or, offline, stop at objects)."""
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    flags = [
        "-O2",
        "-std=gnu11",
        f"-I{include}",
        f'-DTUNEGEN_HEADER="{export / kernel["header"]}"',
        f"-DTUNEGEN_ENTRY={kernel['entry']}",
        f"-D{DTYPE_MACROS[problem['dtype']]}",
    ]
    sources = [HERE / "demo.c", *(export / s for s in kernel["sources"])]
    compiler = os.environ.get("CC", "cc")
    if not link:
        for source in sources:
            run([compiler, *flags, "-c", str(source), "-o", str(folder / f"{source.stem}.o")])
        return folder
    from triton.backends.nvidia.driver import libcuda_dirs

    found = [Path(d) / "libcuda.so.1" for d in libcuda_dirs() if (Path(d) / "libcuda.so.1").exists()]
    if not found:
        raise SystemExit(f"libcuda.so.1 is not in {libcuda_dirs()} (set TRITON_LIBCUDA_PATH to its folder)")
    libcuda = found[0]
    binary = folder / "demo"
    run([compiler, *flags, *map(str, sources), str(libcuda), "-lm", "-o", str(binary)])
    return binary


def run(command: list[str], **kwargs) -> str:
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, required=True, help="Folder for the export, inputs and binary.")
    parser.add_argument("--db", default=None, help="Use this database's Winners (default: a demo Winner).")
    parser.add_argument("--offline", action="store_true", help="No GPU: export for an H100, build only.")
    args = parser.parse_args()
    from tunegen.kernels.gpu import Gpu, cuda_gpu

    if args.offline:
        gpu = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, triton.__version__, torch.__version__, "cuda")
    else:
        gpu = cuda_gpu(torch.cuda.current_device())
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    url = args.db or f"sqlite:///{args.work / 'demo.db'}"
    if args.db is None:
        demo_winner(url, gpu)
    export = args.work / "aot"
    tunegen_cli = [sys.executable, "-m", "tunegen.cli.main"]
    print(
        run(
            [
                *tunegen_cli,
                "export",
                "--format",
                "aot",
                "--db",
                url,
                "--gpu",
                gpu.name,
                "--family",
                "prefill",
                "-o",
                str(export),
            ]
        ),
        end="",
    )
    manifest = json.loads((export / "manifest.json").read_text())
    row, kernel = pick(manifest)
    problem = row["problem"]
    print(f"kernel {row['kernel']} for {json.dumps(problem)}, variant {json.dumps(kernel['variant'])}")
    sizes, scale = write_inputs(problem, args.work)
    binary = build(export, kernel, problem, args.work, link=not args.offline)
    if args.offline:
        print(f"built objects in {binary} (offline: not linked or run)")
        return
    output = run(
        [str(binary), str(args.work), *map(str, sizes), str(kernel["variant"]["block_m"]), repr(scale)]
    )
    print(output, end="")
    check(args.work, problem, output, url)


def check(folder: Path, problem: dict, output: str, url: str) -> None:
    """Judge the C outputs against float64 and compare them with tunegen.attention on the GPU."""
    from tunegen.kernels.problem import TORCH_DTYPES
    from tunegen.kernels.reference import TOLERANCE

    tolerance = TOLERANCE[problem["dtype"]]
    errors = [
        float(line.split("rel_err ")[1].split()[0]) for line in output.splitlines() if "rel_err" in line
    ]
    inputs = torch.load(folder / "inputs.pt")
    os.environ["TUNEGEN_DB"] = url
    import tunegen

    q, k, v = (inputs[n].cuda() for n in ("q", "k", "v"))
    mine = tunegen.attention(q, k, v, causal=problem["causal"]).cpu()
    source = tunegen.explain(q, k, v, causal=problem["causal"])
    dtype = TORCH_DTYPES[problem["dtype"]]
    for name in ("out_aligned.bin", "out_offset.bin"):
        got = torch.frombuffer(bytearray((folder / name).read_bytes()), dtype=dtype).view(mine.shape)
        print(
            f"{name}: max |C - tunegen.attention| = {float((got.float() - mine.float()).abs().max()):.3g} "
            f"(tunegen served its {source['source']} {json.dumps(source['variant'])})"
        )
    if len(errors) != 2 or max(errors) > tolerance:
        raise SystemExit(f"rel_err {errors} against float64, tolerance {tolerance}: FAILED")
    print(f"PASSED: rel_err {errors} against float64 within {tolerance}")


if __name__ == "__main__":
    main()
