"""Soak: every method that survives a dead rank, trained for 20,000 steps, with and without a
failure in the middle, asserting what must hold at any horizon.

    python benchmarks/soak.py [--steps 20000] [--ranks 4] [--algorithms sgp osgp agp ...]
        [--cases none kill replace replace-two] [--out benchmarks/results] [--name soak] [--runs DIR]

Each method trains the digits MLP (``python -m mpigossip train``) on ``--ranks`` ranks of
this machine once per case: ``none``, a plain launch; ``kill``, a fault-tolerant one
(``mpigossip-mpiexec --with-ft ulfm``, ``--on-failure continue``) where the last rank is
killed (SIGKILL) half way; ``replace``, the same under ``--on-failure replace`` (the job grows
back); ``replace-two``, the last two ranks killed together and both replaced (Σw falls to about
half, and the heal rescales every ``(x, w)`` by 2); ``replace-while-joining``, the last rank
killed half way and rank 1 while its newcomer starts (that newcomer given up, both replaced in
one growth). Every run must end with exit status 0 and:

* a model that still trains: test accuracy >= 0.9 on the digits;
* the PushSum family (SGP, OSGP, AGP): the smallest weight any rank held after a step at or
  above 2^-11 (AGP's floor, ``min_weight``, is 2^-10 of the initial weight; without it a rank's
  weight reached 1e-150 and 0.0 within 3,000 steps), and exact mass: after the final drain
  Σw is the world size (no failure), or the world size less the weight the recovery reports
  lost, which is at least the dead rank's own weight at its death (its last metrics record);
* after a failure: the survivors end at the reduced size, the failure recorded once; under
  replace: at the full size, each newcomer's parameters its donor's at the heal (``as_donor``),
  and with half the ranks dead (PushSum family) the heal's ``scaled_by`` above 1.

Writes ``OUT/NAME.json`` (every run's summary, the checks, the commit and versions) and
``OUT/NAME.md`` (a table: per method and case, accuracy, steps per second, the smallest
weight, the weight lost against the dead rank's own, the recovery time); exits 1 if a check
failed. ``tests/test_train.py`` runs a bounded version (a few methods, fewer steps) in the
test command; this is the full one, about 3 minutes a run here (2 cores).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpigossip.core import provenance  # noqa: E402
from mpigossip.train.handover import weight_accounted  # noqa: E402

#: The methods that survive a dead rank (``--on-failure continue``): (name, train flags).
METHODS = {
    "sgp": [],
    "osgp": [],
    "agp": [],
    "gossip-push": [],
    "dpsgd": [],
    "allreduce": [],
    "slowmo:sgp": ["--base", "sgp"],
    "diloco:gossip-push": ["--base", "gossip-push"],
}
PUSHSUM = {"sgp", "osgp", "agp"}
#: The methods ``--on-failure replace`` grows back (the others are left out of the replace cases).
REPLACEABLE = {"sgp", "osgp", "agp", "dpsgd", "allreduce", "slowmo:sgp"}
FLOOR = 2.0 ** -11
#: case: (on_failure, how many ranks die at once, half way: the last ones). ``replace-two``: two of
#: the ranks die together, Σw falls to about half the ranks, and the heal rescales every
#: ``(x, w)`` by 2 (``scaled_by``), which the runs without it never exercise at length.
CASES = {"none": (None, 0), "kill": ("continue", 1), "replace": ("replace", 1), "replace-two": ("replace", 2),
         "replace-while-joining": ("replace", 1)}
#: case: the rank (of the launch) killed at its first step after the spawn, while the newcomer
#: starts (``MPIGOSSIP_KILL_WHILE_JOINING``): that newcomer given up, both dead replaced in one growth.
JOINING = {"replace-while-joining": 1}


def dead_ranks(case, ranks):
    """The ranks a case kills: the last ones half way, and the one killed while a newcomer starts."""
    dead = list(range(ranks - CASES[case][1], ranks))
    return sorted(dead + ([JOINING[case]] if case in JOINING else []))


def run(name, steps, ranks, case, folder, timeout):
    """One training run; returns (exit status, summary or None, the dead ranks' last weights
    summed, seconds)."""
    algorithm = name.split(":")[0]
    launcher = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")
    on_failure, dead = CASES[case]
    victims = list(range(ranks - dead, ranks))
    cmd = [launcher, *(["--with-ft", "ulfm"] if dead else []), "-n", str(ranks), sys.executable, "-m", "mpigossip",
           "train", "--algorithm", algorithm, *METHODS[name], "--steps", str(steps), "--quiet", "--out", folder]
    if dead:
        cmd += ["--on-failure", on_failure, *[f"--kill={v}:{steps // 2}" for v in victims]]
    env = dict(os.environ)
    if case in JOINING:
        env["MPIGOSSIP_KILL_WHILE_JOINING"] = str(JOINING[case])
        cmd[1:1] = ["-x", "MPIGOSSIP_KILL_WHILE_JOINING"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.monotonic() - t0
    summary_path = os.path.join(folder, "summary.json")
    summary = json.load(open(summary_path)) if proc.returncode == 0 and os.path.exists(summary_path) else None
    dead_weight = None
    for victim in victims:   # its last record before the kill (a newcomer writes on after it in the same file)
        metrics = os.path.join(folder, f"metrics-rank{victim}.jsonl")
        if os.path.exists(metrics):
            last, before = None, -2
            for line in open(metrics):
                r = json.loads(line) if line.strip() else {}
                if not r or r["step"] >= steps // 2 or r["step"] <= before:
                    break
                before = r["step"]
                if "weights" in r:
                    last = r["weights"][0]
            if last is not None:
                dead_weight = (dead_weight or 0.0) + last
    return proc, summary, dead_weight, seconds


def checks(name, summary, dead_weight, ranks, case):
    """The checks of one run, as {name: bool}."""
    if summary is None:
        return {"finished": False}
    out = {"finished": True, "trains (>= 0.9)": summary["final_accuracy"] >= 0.9}
    failures = summary.get("failures", [])
    on_failure, dead = CASES[case]
    fail = bool(dead)
    if on_failure == "continue":
        out["one failure, survivors at the reduced size"] = (len(failures) == 1 and summary["world_size"] == ranks - 1)
    if on_failure == "replace":   # (ranks that drift, OSGP and AGP, may die apart: a failure each, replaced
        # one by one, or together where the second died before the first was replaced: the growth's record
        # is then the second failure's)
        healed = [f["replaced"] for f in failures if f.get("replaced")]
        out["the dead replaced, grown back to full size"] = (
            bool(failures) and summary["world_size"] == ranks
            and sorted(r for f in failures for r in f["ranks"]) == dead_ranks(case, ranks)
            and sorted(r for h in healed for r in h["ranks"]) == dead_ranks(case, ranks)
            and not any(h.get("refused") for h in healed))
        if case in JOINING:
            out["the first newcomer given up, both replaced in one growth"] = (
                len(failures) == 2 and (failures[0].get("abandoned") or {}).get("ranks") == [ranks - 1]
                and len(healed) == 1)
        out["newcomers start as their donors"] = bool(healed) and all(h.get("as_donor") is True for h in healed)
        if name in PUSHSUM:   # half the ranks lost at once: the heal brings Σw back by a factor of 2 or more
            out["heal rescaled (x, w) where half died at once"] = all(
                min(h.get("scaled_by") or [1.0]) > 1 for f in failures if len(f["ranks"]) >= ranks // 2
                for h in [f.get("replaced") or {}])
    if name in PUSHSUM:
        out["weights above 2^-11"] = summary.get("weight_min") is not None and summary["weight_min"] >= FLOOR
        lost = sum(f.get("weight_lost", 0.0) for f in failures)   # (each death's loss; the dead ranks' own summed)
        accounted = weight_accounted(summary)
        out["exact mass"] = all(abs(s - accounted) < 1e-9 for s in summary["weight_sum"])
        if fail and dead_weight is not None:
            out["lost >= the dead rank's own"] = lost >= dead_weight - 1e-9
    return out


def table(rows, steps, ranks):
    lines = [f"# Soak: {steps} steps on {ranks} ranks, with and without a failure half way", "",
             "| method | case | failures | (x, w) scaled by | accuracy | steps/s | smallest weight | weight lost | dead ranks' own "
             "| recovery (s) | checks |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"] or {}
        f = (s.get("failures") or [{}])[0]
        def fmt(v, spec):
            return "" if v is None else format(v, spec)
        case = r["case"]
        dead = CASES[case][1]
        said = ("no failure" if not dead else f"kill rank{'s' if dead > 1 else ''} "
                f"{', '.join(str(v) for v in range(ranks - dead, ranks))} at {steps // 2}"
                + (f", rank {JOINING[case]} while its newcomer starts" if case in JOINING else "")
                + (", replaced" if CASES[case][0] == "replace" else ""))
        scaled = None   # every rescale of (x, w): the recoveries' and the heals' (group 0)
        for x in s.get("failures", []):
            for c in (x.get("scaled_by"), ((x.get("replaced") or {}).get("scaled_by") or [None])[0]):
                scaled = scaled if c is None else (scaled or 1.0) * c
        lines.append(f"| {r['method']} | {said} | {len(s.get('failures', []))} | {fmt(scaled, 'g')} "
                     f"| {fmt(s.get('final_accuracy'), '.4f')} | {fmt(s.get('throughput_steps_s'), '.0f')} "
                     f"| {fmt(s.get('weight_min'), '.3g')} | {fmt(sum(x['weight_lost'] for x in s['failures']) if 'weight_lost' in f else None, '.3f')} "
                     f"| {fmt(r['dead_weight'], '.3f')} | {fmt(f.get('recovery_s', f.get('seconds')), '.3f')} "
                     f"| {'all pass' if all(r['checks'].values()) else 'FAILED: ' + ', '.join(k for k, v in r['checks'].items() if not v)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--algorithms", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--cases", nargs="+", default=["none", "kill"], choices=list(CASES))
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="soak")
    p.add_argument("--runs", default=None, help="folder for the runs' outputs (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    args = p.parse_args(argv)
    runs = args.runs or tempfile.mkdtemp(prefix="mpigossip-soak-")
    rows = []
    for name in args.algorithms:
        for case in args.cases:
            if CASES[case][0] == "replace" and name not in REPLACEABLE:
                continue
            folder = os.path.join(runs, f"{name.replace(':', '-')}-{case}")
            proc, summary, dead_weight, seconds = run(name, args.steps, args.ranks, case, folder, args.timeout)
            result = checks(name, summary, dead_weight, args.ranks, case)
            rows.append({"method": name, "case": case, "fail": bool(CASES[case][1]), "summary": summary,
                         "dead_weight": dead_weight,
                         "checks": result, "seconds": seconds,
                         "output_tail": None if summary else (proc.stdout + proc.stderr)[-3000:]})
            print(f"soak: {name} {case}: {'ok' if all(result.values()) else 'FAILED'} {result} ({seconds:.0f} s)",
                  flush=True)
            write(args, rows)   # after every run: a long soak cut short keeps what it measured
    return 0 if all(all(r["checks"].values()) for r in rows) else 1


def write(args, rows):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"commit": provenance.commit(), "versions": provenance.versions(), "steps": args.steps,
                   "ranks": args.ranks, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(table(rows, args.steps, args.ranks))
        f.write(f"\nCommit {provenance.commit()}; {provenance.versions()}.\n")


if __name__ == "__main__":
    sys.exit(main())
