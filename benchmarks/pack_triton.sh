#!/usr/bin/env bash
# Packs a Triton release for the GPU machine, whose image has Triton 3.6 and no registry: the
# cp312 wheel from the registry (here), less what tunegen never loads (the AMD backend, the
# Blackwell ptxas, CUPTI, proton, plugins), its library stripped, as one xz file: 45 MB for
# 3.7.1, 57 MB for 3.9.0 (the wheels are about 200 MB). A call carries 64 MiB with the working
# tree; where that is too little, `split -b 29M` the file and carry the parts in two calls on one
# warm machine, copying the first to /tmp there (ignored paths stay between calls), then `cat` them.
#
#   benchmarks/pack_triton.sh 3.7.1          # writes .triton/triton-3.7.1.tar.xz (ignored by git)
#
# On the GPU machine (carry ".triton"), unpack it and put it first on the path:
#
#   mkdir -p /tmp/t && tar xJf .triton/triton-3.7.1.tar.xz -C /tmp/t
#   export PYTHONPATH=/tmp/t:$PYTHONPATH     # before the .whl site and the project
#
# (`gpu_session.sh other_tests` takes that folder as TRITON_SITE.) A child started with
# `python -I` ignores PYTHONPATH and imports the image's Triton 3.6 again.
set -euo pipefail
version=${1:?usage: pack_triton.sh VERSION}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q "triton==$version" --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_27_x86_64 -d "$work/wheel"
mkdir "$work/tree"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$work"/wheel/triton-*.whl "$work/tree"
cd "$work/tree"
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti triton/backends/nvidia/bin/ptxas-blackwell \
    triton/backends/nvidia/bin/nvdisasm triton/instrumentation triton/_C/libproton.so triton/plugins
# 3.9 asks for the Blackwell ptxas even for sm_90: the Hopper one answers under its name.
ln -s ptxas triton/backends/nvidia/bin/ptxas-blackwell
# Backends are found by entry point: the AMD one is gone.
sed -i '/amd/d' triton-*.dist-info/entry_points.txt
strip --strip-unneeded triton/_C/libtriton.so
chmod +x triton/backends/nvidia/bin/*
mkdir -p "$root/.triton"
tar cf - triton triton-*.dist-info | xz -T2 -9e >"$root/.triton/triton-$version.tar.xz"
ls -l "$root/.triton/triton-$version.tar.xz"
