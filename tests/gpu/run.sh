#!/usr/bin/env bash
# The whole GPU path in one command, on a GPU machine with no network (about 5 minutes):
#
#   bash tests/gpu/run.sh                 # logs and results under $OUT (default runs/gpu-check)
#
# 1. the kernel and buffer tests with CuPy (every kernel against numpy, aligned and not);
# 2. the MPI tests of every buffer kind (CuPy, torch CUDA, staged and CUDA-aware where the MPI
#    is) and the device stress tests (16 MB, random per-rank delays, exact invariants) at 4
#    ranks, the stress tests again at 8, all ranks sharing the GPUs;
# 3. `compare` of every algorithm with --device cuda at 4 and 8 ranks, checked against the
#    same run on the CPU (accuracy within 2 points, consensus distance within 3x);
# 4. the kernel benchmark (figures only: no timing passes or fails).
# Each step's log is $OUT/<step>.log; the summary names every failed step; exit 1 if any.
# DRY=1 runs the same steps with the CPU standing in for the GPU (to check the script itself
# on a machine without one; the GPU kinds then skip).
#
# MPI: the repository's .venv if it has mpiexec, else an mpiexec on PATH, else a venv made
# from the wheels in .whl/ (tests/gpu/wheels.sh downloads them elsewhere) on top of this
# machine's python3 with its torch and CuPy.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 MPIGOSSIP_TIMEOUT=${MPIGOSSIP_TIMEOUT:-60}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

if [ -x .venv/bin/mpiexec ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}; MPIEXEC=$ROOT/.venv/bin/mpiexec
elif command -v mpiexec >/dev/null; then
  PY=${PYTHON:-python3}; MPIEXEC=$(command -v mpiexec)
elif ls .whl/*.whl >/dev/null 2>&1; then
  PY=${PYTHON:-python3}
  SITE=$("$PY" -c "import site; print(site.getsitepackages()[0])")
  V=${MPIGOSSIP_GPU_VENV:-/tmp/mpigossip-gpu-mpi}
  if [ ! -x "$V/bin/mpiexec" ]; then
    "$PY" -m venv "$V" && "$V/bin/pip" install -q --no-index --no-deps .whl/*.whl || { echo "tests/gpu/run.sh: could not install .whl/" >&2; exit 2; }
  fi
  export PYTHONPATH=$(echo "$V"/lib/python3*/site-packages):$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$V/bin:$PATH
  MPIEXEC=$V/bin/mpiexec
else
  echo "tests/gpu/run.sh: no mpiexec: make the .venv (README), or put the wheels in .whl/ (tests/gpu/wheels.sh)" >&2
  exit 2
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

declare -a results
failed=0
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 3 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then
    results+=("ok     $name ($((SECONDS - start)) s)")
  else
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && rc="timed out after $limit s"
    results+=("FAILED $name ($rc, $((SECONDS - start)) s): see $OUT/$name.log")
    failed=1
  fi
}

DEVICE=cuda
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu
  step gpu-visible 60 true
else
step gpu-visible 60 "$PY" -c "
import cupy, torch
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0 and torch.cuda.is_available(), 'no CUDA GPU visible to CuPy and torch'
print(n, 'GPU(s):', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| cupy', cupy.__version__)"
fi
if [ $failed -ne 0 ]; then cat "$OUT/gpu-visible.log"; echo "tests/gpu/run.sh: FAILED (no GPU)"; exit 1; fi
"$MPIEXEC" -n 1 "$PY" -m mpigossip info >"$OUT/info.log" 2>&1
PYTEST=("$PY" -m pytest -q --color=no -p no:cacheprovider -rs)
step kernels-and-buffers 300 "${PYTEST[@]}" tests/test_kernels.py tests/test_buffers.py
step mpi-4-ranks 400 "$MPIEXEC" -n 4 "${PYTEST[@]}" --with-mpi tests/mpi/test_kinds.py tests/mpi/test_stress.py \
  tests/mpi/test_torch.py
step mpi-8-ranks 400 "$MPIEXEC" -n 8 "${PYTEST[@]}" --with-mpi tests/mpi/test_stress.py
for n in 4 8; do
  step "compare-$n-cpu" 400 "$MPIEXEC" -n "$n" "$PY" -m mpigossip compare --device cpu --quiet \
    --out "$OUT/compare-$n-cpu"
  step "compare-$n-cuda" 400 "$MPIEXEC" -n "$n" "$PY" -m mpigossip compare --device "$DEVICE" --quiet \
    --out "$OUT/compare-$n-cuda"

  step "compare-$n-check" 60 "$PY" tests/gpu/check_compare.py "$OUT/compare-$n-cpu" "$OUT/compare-$n-cuda"
done
step kernel-benchmark 400 "$PY" benchmarks/bench_kernels.py --device "$DEVICE" --out "$OUT/bench" \
  $([ "$DEVICE" = cpu ] && echo --sizes-mb 8 --dtypes float32 --repeats 3)

echo "=== summary (logs in $OUT)"
printf '%s\n' "${results[@]}"
[ -f "$OUT/bench/kernels-$DEVICE.md" ] && cat "$OUT/bench/kernels-$DEVICE.md"
if [ $failed -ne 0 ]; then echo "tests/gpu/run.sh: FAILED"; exit 1; fi
echo "tests/gpu/run.sh: all passed"
