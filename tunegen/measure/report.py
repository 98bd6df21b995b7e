"""The benchmark report: an HTML page with PNG plots, made from `tunegen bench` result files.

It shows speed against sequence length per implementation, a roofline that places each measured
kernel under the GPU's measured matmul and copy ceilings (with standard attention, which writes
and reads the N x N scores in GPU memory, as the memory wall tiled attention removes), and tuned
against default Variants where the results hold both.
"""

from __future__ import annotations

import csv
import dataclasses
import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tunegen.kernels.masks import attended_pairs

# What each of bench fp8's prefill implementations computes in, for the plots' legends.
FP8_PREFILL = {
    "tunegen-fp8": "e4m3 inputs, bf16 output",
    "tunegen-fp8-hadamard": "bf16 inputs rotated and quantized to e4m3, bf16 output",
    "quantize-fp8": "bf16 to e4m3",
}
ELEMENT_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp8": 1}
# Reads and writes of (B, H, N, D) tensors per family, as multiples of q's and k's sizes:
# forward reads Q, K, V and writes O; backward also reads O and dO and writes dQ, dK, dV.
TRAFFIC = {"prefill": (2, 2), "decode": (2, 2), "backward": (4, 4)}
BACKWARD_FLOPS = 2.5


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """A GPU's measured limits: dense matmul FLOP/s per input dtype and device copy bandwidth."""

    gpu: str
    matmul_tflops: dict[str, float]
    copy_tbps: float
    source: str

    @classmethod
    def load(cls, path: Path) -> Ceilings:
        data = json.loads(Path(path).read_text())
        try:
            return cls(
                gpu=str(data["gpu"]),
                matmul_tflops={str(k): float(v) for k, v in data["matmul_tflops"].items()},
                copy_tbps=float(data["copy_tbps"]),
                source=str(data.get("source", path)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"ceilings: {path} must hold gpu, matmul_tflops {{dtype: TFLOP/s}} and copy_tbps ({exc!r})"
            ) from None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One bench row, whichever family wrote it, with the FLOPs and minimum bytes it implies."""

    family: str
    impl: str
    dtype: str
    head_dim: int
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    ms: float | None
    unit: str
    rate: float | None
    note: str
    gpu: str
    triton: str
    torch: str
    date: str
    source: str = ""
    # A window's sides and chunk (tunegen.kernels.masks), where the row has them.
    local: tuple[int, int, int] = (-1, -1, 0)

    @property
    def seqlen(self) -> int:
        """The length a speed plot runs along: the KV length (the query length for prefill)."""
        return self.seqlen_k if self.family == "decode" else self.seqlen_q

    @property
    def flops(self) -> float:
        """FlashAttention's count: 4·B·H·Nq·Nk·D forward, halved for causal, 2.5x for backward;
        under a window or chunk, 4·B·H·D per (row, key) pair attended, as the bench counts."""
        flops = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        flops /= 2 if self.causal and self.family != "decode" else 1
        if self.local != (-1, -1, 0):
            sides = dict(zip(("left", "right", "chunk"), self.local, strict=True))
            pairs = attended_pairs(self.seqlen_q, self.seqlen_k, causal=self.causal, **sides)
            flops = 4.0 * self.batch * self.heads_q * self.head_dim * pairs
        return flops * (BACKWARD_FLOPS if self.family == "backward" else 1)

    @property
    def bytes(self) -> float:
        """The least memory traffic: each input read once, each output written once."""
        per_q, per_k = TRAFFIC.get(self.family, TRAFFIC["prefill"])
        elements = (
            self.batch
            * self.head_dim
            * (per_q * self.heads_q * self.seqlen_q + per_k * self.heads_kv * self.seqlen_k)
        )
        return elements * ELEMENT_BYTES.get(self.dtype, 2)

    @property
    def tflops(self) -> float | None:
        return self.flops / (self.ms * 1e9) if self.ms else None


def _number(value: Any) -> float | None:
    return None if value in (None, "", "None") else float(value)


def _flag(value: Any) -> bool:
    return value in (True, "True", "true", "1", 1)


def measurement(row: dict[str, Any], source: str = "") -> Measurement:
    """Read one row as `tunegen bench` writes it (prefill rows or family-case rows)."""
    try:
        if "tflops" in row:  # bench prefill
            family, unit, rate = "prefill", "TFLOP/s", _number(row["tflops"])
            heads_q, heads_kv = int(row["heads"]), int(row["kv_heads"])
            seqlen_q = seqlen_k = int(row["seqlen"])
        else:
            family, unit, rate = str(row["family"]), str(row["unit"]), _number(row["rate"])
            heads_q, heads_kv = int(row["num_heads_q"]), int(row["num_heads_kv"])
            seqlen_q, seqlen_k = int(row["seqlen_q"]), int(row["seqlen_k"])
        impl, dtype = str(row["impl"]), str(row["dtype"])
        if _flag(row.get("fp8")) and family == "decode" and impl == "tunegen":  # bench fp8: both caches
            impl, dtype = f"{impl} (e4m3 KV cache)", "fp8"
        elif _flag(row.get("fp8")) and family == "decode":  # peers read the e4m3 cache's 16-bit copy
            impl = f"{impl} (16-bit copy of the e4m3 KV cache)"
        elif dtype == "fp8" and impl in FP8_PREFILL:
            impl = f"{impl} ({FP8_PREFILL[impl]})"
        return Measurement(
            family=family,
            impl=impl,
            dtype=dtype,
            head_dim=int(row["head_dim"]),
            causal=_flag(row["causal"]),
            batch=int(row["batch"]),
            heads_q=heads_q,
            heads_kv=heads_kv,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            ms=_number(row["ms"]),
            unit=unit,
            rate=rate,
            note=str(row.get("note") or ""),
            gpu=str(row["gpu"]),
            triton=str(row["triton"]),
            torch=str(row["torch"]),
            date=str(row["date"]),
            source=source,
            local=tuple(
                int(d if _number(row.get(k)) is None else _number(row.get(k)))
                for k, d in (("window_left", -1), ("window_right", -1), ("attention_chunk", 0))
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"results: a row is not one `tunegen bench` writes ({exc!r}): {row}") from None


def load_results(paths: Iterable[Path]) -> list[Measurement]:
    """Every row of the given .csv and .json bench files."""
    rows: list[Measurement] = []
    for path in paths:
        path = Path(path)
        if path.suffix == ".json":
            records = json.loads(path.read_text())
            if isinstance(records, dict):  # bench fp8: {"prefill": rows, "decode": rows, "speedups": ...}
                records = [
                    r for part in records.values() if isinstance(part, list) for r in part if "impl" in r
                ]
        elif path.suffix == ".csv":
            with path.open(newline="") as handle:
                records = list(csv.DictReader(handle))
        else:
            raise ValueError(f"results: expected .csv or .json files from `tunegen bench`, got {path}")
        rows.extend(measurement(r, path.stem) for r in records)
    if not rows:
        raise ValueError("results: the files hold no rows")
    return rows


def _groups(rows: Sequence[Measurement]) -> dict[tuple, list[Measurement]]:
    """Rows by what one speed plot compares: the file, family, head dim, causal, head counts
    (dtypes share a plot, so FP8 runs beside bf16)."""
    groups: dict[tuple, list[Measurement]] = {}
    for r in rows:
        key = (r.source, r.family, r.head_dim, r.causal, r.heads_q, r.heads_kv)
        groups.setdefault(key, []).append(r)
    return groups


def _title(key: tuple, rows: Sequence[Measurement]) -> str:
    _, family, head_dim, causal, heads_q, heads_kv = key
    heads = f"{heads_q} heads" if heads_q == heads_kv else f"{heads_q}/{heads_kv} heads"
    dtypes = "/".join(dict.fromkeys(r.dtype for r in rows))
    return f"{family} {dtypes}, head dim {head_dim}, {'causal' if causal else 'non-causal'}, {heads}"


def _slug(key: tuple) -> str:
    source, family, head_dim, causal, heads_q, heads_kv = key
    return f"{source}_{family}_d{head_dim}_{'causal' if causal else 'full'}_h{heads_q}-{heads_kv}"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("tunegen report needs matplotlib: pip install 'tunegen[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speed(key: tuple, rows: Sequence[Measurement], path: Path) -> None:
    """Speed against sequence length, one line per implementation."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for impl in dict.fromkeys(r.impl for r in rows):
        points = sorted((r.seqlen, r.rate) for r in rows if r.impl == impl and r.rate)
        if points:
            ax.plot(
                *zip(*points, strict=True), marker="o", label=impl, linewidth=2 if "tunegen" in impl else 1
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache length" if key[0] == "decode" else "sequence length")
    ax.set_ylabel(rows[0].unit)
    ax.set_title(_title(key, rows), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def memory_wall(head_dim: int, dtype: str) -> float:
    """Arithmetic intensity (FLOP/byte) of standard attention at long N: 4·N²·D FLOPs against
    writing and reading the scores S and the probabilities P, 4·N² elements."""
    return head_dim / ELEMENT_BYTES.get(dtype, 2)


def plot_roofline(rows: Sequence[Measurement], ceilings: Ceilings, path: Path) -> None:
    """Attained TFLOP/s against arithmetic intensity, under the measured ceilings."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    timed = [r for r in rows if r.tflops]
    intensities = [r.flops / r.bytes for r in timed] + [
        memory_wall(d, t) for d, t in {(r.head_dim, r.dtype) for r in rows}
    ]
    lo, hi = min(intensities) / 4, max(intensities) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for name, peak in sorted(ceilings.matmul_tflops.items()):
        ax.plot(
            xs, [min(peak, x * ceilings.copy_tbps) for x in xs], label=f"ceiling: {name} matmul {peak:.0f}"
        )
    for impl in dict.fromkeys(r.impl for r in timed):
        mine = [r for r in timed if r.impl == impl]
        ax.scatter(
            [r.flops / r.bytes for r in mine],
            [r.tflops for r in mine],
            s=24 if impl.startswith("tunegen") else 10,
            label=impl,
            zorder=3,
        )
    for d, t in sorted({(r.head_dim, r.dtype) for r in rows}):
        x = memory_wall(d, t)
        ax.scatter([x], [x * ceilings.copy_tbps], marker="X", s=70, color="black", zorder=4)
        ax.annotate(f"standard attention, N x N in memory (D={d})", (x, x * ceilings.copy_tbps), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of least memory traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline on {ceilings.gpu} (copy {ceilings.copy_tbps:.2f} TB/s)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tuned_pairs(rows: Sequence[Measurement]) -> list[tuple[Measurement, Measurement]]:
    """(tuned, default) pairs: rows of impl `tunegen` and `tunegen-default` on the same shape."""
    defaults = {_shape(r): r for r in rows if r.impl == "tunegen-default" and r.rate}
    return [
        (r, defaults[_shape(r)]) for r in rows if r.impl == "tunegen" and r.rate and _shape(r) in defaults
    ]


def _shape(r: Measurement) -> tuple:
    return (r.family, r.dtype, r.head_dim, r.causal, r.batch, r.heads_q, r.heads_kv, r.seqlen_q, r.seqlen_k)


def plot_tuned(pairs: Sequence[tuple[Measurement, Measurement]], path: Path) -> None:
    """Tuned speed over default speed per shape."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(pairs) + 1.5), dpi=110)
    labels = [f"{t.family} D{t.head_dim} {'c' if t.causal else 'f'} N{t.seqlen}" for t, _ in pairs]
    ax.barh(labels, [t.rate / d.rate for t, d in pairs], color="tab:red")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("tuned / default speed")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _table(key: tuple, rows: Sequence[Measurement]) -> str:
    impls = list(dict.fromkeys(r.impl for r in rows))
    shapes = sorted({(r.batch, r.seqlen_q, r.seqlen_k) for r in rows}, key=lambda s: (s[2], s[1], s[0]))
    cells = {(r.batch, r.seqlen_q, r.seqlen_k, r.impl): r for r in rows}
    head = "".join(f"<th>{html.escape(i)}</th>" for i in impls)
    body = []
    for b, nq, nk in shapes:
        found = [cells.get((b, nq, nk, i)) for i in impls]
        best = max((r.rate for r in found if r and r.rate), default=None)
        tds = []
        for r in found:
            if r is None:
                tds.append("<td></td>")
            elif r.rate:
                mark = ' class="best"' if r.rate == best else ""
                tds.append(f"<td{mark}>{r.rate:.0f}</td>")
            else:
                tds.append(f'<td class="note" title="{html.escape(r.note)}">-</td>')
        body.append(f"<tr><td>{b}</td><td>{nq}</td><td>{nk}</td>{''.join(tds)}</tr>")
    return (
        f"<table><caption>{html.escape(_title(key, rows))}, {html.escape(rows[0].unit)}</caption>"
        f"<tr><th>batch</th><th>Nq</th><th>Nk</th>{head}</tr>{''.join(body)}</table>"
    )


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
caption{text-align:left;font-weight:bold}.best{background:#e6f4e6;font-weight:bold}.note{color:#999}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}"""


def write_report(results: Sequence[Path], out_dir: Path, ceilings: Ceilings | None = None) -> Path:
    """Write index.html and its PNG plots into `out_dir`; returns the page's path."""
    rows = load_results(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    provenance = sorted({(r.gpu, r.triton, r.torch, r.date) for r in rows})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>tunegen benchmark report</title>",
        f"<style>{STYLE}</style></head><body><h1>tunegen benchmark report</h1>",
        "<p>Measured on: "
        + "; ".join(html.escape(f"{g}, Triton {t}, torch {p}, {d}") for g, t, p, d in provenance)
        + f". From {', '.join(html.escape(Path(p).name) for p in results)}.</p>",
        "<p>Each implementation's output was checked against float64 before it was timed; a dash is a"
        " shape it refused or got wrong (hover for why).</p>",
    ]
    parts.append("<h2>Speed against sequence length</h2>")
    for key, group in _groups(rows).items():
        name = f"speed_{_slug(key)}.png"
        plot_speed(key, group, out_dir / name)
        parts.append(f'<img src="{name}" alt="{html.escape(_title(key, group))}">{_table(key, group)}')
    parts.append("<h2>Roofline</h2>")
    if ceilings is None:
        parts.append("<p>No ceilings given (tunegen report --ceilings FILE from tunegen bench ceilings).</p>")
    else:
        plot_roofline(rows, ceilings, out_dir / "roofline.png")
        peaks = ", ".join(f"{k} matmul {v:.0f} TFLOP/s" for k, v in sorted(ceilings.matmul_tflops.items()))
        parts.append(
            f'<img src="roofline.png" alt="roofline"><p>Ceilings on {html.escape(ceilings.gpu)}: '
            f"{html.escape(peaks)}, copy {ceilings.copy_tbps:.2f} TB/s (read + write), from "
            f"{html.escape(ceilings.source)}. Crosses mark standard attention, which writes and reads"
            " the N x N scores and probabilities in memory: at D / (bytes per element) FLOP per byte it is"
            " bound by bandwidth whatever the GPU's FLOP/s. Tiled attention keeps them on chip.</p>"
        )
    parts.append("<h2>Tuned against default Variants</h2>")
    pairs = tuned_pairs(rows)
    if pairs:
        plot_tuned(pairs, out_dir / "tuned.png")
        parts.append('<img src="tuned.png" alt="tuned against default">')
    else:
        parts.append(
            "<p>These results hold no default rows:"
            " run tunegen bench with --impl tunegen,tunegen-default.</p>"
        )
    parts.append("</body></html>")
    page = out_dir / "index.html"
    page.write_text("\n".join(parts))
    return page
