"""Build the package's shipped winners for a GPU from measured search results.

Each Problem's shipped Winner is the fastest Variant of a grid measured on that GPU, with the
time, error and peer measured in that run and the template hash of the commit it was measured
at. Two kinds of grid: `benchmarks/search_quality.py` output (exhaustive, one Problem per row)
and `benchmarks/prefill_defaults.py` output (hand-picked Variants of both schedules over the
suite's lengths, beside SDPA's backends). Only Variants that beat the family's default in the
same measurements (by 2% for the latter) are worth shipping; the others are left to the
defaults. Where several files measured one Problem, the last one given decides.

    python benchmarks/ship_winners.py benchmarks/results/prefill_ws_h100_sweep2.json \\
        benchmarks/results/prefill_ws_h100_sweep3.json --commit 1234abc -o tuning_db/shipped/h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import subprocess
from pathlib import Path

from tunegen.kernels import families
from tunegen.kernels.gpu import Gpu
from tunegen.kernels.problem import Problem
from tunegen.measure.suites import Shape
from tunegen.tuning_db.exchange import FORMAT, VERSION, parse_document

H100 = {
    "name": "NVIDIA H100 80GB HBM3",
    "capability": "9.0",
    "sm_count": 132,
    "smem_per_block": 232448,
    "backend": "cuda",
    "driver": "580.159.04",
}


def template_hash_at(commit: str, template: str) -> str:
    """tunegen.kernels.render.template_hash as it was at `commit` (the shared macros, then the template)."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", commit, "templates/"], capture_output=True, text=True, check=True
    ).stdout.split()
    shared = sorted(n for n in names if Path(n).name.startswith("_") and n.endswith(".j2"))
    digest = hashlib.sha256()
    for path in [*shared, f"templates/{template}"]:
        digest.update(Path(path).name.encode())
        digest.update(
            subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, check=True).stdout
        )
    return digest.hexdigest()[:16]


def _record(
    problem: dict, variant: dict, ms: float, tflops: float, err: float, peer: tuple, data: dict
) -> dict:
    return {
        "family": problem["family"],
        "problem": problem,
        "variant": variant,
        "median_ms": ms,
        "tflops": tflops,
        "gbps": None,
        "rel_err": err,
        "peer": {"name": peer[0], "ms": peer[1]},
        "triton_version": data["triton"],
        "torch_version": data["torch"],
        "cuda_version": "13.0",
        "created_at": datetime.datetime.fromisoformat(data["measured_at"]).isoformat(),
    }


def search_quality_winners(data: dict) -> list[dict]:
    """Each row's grid-best, from `search_quality.py` output."""
    winners = []
    fields = {f.name for f in dataclasses.fields(Problem)}
    for row in data["rows"]:
        grid = row["grid"]
        chosen = json.dumps(grid["variant"], sort_keys=True, separators=(",", ":"))
        trial = next(t for t in grid["trials"] if t.get("evaluated") and t["variant"] == chosen)
        problem = Problem(**{k: v for k, v in row.items() if k in fields}).as_dict()
        peer = (grid["peer"], grid["peer_ms"])
        winners.append(
            _record(problem, grid["variant"], grid["ms"], grid["tflops"], trial["rel_err"], peer, data)
        )
    return winners


MARGIN = 0.98  # a Winner must take at most 98% of the default's time: closer is run-to-run noise


def defaults_run_winners(data: dict, gpu: Gpu) -> dict[str, dict | None]:
    """Per suite Problem of a `prefill_defaults.py` or `backward_defaults.py` run (its "family"):
    its fastest verified Variant where that beat the family's default measured in the same run by
    more than the noise, else None (the default stands, whatever an earlier run said)."""
    family = families.get(data.get("family", "prefill"))
    by_shape: dict[str, list[dict]] = {}
    for row in data["results"]:
        by_shape.setdefault(json.dumps(row["shape"], sort_keys=True), []).append(row)
    winners: dict[str, dict | None] = {}
    for rows in by_shape.values():
        problem = dataclasses.replace(Shape(**rows[0]["shape"]).problem("bfloat16"), family=family.name)
        timed = [r for r in rows if "variant" in r and r.get("ms")]
        peers = [(r["impl"], r["ms"]) for r in rows if "impl" in r and r.get("ms")]
        default = family.default_variant(problem, gpu)
        default_ms = [r["ms"] for r in timed if family.variant_type(**r["variant"]) == default]
        if not timed or not peers or not default_ms:
            continue
        best = min(timed, key=lambda r: r["ms"])
        key = json.dumps(problem.as_dict(), sort_keys=True)
        winners[key] = None
        if best["ms"] < MARGIN * default_ms[0]:
            variant = family.variant_type(**best["variant"]).as_dict()
            peer = min(peers, key=lambda p: p[1])
            winners[key] = _record(
                problem.as_dict(), variant, best["ms"], best["tflops"], best["err"], peer, data
            )
    return winners


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--commit", required=True, help="the commit the grids were measured at")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    gpu = Gpu(H100["name"], (9, 0), H100["sm_count"], H100["smem_per_block"], "3.6.0", "", "cuda")
    winners: dict[str, dict] = {}
    sources = []
    for path in args.results:
        data = json.loads(path.read_text())
        template = template_hash_at(args.commit, families.get(data.get("family", "prefill")).template)
        if "rows" in data:
            found = {json.dumps(w["problem"], sort_keys=True): w for w in search_quality_winners(data)}
        else:
            found = defaults_run_winners(data, gpu)
        for key, winner in found.items():
            if winner is None:
                winners.pop(key, None)
            else:
                winners[key] = {**winner, "template_hash": template}
        sources.append(
            f"{path.name} (Triton {data['triton']}, torch {data['torch']}, {data['measured_at'][:10]})"
        )
    document = {
        "format": FORMAT,
        "version": VERSION,
        "gpu": H100,
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "provenance": (
            f"grid-best Variants on one H100 80GB HBM3 from {'; '.join(sources)}, at commit "
            f"{args.commit}; built by benchmarks/ship_winners.py"
        ),
        "winners": [winners[key] for key in sorted(winners)],
    }
    parse_document(document)  # refuse to write what the package could not load
    args.output.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(winners)} winners to {args.output}")


if __name__ == "__main__":
    main()
