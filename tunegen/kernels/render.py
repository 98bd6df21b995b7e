"""Rendering: Jinja templates plus a Variant and Problem features give Triton source.

Rendering is pure: the same template, Variant and features give the same text, which is
written once to the on-disk cache under the hash of its content and imported from there like
any module, so Triton can read the source it compiles and a user can read what runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.resources
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import platformdirs

from tunegen.kernels.environ import environment
from tunegen.kernels.releases import INSTALLED, Release, interpreter_problem
from tunegen.kernels.variant import Variant


@functools.cache
def template_dir() -> Path:
    """The folder holding the kernel templates (package data when installed)."""
    return Path(str(importlib.resources.files("tunegen.templates")))


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.cache
def template_hash(name: str) -> str:
    """Hash of a template and the shared macro files it may import (provenance for Winners)."""
    digest = hashlib.sha256()
    for path in [*sorted(template_dir().glob("_*.j2")), template_dir() / name]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where rendered kernels live: `TUNEGEN_CACHE_DIR`, else the user's cache folder."""
    root = os.environ.get("TUNEGEN_CACHE_DIR") or platformdirs.user_cache_dir("tunegen")
    return Path(root) / "kernels"


@dataclasses.dataclass(frozen=True)
class Rendered:
    """Rendered Triton source and its content hash."""

    family: str
    source: str
    digest: str

    @property
    def module_name(self) -> str:
        return f"tunegen_kernel_{self.family}_{self.digest}"


def render(
    template: str, family: str, variant: Variant, features: dict[str, Any], release: Release = INSTALLED
) -> Rendered:
    """Render `template` for one Variant and one set of Problem features, in the API of `release`
    (the installed Triton's, which compiles it)."""
    header = [
        f"family: {family}",
        f"template: {template} (hash {template_hash(template)})",
        f"variant: {variant.to_json()}",
        "features: " + ", ".join(f"{k}={features[k]}" for k in sorted(features)),
        f"triton: {release.name}",
    ]
    source = _environment().get_template(template).render(v=variant, f=features, r=release, header=header)
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    return Rendered(family=family, source=source, digest=digest)


def render_text(template: str, **context: Any) -> str:
    """Render a template that is not a kernel (the loader `tunegen export` writes, say)."""
    return _environment().get_template(template).render(**context)


def write(rendered: Rendered) -> Path:
    """Write the source into the cache (atomically; an existing file is already identical)."""
    folder = cache_dir()
    path = folder / f"{rendered.module_name}.py"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            handle.write(rendered.source)
        os.replace(tmp, path)
    return path


_LOAD_LOCK = threading.Lock()


def load(rendered: Rendered, *, interpret: bool) -> ModuleType:
    """Import the rendered module; Triton decides at import whether its kernels are interpreted
    (a RuntimeError says why where the installed Triton's interpreter cannot run them)."""
    name = rendered.module_name + ("_interpreted" if interpret else "")
    with _LOAD_LOCK:
        module = sys.modules.get(name)
        if module is not None:
            return module
        if interpret and (problem := interpreter_problem()) is not None:
            raise RuntimeError(problem)
        path = write(rendered)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules[name] = module
            with interpreting(interpret):
                spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module


@contextlib.contextmanager
def interpreting(flag: bool) -> Iterator[None]:
    """Set TRITON_INTERPRET for the block: Triton reads it when it decorates and compiles kernels."""
    with environment("TRITON_INTERPRET", "1" if flag else "0"):
        yield
