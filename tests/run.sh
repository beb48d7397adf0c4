#!/usr/bin/env bash
# The one test command: serial tests, then the MPI tests under the venv's own mpiexec at
# several world sizes. Each MPI launch runs under a timeout, so a deadlock fails the run
# instead of hanging; a failure on any rank fails that launch; the summary names the sizes
# that failed. Leaves no /dev/shm/sm_segment.* files behind.
#
#   bash tests/run.sh                    # everything
#   MPIGOSSIP_TEST_SIZES="2 4" bash tests/run.sh
#   MPIGOSSIP_CLUSTER_TESTS=0 bash tests/run.sh   # without the emulated-cluster part (tests/cluster/run.sh)
#   PYTHON=/path/to/python bash tests/run.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SIZES=${MPIGOSSIP_TEST_SIZES:-"1 2 3 4 5 8"}
LIMIT=${MPIGOSSIP_TEST_TIMEOUT:-900}      # seconds per launch
export MPIGOSSIP_TIMEOUT=${MPIGOSSIP_TIMEOUT:-60}   # deadline of every wait inside the tests
export PYTHONUNBUFFERED=1
if [ ! -x "$PY" ]; then
  echo "tests/run.sh: $PY not found: run the README's set-up command first" >&2
  exit 2
fi
MPIEXEC="$(dirname "$PY")/mpigossip-mpiexec"

# Open MPI 5 leaves /dev/shm/sm_segment.* behind; remove the ones created by this run.
before=$(mktemp)
ls /dev/shm/sm_segment.* 2>/dev/null | sort >"$before"
cleanup() {
  ls /dev/shm/sm_segment.* 2>/dev/null | sort | comm -13 "$before" - | xargs -r rm -f
  rm -f "$before"
}
trap cleanup EXIT

declare -a results
failed=0

echo "=== serial tests"
start=$SECONDS
timeout -k 10 "$LIMIT" "$PY" -m pytest -q --color=no -p no:cacheprovider tests
rc=$?
results+=("serial: $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s")
[ $rc -eq 0 ] || failed=1

for n in $SIZES; do
  echo "=== MPI tests, world size $n"
  start=$SECONDS
  timeout -k 10 "$LIMIT" "$MPIEXEC" -n "$n" "$PY" -m pytest --with-mpi -q --color=no -p no:cacheprovider tests/mpi
  rc=$?
  if [ $rc -eq 0 ]; then
    results+=("world size $n: passed in $((SECONDS - start)) s")
  else
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after $LIMIT s" || why="exit $rc"
    results+=("world size $n: FAILED ($why) in $((SECONDS - start)) s")
    failed=1
  fi
done

if [ "${MPIGOSSIP_CLUSTER_TESTS:-1}" != 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null && command -v nsenter >/dev/null; then
    echo "=== cluster tests: 4 emulated nodes at 1 Gbit (tests/cluster/run.sh)"
    start=$SECONDS
    PYTHON="$PY" bash tests/cluster/run.sh
    rc=$?
    results+=("emulated cluster: $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s")
    [ $rc -eq 0 ] || failed=1
  else
    results+=("emulated cluster: skipped (needs root with ip, tc and nsenter for network namespaces)")
  fi
fi

echo "=== summary"
printf '%s\n' "${results[@]}"
if [ $failed -ne 0 ]; then
  echo "tests/run.sh: FAILED"
  exit 1
fi
echo "tests/run.sh: all passed"
