#!/usr/bin/env bash
# The package as users get it: build the sdist and the wheel from this tree, check what they
# carry, install the wheel (not editable) with its `mpi` extra into a fresh venv beside the dev
# one, and run `python -m mpigossip info` and a 2-rank averaging example from it (outside the
# source tree, so that nothing imports the checkout).
#
#   bash tests/wheel.sh                 # with .venv/bin/python building (needs `build`: the test extra)
#   PYTHON=/path/to/python bash tests/wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" build' EXIT

"$PY" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
wheel=$(ls "$WORK"/dist/mpigossip-*.whl)
sdist=$(ls "$WORK"/dist/mpigossip-*.tar.gz)
version=$("$PY" -c "import ast, sys; t = ast.parse(open('mpigossip/__init__.py').read()); \
print(next(n.value.value for n in t.body if isinstance(n, ast.Assign) and n.targets[0].id == '__version__'))")
"$PY" - "$wheel" "$sdist" "$version" <<'PY'
import sys, tarfile, zipfile
wheel, sdist, version = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
need = {"LICENSE": f"mpigossip-{version}.dist-info/licenses/LICENSE", "py.typed": "mpigossip/py.typed",
        "the CUDA source": "mpigossip/core/cuda/kernels.cu"}
missing = [what for what, path in need.items() if path not in names]
assert not missing, f"the wheel lacks {missing}: {sorted(names)[:20]}..."
meta = zipfile.ZipFile(wheel).read(f"mpigossip-{version}.dist-info/METADATA").decode()
assert f"Version: {version}\n" in meta and "License-Expression: BSD-3-Clause\n" in meta, meta[:600]
assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))], "the wheel carries tests or benchmarks"
members = tarfile.open(sdist).getnames()
for path in ("LICENSE", "pyproject.toml", "README.md", "mpigossip/core/cuda/kernels.cu", "mpigossip/py.typed"):
    assert f"mpigossip-{version}/{path}" in members, f"the sdist lacks {path}"
print(f"wheel: {wheel.rsplit('/', 1)[1]} carries LICENSE, py.typed and kernels.cu; the sdist too")
PY

# A fresh venv: pip takes the dependencies from its cache where the dev install left them.
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check "$wheel[mpi]" >"$WORK/pip.log" 2>&1 ||
  { tail -30 "$WORK/pip.log"; exit 1; }
cd "$WORK"   # away from the checkout: `import mpigossip` must find the installed wheel
where=$("$WORK/venv/bin/python" -c "import mpigossip; print(mpigossip.__file__)")
case $where in "$WORK"/venv/*) ;; *) echo "wheel: mpigossip imported from $where, not the wheel" >&2; exit 1 ;; esac
[ "$("$WORK/venv/bin/python" -m mpigossip --version)" = "mpigossip $version" ]
"$WORK/venv/bin/python" -m mpigossip info >"$WORK/info.txt"
grep -q "mpigossip $version\|\"mpigossip\": \"$version\"\|mpigossip: *$version" "$WORK/info.txt" ||
  { cat "$WORK/info.txt"; echo "wheel: info does not name version $version" >&2; exit 1; }
cat >"$WORK/average.py" <<'PY'
import numpy as np
from mpi4py import MPI

import mpigossip as mg

comm = MPI.COMM_WORLD
x = np.full(1000, float(comm.rank))
with mg.AllreduceAverager(x, comm=comm) as avg:
    avg.average()
assert np.all(x == (comm.size - 1) / 2), x[:3]
y = np.full(1000, float(comm.rank))
with mg.PushSum(y, comm=comm) as ps:
    for _ in range(20):
        ps.step()
    z = ps.debiased()
assert np.allclose(z, (comm.size - 1) / 2), z[:3]
print(f"rank {comm.rank}: averaged with the installed mpigossip")
PY
timeout 120 "$WORK/venv/bin/mpigossip-mpiexec" -n 2 "$WORK/venv/bin/python" "$WORK/average.py"
echo "wheel: the installed wheel runs info and a 2-rank average (mpigossip $version)"
