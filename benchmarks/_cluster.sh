# Sourced by the benchmarks' shell scripts (root): start_cluster RATE SLOTS [NODES] starts NODES
# (default 4) emulated nodes at RATE with SLOTS ranks each (tests/cluster/start.sh), removes them (and $TMP, if set) on any
# exit, and sets PY (the venv's python, absolute: the ranks start in other namespaces) and
# rate_gbit (RATE in Gbit/s, e.g. 100mbit -> 0.1).
PY=$(pwd)/.venv/bin/python
start_cluster() {
  trap 'bash tests/cluster/stop.sh; [ -n "${TMP:-}" ] && rm -rf "$TMP"' EXIT
  bash tests/cluster/start.sh "${3:-4}" "$1" "$2" || exit 1
  rate_gbit=$("$PY" -c "import re,sys; m=re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1]); \
print(float(m.group(1)) * {'': 1e-9, 'k': 1e-6, 'm': 1e-3, 'g': 1}[m.group(2)])" "$1")
}
