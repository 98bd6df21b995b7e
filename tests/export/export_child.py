"""Run by tests/export/test_export.py as `python -I export_child.py EXPORT_DIR PACKAGE CASES RESULTS` in a
fresh interpreter where tunegen (and what only tunegen needs) cannot be imported: imports the
exported package, runs each call in CASES and saves what it returned, raised and warned, with the
Problem the package keyed the call under and the table entry it chose."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

BLOCKED = ("tunegen", "jinja2", "sqlalchemy", "alembic", "optuna", "click", "platformdirs", "rich")


class Blocked(importlib.abc.MetaPathFinder):
    """Refuses the packages an export must not need, wherever they are installed."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked in this process", name=name)
        return None


def problem_of(package, case):
    """The Problem the package's own checked calls give the call (what it looked up)."""
    a, kw = case["args"], case["kwargs"]
    if case["fn"] == "decode_attention":
        return package.DecodeCall.checked(*a, **kw).problem()
    call = (package.PrefillCall.dense if case["fn"] == "attention" else package.PrefillCall.packed)(*a, **kw)
    return call.problem(call.outputs()[0])


def main() -> None:
    sys.meta_path.insert(0, Blocked())
    export_dir, name, cases_path, results_path = sys.argv[1:]
    sys.path.insert(0, export_dir)
    import torch

    package = importlib.import_module(name)
    results = []
    for case in torch.load(cases_path):
        try:
            problem = problem_of(package, case)
        except ValueError:  # a bad argument: the call below says so
            problem = None
        entry = problem and package.lookup(problem, package.gpu_of(case["args"][0].device))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out, error = getattr(package, case["fn"])(*case["args"], **case["kwargs"]), None
            except (ValueError, package.FallbackError) as exc:
                out, error = None, f"{type(exc).__name__}: {exc}"
        results.append(
            {
                "out": out,
                "error": error,
                "warnings": [
                    w.category.__name__ for w in caught if not issubclass(w.category, DeprecationWarning)
                ],
                "problem": problem and problem.as_dict(),
                "source": entry["source"] if entry else None,
                "variant": entry["variant"] if entry else None,
            }
        )
    leaked = sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED))
    torch.save({"results": results, "leaked": leaked}, results_path)


if __name__ == "__main__":
    main()
