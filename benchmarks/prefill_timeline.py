"""When each tile of the Hopper forward starts and ends, on which SM, and what that says about the
schedule: the share of SM time spent in tiles, how long SMs sit idle at the end, and the fit
tile time = per_tile + per_block * key blocks.

The default Variant's module (from this tree's templates, or `--templates` for a row named
`NAME_old`) is patched so that each consumer writes %globaltimer_lo at its tile's start and after
its O store, its SM and the tile's key blocks into a buffer behind the scheduler's counter (the
dynamic scheduler only). Rows are timed unpatched too: the median of 20 back-to-back launches,
a short burst at full clocks (a long run is held to the board's power limit: power_sustained.py).

    python3 prefill_timeline.py c16k c16k_old --templates old/templates -o timeline.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import torch
from backward_ab import _load, _ms_of, _templates

from tunegen.kernels.families import prefill
from tunegen.kernels.gpu import cuda_gpu
from tunegen.kernels.launch_args import PrefillArgs
from tunegen.kernels.problem import Problem
from tunegen.kernels.render import render

ROWS = {  # name: (head_dim, causal, batch, heads, seqlen), 16k tokens per batch as the suite
    "c16k": (128, True, 1, 16, 16384),
    "c8k": (128, True, 2, 16, 8192),
    "nc16k": (128, False, 1, 16, 16384),
    "nc8k": (128, False, 2, 16, 8192),
    "c16k64": (64, True, 1, 32, 16384),
}
SLOT = 16  # ints per tile in the buffer: 4 per consumer, up to 4 consumers
LANE = "gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))"
ASM = (
    'gl.inline_asm_elementwise("mov.u32 $0, %{}", "=r,r", [dbg_lane], dtype=gl.int32, is_pure=False, pack=1)'
)


def _patched(src: str) -> str:
    """The module with the timeline writes; every anchor must match once (or the template moved)."""
    edits = [
        ("turn_bars, tile_slot, LSE,", "turn_bars, tile_slot, COUNTER, LSE,", None),
        (
            "        n_blocks, n_full = _blocks(start, seqlen_q, seqlen_k)\n        q_tile",
            "        n_blocks, n_full = _blocks(start, seqlen_q, seqlen_k)\n"
            f"        dbg_lane = {LANE}\n        dbg_t0 = {ASM.format('globaltimer_lo;')}\n        q_tile",
            1,
        ),
        (
            "        done += 1\n        mbarrier.wait(q_ready",
            f"        dbg_t1 = {ASM.format('globaltimer_lo;')}\n        dbg_sm = {ASM.format('smid;')}\n"
            f"        dbg_at = COUNTER + 64 + t * {SLOT} + cid * 4 + dbg_lane * 0\n"
            "        gl.store(dbg_at, dbg_t0, mask=dbg_lane == 0)\n"
            "        gl.store(dbg_at + 1, dbg_t1, mask=dbg_lane == 0)\n"
            "        gl.store(dbg_at + 2, dbg_sm, mask=dbg_lane == 0)\n"
            "        gl.store(dbg_at + 3, dbg_lane * 0 + n_blocks, mask=dbg_lane == 0)\n"
            "        done += 1\n        mbarrier.wait(q_ready",
            1,
        ),
        ("    return torch.zeros(1, dtype=torch.int32, device=device)", "    return DEBUG[0].zero_()", 1),
        ("\nKERNEL = attn_fwd", "\nDEBUG = [None]\nKERNEL = attn_fwd", 1),
    ]
    for old, new, count in edits:
        found = src.count(old)
        if found == 0 or (count is not None and found != count):
            raise ValueError(f"anchor {old[:40]!r} found {found} times")
        src = src.replace(old, new)
    return src


def _module(src: str, folder: pathlib.Path, name: str):
    path = folder / f"{name}.py"
    path.write_text(src)
    return _load(path)


def _burst_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    return sorted(_ms_of(fn, reps))[reps // 2]


def _stats(raw: torch.Tensor) -> dict:
    """Consumer 0's records (tiles, 4) as the schedule's figures; the 32-bit timer may wrap once."""
    lo = raw[:, :2] & 0xFFFFFFFF
    rel = ((lo - lo[0, 0] + 2**31) % 2**32 - 2**31).double()
    rel -= rel[:, 0].min()
    t0, t1, sm, blocks = rel[:, 0], rel[:, 1], raw[:, 2], raw[:, 3].double()
    span, dur = float(t1.max()), t1 - t0
    ends = torch.zeros(int(sm.max()) + 1, dtype=torch.float64).scatter_reduce(
        0, sm, t1, "amax", include_self=False
    )
    busy = torch.zeros_like(ends).index_add_(0, sm, dur)
    used = busy > 0
    fit = torch.linalg.lstsq(torch.stack([torch.ones_like(blocks), blocks], 1), dur[:, None]).solution[:, 0]
    return {
        "span_us": span / 1e3,
        "busy_frac": float(busy[used].sum() / (span * int(used.sum()))),
        "tail_mean_us": float((span - ends[used]).mean()) / 1e3,
        "tail_max_us": float((span - ends[used]).max()) / 1e3,
        "per_tile_us": float(fit[0]) / 1e3,
        "per_block_us": float(fit[1]) / 1e3,
        "tiles": int(raw.shape[0]),
    }


def _row(name: str, gpu, templates: str | None, folder: pathlib.Path) -> dict:
    d, causal, b, h, n = ROWS[name.removesuffix("_old")]
    problem = Problem("prefill", "bfloat16", d, causal, h, h, b, n, n)
    variant = prefill.FAMILY.default_variant(problem, gpu)
    features = prefill.FAMILY.features(problem, gpu)
    if name.endswith("_old"):
        with _templates(pathlib.Path(templates)):
            source = render(prefill.FAMILY.template, "prefill", variant, features).source
    else:
        source = render(prefill.FAMILY.template, "prefill", variant, features).source
    plain = _module(source, folder, f"plain_{name}")
    timed = _module(_patched(source), folder, f"timed_{name}")
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launch_args = PrefillArgs(q, k, v, torch.empty_like(q), None, d**-0.5)
    tiles = b * h * -(-n // timed.TILE_M.value)
    timed.DEBUG[0] = torch.zeros(64 + tiles * SLOT, dtype=torch.int32, device="cuda")
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {"name": name, "variant": variant.as_dict()}
    row["tflops_burst"] = flops / _burst_ms(lambda: plain.launch(launch_args)) / 1e9
    timed.launch(launch_args)
    torch.cuda.synchronize()
    row.update(_stats(timed.DEBUG[0][64:].view(tiles, SLOT // 4, 4)[:, 0].cpu().long()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help=f"rows among {sorted(ROWS)}, each optionally NAME_old")
    ap.add_argument("--templates", help="the templates folder NAME_old rows render from")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    gpu, results = cuda_gpu(0), []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            row = _row(name, gpu, args.templates, pathlib.Path(tmp))
            results.append(row)
            print(
                " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()
                    if k != "variant"
                )
            )
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps({"gpu": gpu.name, "results": results}, indent=1))


if __name__ == "__main__":
    main()
