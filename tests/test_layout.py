"""The house: each room imports only the rooms below it in the flow (templates and the store are
data and storage that any room may use), no module imports itself back through others, and no
source file outgrows about 400 lines (templates aside). See the Rooms table in the README."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders as they install (pyproject.toml's package-dir).
FOLDERS = {"tunegen": "tunegen", "cli": "tunegen.cli", "tuning_db": "tunegen.tuning_db"}
# Neither a room nor importing one: the version string and the finder that lets a clone run.
NEUTRAL = {"tunegen.version", "tunegen.source_tree"}
STORAGE = {"store", "templates", "neutral"}
ALLOWED = {
    "store": {"store", "neutral"},
    "kernels": {"kernels"} | STORAGE,
    "tuning": {"tuning", "kernels"} | STORAGE,
    "public": {"public", "kernels"} | STORAGE,
    "measure": {"measure", "tuning", "public", "kernels"} | STORAGE,
    "export": {"export", "kernels"} | STORAGE,
    "cli": {"cli", "export", "measure", "tuning", "public", "kernels"} | STORAGE,
}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """Every tunegen module under its installed name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "migrations" in parts:  # Alembic's scripts, run by Alembic, not imported
                continue
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def room(module: str) -> str:
    if module in NEUTRAL:
        return "neutral"
    parts = module.split(".")
    second = parts[1] if len(parts) > 1 else ""
    rooms = {"kernels": "kernels", "tuning": "tuning", "measure": "measure", "export": "export"}
    rooms |= {"cli": "cli", "tuning_db": "store", "templates": "templates"}
    return rooms.get(second, "public")


def imports(module: str) -> set[str]:
    """The tunegen modules `module` imports anywhere in its body (functions included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name == "tunegen" or name.startswith("tunegen.")}


GRAPH = {module: imports(module) - {module} for module in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_room_imports_only_rooms_below_it(module):
    wrong = {name for name in GRAPH[module] if room(name) not in ALLOWED[room(module)]}
    assert not wrong, f"{module} ({room(module)}) imports {sorted(wrong)} from rooms above it"


def test_no_module_imports_itself_back():
    """No circle of imports, lazy ones included (the package's own __init__, which imports the
    public functions for `import tunegen`, is where every path starts, not a step in one)."""
    graph = {m: {n for n in targets if n != "tunegen"} for m, targets in GRAPH.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_rooms_are_what_the_readme_says():
    readme = (ROOT / "README.md").read_text()
    for folder in ("tunegen/kernels/", "tunegen/tuning/", "tunegen/measure/", "tunegen/export/", "cli/"):
        assert f"`{folder}`" in readme, f"the README does not say what {folder} holds"


SOURCES = sorted(
    p
    for p in itertools.chain(*(ROOT.glob(f"{top}/**/*.py") for top in (*FOLDERS, "tests", "benchmarks")))
    if "migrations" not in p.parts
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_outgrows_about_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by what it holds"


def test_importing_tunegen_leaves_the_database_layer_for_its_first_use():
    """`import tunegen` loads neither SQLAlchemy, Alembic nor Optuna (0.6 s on an H200 host):
    the store loads on first use, which `tunegen tune` makes while a child asks CUDA; and the
    store's names still come from `tunegen.tuning_db` as before."""
    script = (
        "import sys, tunegen\n"
        "heavy = [m for m in ('sqlalchemy', 'alembic', 'optuna') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from tunegen.tuning_db import Store, head_revision, shipped_store\n"
        "assert Store.__module__ == 'tunegen.tuning_db.store' and 'sqlalchemy' in sys.modules\n"
        "assert callable(head_revision) and callable(shipped_store)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
