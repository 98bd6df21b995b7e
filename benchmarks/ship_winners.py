"""Build the package's shipped winners for a GPU from measured search results.

Each Problem's shipped Winner is the fastest Variant of an exhaustive grid measured on that GPU
(`benchmarks/search_quality.py` output), with the time, error and peer measured in that run and
the template hash of the commit it was measured at. Only Variants that beat the family's default
in the same measurements are worth shipping; the others are left to the defaults.

    python benchmarks/ship_winners.py benchmarks/results/search_quality_h100_run2.json \
        --commit 07b247a -o tuning_db/shipped/h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import subprocess
from pathlib import Path

from tunegen.problem import Problem
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
    """tunegen.render.template_hash as it was at `commit` (the shared macros, then the template)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--commit", required=True, help="the commit the grid was measured at")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    winners = []
    for row in data["rows"]:
        grid = row["grid"]
        chosen = json.dumps(grid["variant"], sort_keys=True, separators=(",", ":"))
        trial = next(t for t in grid["trials"] if t.get("evaluated") and t["variant"] == chosen)
        fields = {f.name for f in dataclasses.fields(Problem)}
        problem = Problem(**{k: v for k, v in row.items() if k in fields}).as_dict()
        winners.append(
            {
                "family": row["family"],
                "problem": problem,
                "variant": grid["variant"],
                "median_ms": grid["ms"],
                "tflops": grid["tflops"],
                "gbps": None,
                "rel_err": trial["rel_err"],
                "peer": {"name": grid["peer"], "ms": grid["peer_ms"]},
                "triton_version": data["triton"],
                "torch_version": data["torch"],
                "cuda_version": "13.0",
                "template_hash": template_hash_at(args.commit, "attention_fwd.py.j2"),
                "created_at": datetime.datetime(
                    2026, 11, 22, 18, 9, tzinfo=datetime.timezone.utc
                ).isoformat(),
            }
        )
    document = {
        "format": FORMAT,
        "version": VERSION,
        "gpu": H100,
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "provenance": (
            f"grid-best Variants from {args.results.name} (exhaustive grids on one H100 80GB HBM3, "
            f"Triton {data['triton']}, torch {data['torch']}, 2026-11-22) at commit {args.commit}; "
            "built by benchmarks/ship_winners.py"
        ),
        "winners": winners,
    }
    parse_document(document)  # refuse to write what the package could not load
    args.output.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(winners)} winners to {args.output}")


if __name__ == "__main__":
    main()
