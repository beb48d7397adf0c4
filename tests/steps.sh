# Timed steps of the test command (sourced by tests/run.sh and tests/cluster/run.sh).
#
#   step NAME LIMIT COMMAND...   run COMMAND under `timeout LIMIT x $MPIGOSSIP_TEST_SCALE` (the
#                                whole process group);
#                                one summary line: "passed in T s (P% of L s)", "FAILED (exit X)
#                                in T s", or "TIMED OUT after L s": a slow machine names the step
#                                that ran out of time, distinct from one that failed
#   step_record NAME RC T LIMIT  the same line for a step timed by the caller
#   step_summary                 print every line recorded so far; status 1 if any step failed
#
# Lines go to the file $MPIGOSSIP_STEPS (made here if unset), so that a script called by
# another (tests/cluster/run.sh under tests/run.sh) adds its steps to the caller's summary.
# A step that exits 3 once, when STEP_RETRY_ON_3=1, is run again (tests/cluster/mpiexec's exit
# for an Open MPI launcher hung at teardown).

if [ -z "${MPIGOSSIP_STEPS:-}" ]; then
  MPIGOSSIP_STEPS=$(mktemp)
  STEPS_OWNER=1
fi
export MPIGOSSIP_STEPS

step_record() {  # NAME RC SECONDS LIMIT
  local name=$1 rc=$2 t=$3 limit=$4 line
  case $rc in
    0) line="$name: passed in $t s ($((100 * t / limit))% of its $limit s limit)" ;;
    124 | 137) line="$name: TIMED OUT after $limit s" ;;
    *) line="$name: FAILED (exit $rc) in $t s" ;;
  esac
  echo "$line" >>"$MPIGOSSIP_STEPS"
  echo "--- $line" >&2
  [ "$rc" -eq 0 ]
}

step() {  # NAME LIMIT COMMAND...
  local name=$1 limit=$(($2 * ${MPIGOSSIP_TEST_SCALE:-1})) start=$SECONDS rc attempt
  shift 2
  echo "=== $name (limit $limit s)"
  for attempt in 1 2; do
    timeout -k 10 "$limit" "$@"
    rc=$?
    if [ $rc -eq 3 ] && [ "${STEP_RETRY_ON_3:-0}" = 1 ] && [ $attempt -eq 1 ]; then
      echo "$name: the launcher hung at exit (status 3); running it again"
      continue
    fi
    break
  done
  step_record "$name" $rc $((SECONDS - start)) "$limit"
}

step_summary() {
  echo "=== summary"
  cat "$MPIGOSSIP_STEPS"
  ! grep -qE ': (FAILED|TIMED OUT)' "$MPIGOSSIP_STEPS"
}

step_cleanup() {  # remove the file if this script made it
  [ "${STEPS_OWNER:-0}" = 1 ] && rm -f "$MPIGOSSIP_STEPS"
  return 0
}
