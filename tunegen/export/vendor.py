"""Library code an exported package carries, copied from tunegen's own source so the two agree.

The exported loader checks arguments, builds Problem keys, matches GPUs and falls back to PyTorch
exactly as tunegen does, without a hand-kept copy that could drift: `vendor` takes the top-level
definitions it is asked for from tunegen's modules, together with every module-level definition
they use (followed through imports across tunegen's modules), and returns them as the source of
sibling modules for the exported package. Imports of the standard library, torch and triton are
kept; a copied definition that needs anything else is an error at export time, not at run time.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

ALLOWED_PACKAGES = frozenset({"torch", "triton", *sys.stdlib_module_names})


@dataclasses.dataclass(frozen=True, order=True)
class _Import:
    """One name an import statement binds: `import module [as alias]` when `name` is None, else
    `from module import name [as alias]`."""

    module: str
    name: str | None
    alias: str | None = None


@dataclasses.dataclass(frozen=True)
class _Parsed:
    lines: list[str]
    docstring: str
    definitions: dict[str, ast.stmt]
    imports: dict[str, _Import]


def _top(module: str) -> str:
    return module.split(".")[0]


@functools.cache
def _parsed(module: str) -> _Parsed:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"vendor: no source for module {module}")
    source = Path(spec.origin).read_text()
    tree = ast.parse(source)
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    definitions: dict[str, ast.stmt] = {}
    imports: dict[str, _Import] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    definitions[target.id] = node
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imports[alias.asname or alias.name.split(".")[0]] = _Import(alias.name, None, alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source_module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                imports[alias.asname or alias.name] = _Import(source_module, alias.name, alias.asname)
    return _Parsed(source.splitlines(), ast.get_docstring(tree) or "", definitions, imports)


def _uses(node: ast.stmt) -> tuple[set[str], set[tuple[str, str]]]:
    """The names a definition reads, and the `name.attribute` pairs among them."""
    names, attributes = set(), set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
            attributes.add((child.value.id, child.attr))
    return names, attributes


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _home(module: str, name: str | None) -> tuple[str, str | None]:
    """Where a tunegen name is defined: (module, name), or (module, None) for a module itself."""
    if name is None:
        return module, None
    parsed = _parsed(module)
    if name in parsed.definitions:
        return module, name
    if name in parsed.imports and _top(parsed.imports[name].module) == "tunegen":
        found = parsed.imports[name]
        return _home(found.module, found.name)
    if _is_module(f"{module}.{name}"):
        return f"{module}.{name}", None
    raise ValueError(f"vendor: {module} has no {name}")


def stem(module: str) -> str:
    """The exported file a tunegen module's copy goes to: tunegen.tuning_db.records -> tuning_db_records,
    tunegen.kernels.launcher -> launcher (the kernel machinery's room is the package's own)."""
    return module.removeprefix("tunegen.").removeprefix("kernels.").replace(".", "_")


def vendor(roots: Mapping[str, Iterable[str]], *, header: str) -> dict[str, str]:
    """Source of the modules holding `roots` (tunegen module -> top-level names) and all they use,
    keyed by `stem`; each module starts with `header` as a comment."""
    keep: dict[str, set[str]] = defaultdict(set)
    needs: dict[str, set[_Import]] = defaultdict(set)
    todo = [(module, name) for module, names in roots.items() for name in names]
    while todo:
        module, name = todo.pop()
        parsed = _parsed(module)
        if name in keep[module]:
            continue
        if name not in parsed.definitions:
            raise ValueError(f"vendor: {module} defines no {name}")
        keep[module].add(name)
        names, attributes = _uses(parsed.definitions[name])
        for used in sorted(names):
            if used in parsed.definitions:
                todo.append((module, used))
                continue
            found = parsed.imports.get(used)
            if found is None:
                continue  # a builtin, a parameter or a local
            if _top(found.module) in ALLOWED_PACKAGES:
                needs[module].add(found)
                continue
            if _top(found.module) != "tunegen":
                raise ValueError(
                    f"vendor: {module}.{name} uses {used} from {found.module}; an exported package "
                    "depends on torch and triton only"
                )
            home, target = _home(found.module, found.name)
            if target is None:
                needs[module].add(_Import(".", stem(home), used if used != stem(home) else None))
                todo.extend((home, attr) for base, attr in attributes if base == used)
            else:
                needs[module].add(_Import(f".{stem(home)}", target, used if used != target else None))
                todo.append((home, target))
    return {stem(module): _render(module, names, needs[module], header) for module, names in keep.items()}


def _import_lines(imports: set[_Import]) -> list[str]:
    """Import statements, `import` lines first, then one `from` line per module, sorted."""
    plain = sorted(i for i in imports if i.name is None)
    lines = [f"import {i.module}" + (f" as {i.alias}" if i.alias else "") for i in plain]
    by_module: dict[str, list[str]] = defaultdict(list)
    for i in sorted(i for i in imports if i.name is not None):
        by_module[i.module].append(i.name + (f" as {i.alias}" if i.alias else ""))
    lines += [f"from {module} import {', '.join(names)}" for module, names in sorted(by_module.items())]
    return lines


def _render(module: str, names: set[str], imports: set[_Import], header: str) -> str:
    parsed = _parsed(module)
    nodes = sorted(
        {id(n): n for n in (parsed.definitions[name] for name in names)}.values(), key=lambda n: n.lineno
    )
    blocks = []
    for node in nodes:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        blocks.append("\n".join(parsed.lines[first - 1 : node.end_lineno]))
    external = _import_lines({i for i in imports if not i.module.startswith(".")})
    local = _import_lines({i for i in imports if i.module.startswith(".")})
    summary = parsed.docstring.split("\n\n")[0] if parsed.docstring else module
    source = "\n".join(
        [
            f"# {header}",
            f"# Copied from {module}: {', '.join(sorted(names))}.",
            f'"""{summary}"""',
            "",
            "from __future__ import annotations",
            "",
            *external,
            *([""] if external and local else []),
            *local,
            "",
            "",
            "\n\n\n".join(blocks),
            "",
        ]
    )
    compile(source, f"{stem(module)}.py", "exec")
    return source
