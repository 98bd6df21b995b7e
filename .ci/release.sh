#!/usr/bin/env bash
# The CPU suite (interpreter, offline sm_90 compiles, everything but the slow wheel and virtual
# environment builds) on another Triton release, in a virtual environment of its own set up as
# the README's test command does with that release pinned:   bash .ci/release.sh 3.9.0
set -euo pipefail
cd "$(dirname "$0")/.."
release=$1
venv=.venv-triton$release
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0 "triton==$release" -e ".[test]"
echo "release.sh: Triton $("$venv/bin/python" -c 'import triton; print(triton.__version__)')"
"$venv/bin/python" -m pytest -n 2 -m "not slow" -p no:cacheprovider
