#!/usr/bin/env bash
# The one test command, in timed steps, each under its own limit (tests/steps.sh):
#   serial: lint                       ruff (pyflakes, pycodestyle, import order: pyproject.toml)
#   serial: types                      mypy over the package (settings: pyproject.toml)
#   serial: docs site                  Sphinx (guide pages and API reference), warnings as errors
#   serial: units and small launches   pytest, in-process checks and short mpiexec launches
#   serial: the wheel as users get it   sdist and wheel built, installed into a fresh venv, run (tests/wheel.sh)
#   serial: fault tolerance            tests/test_faults.py (lost, hung and killed ranks; survivors under ULFM)
#   serial: training job end to end    tests/test_train.py (every algorithm trained, bad data, ...)
#   serial: training job, checkpoints and resume   tests/test_train.py (exact resume, at another size, ...)
#   serial: reproduce --quick          the papers' experiments, small, end to end
#   serial: Slurm jobs, one node       the jobs/ scripts on a local Slurm
#   MPI tests, world size N            tests/mpi under the venv's mpiexec at each size
#   cluster: ...                       as root: 4 emulated nodes at 1 Gbit (tests/cluster/run.sh)
# The summary gives each step's time and the share of its limit it used, and names a step that
# ran out of time "TIMED OUT", distinct from one that "FAILED". A failure on any rank fails that
# launch. Leaves no /dev/shm/sm_segment.* files behind.
#
#   bash tests/run.sh                    # everything
#   MPIGOSSIP_TEST_SIZES="2 4" bash tests/run.sh
#   MPIGOSSIP_CLUSTER_TESTS=0 bash tests/run.sh   # without the emulated-cluster part
#   MPIGOSSIP_TEST_STEPS="units mpi" bash tests/run.sh   # some steps: lint types docs units wheel faults train reproduce slurm mpi cluster
#   MPIGOSSIP_TEST_SCALE=2 bash tests/run.sh      # every limit doubled (a slow or shared machine)
#   PYTHON=/path/to/python bash tests/run.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SIZES=${MPIGOSSIP_TEST_SIZES:-}   # default below: 1 2 3 (odd, no power of two) 4 8 (two per core)
STEPS=${MPIGOSSIP_TEST_STEPS:-"lint types docs units wheel faults train reproduce slurm mpi cluster"}
export MPIGOSSIP_TIMEOUT=${MPIGOSSIP_TIMEOUT:-60}   # deadline of every wait inside the tests
export PYTHONUNBUFFERED=1
if [ ! -x "$PY" ]; then
  echo "tests/run.sh: $PY not found: run the README's set-up command first" >&2
  exit 2
fi
MPIEXEC="$(dirname "$PY")/mpigossip-mpiexec"
. tests/steps.sh
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

# Open MPI 5 leaves /dev/shm/sm_segment.* behind; remove the ones created by this run.
before=$(mktemp)
ls /dev/shm/sm_segment.* 2>/dev/null | sort >"$before"
cleanup() {
  ls /dev/shm/sm_segment.* 2>/dev/null | sort | comm -13 "$before" - | xargs -r rm -f
  rm -f "$before"
  step_cleanup
}
trap cleanup EXIT

# The real data set of the reproduction and its tests: Debian's package, installed as root when
# missing (as tests/slurm/start.sh installs Slurm); elsewhere those tests skip, saying why.
FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -e "$FMNIST/train-images-idx3-ubyte.gz" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  timeout 300 apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 ||
    { timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 300 apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } ||
    echo "tests/run.sh: could not install dataset-fashion-mnist: its tests will skip" >&2
fi

PYTEST=("$PY" -m pytest -q --color=no -p no:cacheprovider --strict-markers tests)
wanted lint && step "serial: lint" 120 "$(dirname "$PY")/ruff" check mpigossip tests benchmarks examples
wanted types && step "serial: types" 300 "$(dirname "$PY")/mypy"
SITE=$(mktemp -d)
wanted docs && step "serial: docs site" 300 "$PY" -m sphinx -E -W --keep-going -q -b html docs "$SITE"
rm -rf "$SITE"
wanted units && step "serial: units and small launches" 600 "${PYTEST[@]}" -m "not (faults or train or reproduce or slurm)"
wanted wheel && step "serial: the wheel as users get it" 300 env PYTHON="$PY" bash tests/wheel.sh
wanted faults && step "serial: fault tolerance" 600 "${PYTEST[@]}" -m "faults and not train"
wanted train && step "serial: training job end to end" 600 "${PYTEST[@]}" -m "train and not resume"
wanted train && step "serial: training job, checkpoints and resume" 600 "${PYTEST[@]}" -m resume
wanted reproduce && step "serial: reproduce --quick" 400 "${PYTEST[@]}" -m reproduce
# The cluster part runs as root with ip, tc and nsenter (network namespaces).
cluster_runs() {
  wanted cluster && [ "${MPIGOSSIP_CLUSTER_TESTS:-1}" != 0 ] && [ "$(id -u)" = 0 ] &&
    command -v ip >/dev/null && command -v tc >/dev/null && command -v nsenter >/dev/null
}
# 4 ranks run across the emulated nodes (one per node, every message over TCP); on one node
# only where the cluster part does not run.
if [ -z "$SIZES" ]; then
  if cluster_runs; then SIZES="1 2 3 8"; else SIZES="1 2 3 4 8"; fi
fi
if wanted slurm; then
  # the jobs the cluster step submits to 4 Slurm nodes (bench, preemption) run there only
  cluster_runs && export MPIGOSSIP_SLURM_ON_FOUR_NODES=1
  step "serial: Slurm jobs, one node" 600 "${PYTEST[@]}" -m slurm
  bash tests/slurm/stop.sh   # a step cut by its limit leaves the daemons behind
fi

if wanted mpi; then
  for n in $SIZES; do
    if [ "$n" = 8 ] && [ -z "${MPIGOSSIP_TEST_SIZES:-}" ] && cluster_runs; then
      # 8 ranks run across the emulated nodes, two per node (shared memory and TCP); here only
      # what that run leaves to one node: the one-sided windows' own tests (tests/cluster/run.sh)
      step "MPI tests, world size 8 (one-sided windows; the rest across the nodes)" 400 \
        "$MPIEXEC" -n 8 "$PY" -m pytest --with-mpi -q --color=no -p no:cacheprovider tests/mpi/test_server.py \
        tests/mpi/test_stress.py -k "test_server or test_easgd_conserves_mass_under_delays or test_easgd_concurrent"
      continue
    fi
    step "MPI tests, world size $n" 400 \
      "$MPIEXEC" -n "$n" "$PY" -m pytest --with-mpi -q --color=no -p no:cacheprovider tests/mpi
  done
fi

if wanted cluster && [ "${MPIGOSSIP_CLUSTER_TESTS:-1}" != 0 ]; then
  if cluster_runs; then
    PYTHON="$PY" bash tests/cluster/run.sh
  else
    echo "cluster: skipped (needs root with ip, tc and nsenter for network namespaces)" >>"$MPIGOSSIP_STEPS"
  fi
fi

if step_summary; then
  echo "tests/run.sh: all passed"
else
  echo "tests/run.sh: FAILED"
  exit 1
fi
