#!/usr/bin/env bash
# Rounding of the compressed formats in training: SGP (the sender keeps its error, stochastic
# rounding) and the parameters' AllReduce (nothing kept: the model snaps to the format's grid), in
# each format against float32, on Fashion-MNIST's MLP (width 256, 400 steps, lr 0.1), 5 seeds, 4
# ranks on one node (synchronous methods: the same training as across nodes at any link rate).
#
#   bash benchmarks/wire_rounding.sh [OUT_DIR] [RUNS_DIR]   # default benchmarks/results, a temporary folder
#
# Writes OUT_DIR/wire-rounding.{json,md} (about 5 minutes on 2 cores), keeping rows it did not rerun:
# allreduce-params refuses a format since this measurement, and its rows come from the run at 22e8824.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
RUNS=${2:-$(mktemp -d)}
PY=.venv/bin/python
for seed in 0 1 2 3 4; do
  for wire in none bf16 fp16 int8; do
    flags=(); [ "$wire" != none ] && flags=(--wire "$wire")
    out=$RUNS/s$seed-$wire
    [ -f "$out/compare.json" ] && continue
    timeout 1200 .venv/bin/mpigossip-mpiexec -n 4 "$PY" -m mpigossip compare --algorithms sgp \
      --dataset fashion-mnist --model mlp --width 256 --steps 400 --seed "$seed" --lrs 0.1 --eval-every 50 \
      --quiet "${flags[@]}" --out "$out" >"$out.log" 2>&1 || echo "failed: seed $seed, $wire" >&2
  done
done
"$PY" - "$RUNS" "$OUT" <<'PY'
import glob, json, os, sys
import numpy as np
sys.path.insert(0, ".")
from mpigossip.reproduce import setup
runs, out = sys.argv[1:]
acc = {}
for path in glob.glob(os.path.join(runs, "s*-*", "compare.json")):
    seed, wire = os.path.basename(os.path.dirname(path))[1:].split("-")
    for s in json.load(open(path)):
        acc.setdefault((s["algorithm"], wire), {})[int(seed)] = s["final_accuracy"]
path = os.path.join(out, "wire-rounding.json")
earlier = json.load(open(path)) if os.path.exists(path) else {"accuracy": {}}
merged = {k: v for k, v in earlier["accuracy"].items()}
merged.update({f"{a} {w}": {str(s): v for s, v in d.items()} for (a, w), d in acc.items()})
meta = {"commit": setup.commit(), "versions": setup.versions(), "command": "bash benchmarks/wire_rounding.sh",
        "ranks": 4, "steps": 400, "width": 256, "lr": 0.1, "machine": setup.machine(),
        "earlier": earlier.get("meta")}
json.dump({"meta": meta, "accuracy": merged}, open(path, "w"), indent=1)
lines = [f"Fashion-MNIST, MLP width 256, 400 steps, lr 0.1, 4 ranks on one node; final test accuracy of the mean "
         f"model per seed (`bash benchmarks/wire_rounding.sh` at {meta['commit']}, {meta['versions']}; the "
         "allreduce-params rows from the run at 22e8824, before it refused a format).", "",
         "| algorithm | format | mean | per seed | vs float32 (mean, min, max of the per-seed differences) |",
         "|---|---|---|---|---|"]
for alg in ("sgp", "allreduce-params"):
    base = merged.get(f"{alg} none", {})
    for wire in ("none", "bf16", "fp16", "int8"):
        a = merged.get(f"{alg} {wire}")
        if not a:
            continue
        seeds = sorted(set(a) & set(base), key=int)
        d = [100 * (a[s] - base[s]) for s in seeds]
        lines.append(f"| {alg} | {'float32' if wire == 'none' else wire} | {np.mean([a[s] for s in seeds]):.4f} | "
                     f"{' '.join(f'{a[s]:.4f}' for s in seeds)} | {np.mean(d):+.2f} ({min(d):+.2f}, {max(d):+.2f}) points |")
open(os.path.join(out, "wire-rounding.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
