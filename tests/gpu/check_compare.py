"""Compare two ``compare.json`` files (a GPU run against the same run on the CPU).

    python tests/gpu/check_compare.py CPU_DIR GPU_DIR [--accuracy-drop 0.02] [--distance-factor 3]

For every algorithm in the CPU run: the GPU run has it, reached a test accuracy within
``--accuracy-drop`` of the CPU's, and a consensus distance at most ``--distance-factor``
times the CPU's (plus 0.05 for algorithms whose distance is near zero). Prints one line per
algorithm and exits 1 if any fails. (What an earlier GPU run saw: EASGD at 0.10 accuracy and OSGP at
15-30x the CPU's consensus distance on the GPU.)
"""

import argparse
import json
import os
import sys


def load(folder):
    with open(os.path.join(folder, "compare.json")) as f:
        return {(s["algorithm"], s["lr"]): s for s in json.load(f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cpu")
    parser.add_argument("gpu")
    parser.add_argument("--accuracy-drop", type=float, default=0.02)
    parser.add_argument("--distance-factor", type=float, default=3.0)
    args = parser.parse_args()
    cpu, gpu = load(args.cpu), load(args.gpu)
    failed = 0
    for key, c in cpu.items():
        g = gpu.get(key)
        name = f"{key[0]} lr {key[1]:g}"
        if g is None:
            print(f"FAIL {name}: missing from the GPU run")
            failed += 1
            continue
        problems = []
        if not g["final_accuracy"] >= c["final_accuracy"] - args.accuracy_drop:
            problems.append(f"accuracy {g['final_accuracy']:.4f} vs {c['final_accuracy']:.4f} on the CPU")
        bound = args.distance_factor * c["consensus_distance"] + 0.05
        if not g["consensus_distance"] <= bound:
            problems.append(f"consensus distance {g['consensus_distance']:.3g} > {bound:.3g} "
                            f"(CPU {c['consensus_distance']:.3g})")
        status = "FAIL" if problems else "ok  "
        failed += bool(problems)
        print(f"{status} {name}: accuracy {g['final_accuracy']:.4f} (CPU {c['final_accuracy']:.4f}), consensus "
              f"distance {g['consensus_distance']:.3g} (CPU {c['consensus_distance']:.3g})"
              + ("".join(f"; {p}" for p in problems)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
