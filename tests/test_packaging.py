"""A wheel built from the repository carries the templates and the CLI: installed into a fresh
virtual environment, `tunegen --help` and a kernel render work from another folder."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_runs_elsewhere(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("tunegen-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # The heavy dependencies (torch, triton) are borrowed from this interpreter's site-packages
    # as plain path entries, after the fresh environment's own: the wheel shadows any
    # development install, whose import hooks are not loaded.
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TUNEGEN_CACHE_DIR"] = str(tmp_path / "cache")
    help_text = subprocess.run(
        [env_dir / "bin" / "tunegen", "--help"],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "render" in help_text and "bench" in help_text
    probe = (
        "import tunegen, tunegen.cli, tunegen.tuning_db, tunegen.templates, sys;"
        "from tunegen.kernels.render import template_dir;"
        "print(tunegen.__file__); print(sorted(p.name for p in template_dir().glob('*.j2')))"
    )
    out = subprocess.run(
        [python, "-c", probe], cwd=elsewhere, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out[0].startswith(str(env_dir)), out[0]
    assert "attention_fwd.py.j2" in out[1] and "_attention.j2" in out[1]
    rendered = subprocess.run(
        [env_dir / "bin" / "tunegen", "render", "prefill", "--gpu", "hopper"],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "def attn_fwd(" in rendered
    for top in ("cli", "templates", "tuning_db"):
        assert not Path(purelib, top).exists(), f"{top} must not pollute site-packages"


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml names its packages one by one: a new package folder must be named there too,
    or an installed tunegen lacks it while a clone has it."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {v: k for k, v in config["package-dir"].items()}
    found = {
        ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
        for folder, package in folders.items()
        for init in (ROOT / folder).glob("**/__init__.py")
    }
    assert found - set(config["packages"]) == set(), "package folders missing from pyproject.toml"


def test_a_clone_runs_as_installed_without_installing(tmp_path):
    """The repository's folders on PYTHONPATH, nothing of tunegen installed (python -S skips the
    editable install's mapping): the rooms that install under tunegen.* are found in the clone."""
    import shutil
    import sysconfig

    clone = tmp_path / "clone"
    for room in ("tunegen", "cli", "templates", "tuning_db"):
        shutil.copytree(ROOT / room, clone / room, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", clone)
    code = (
        "import tunegen, tunegen.tuning_db, tunegen.cli.main\n"
        "from tunegen.kernels.render import template_dir\n"
        "from tunegen.tuning_db import load_shipped\n"
        "load_shipped()\n"
        "print(tunegen.tuning_db.__file__, template_dir(), sep='\\n')\n"
    )
    site_packages = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(clone), *site_packages])}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(clone / "tuning_db" / "__init__.py"), str(clone / "templates")]
