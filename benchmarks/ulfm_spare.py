"""Does a spawn onto a spare node work under Slurm? The minimal reproducer of the spare-node
fault of #45 (docs/CLUSTER.md: with ``SPARES=1``, Open MPI 5.0.11's launcher lost a survivor's
daemon in 4 of 7 training jobs), without the package.

    bash tests/cluster/start.sh 4 1gbit 2 && eval "$(bash tests/slurm/start.sh --cluster | grep ^export)"
    python benchmarks/ulfm_spare.py [--runs 4] [--where spare survivor] [--out benchmarks/results]

Each run submits ``benchmarks/ulfm_spare.sbatch`` (``sbatch --wait --nodes=4
--ntasks-per-node=1``): ``mpirun --with-ft ulfm`` starts 3 ranks of
``benchmarks/ulfm_respawn.py`` on the first 3 nodes, the last rank is killed, the survivors shrink
and spawn one process onto ``--where`` (the empty 4th node, or rank 0's node), merge, heal 16 MB
and check the grown communicator. The ``--where`` values alternate run by run. Appends one JSON
line per run to ``OUT/ulfm-spare-slurm.jsonl`` (the commit, the versions, where, whether the job
grew back to 3 ranks with the check true, the launcher's exit, the PMIx and lost-daemon lines seen)
and prints the tally.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpigossip.core import provenance  # noqa: E402

PMIX = "pmix_server_dyn.c"
LOST = "lost communication with a remote daemon"


def one(where, env, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "job.log")
        try:
            proc = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes=4", "--ntasks-per-node=1", "-o", log,
                                   os.path.join(HERE, "ulfm_spare.sbatch")], capture_output=True, text=True,
                                  env=dict(env, WHERE=where, PYTHON=sys.executable), cwd=ROOT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    survivors = [x for x in lines if x.get("role") == "survivor"]
    grew = bool(survivors) and all(x.get("check") and x.get("final_size") == 3 for x in survivors) and len(survivors) == 2
    exit_line = [x for x in text.splitlines() if x.startswith("ulfm_spare: exit")]
    return {"where": where, "grew_back": grew, "sbatch_exit": code,
            "mpirun_exit": int(exit_line[-1].split()[-1]) if exit_line else None,
            "pmix_error": PMIX in text, "lost_daemon": LOST in text,
            "spawn_host": survivors[0].get("spawn_host") if survivors else None,
            "spawn_s": survivors[0].get("spawn_s") if survivors else None,
            "newcomer": [x for x in lines if x.get("role") == "newcomer"][:1],
            "tail": [x[-300:] for x in text.splitlines()[-6:]] if not grew or not exit_line or exit_line[-1] != "ulfm_spare: exit 0" else []}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4, help="runs of each --where")
    p.add_argument("--where", nargs="+", choices=["spare", "survivor"], default=["spare", "survivor"])
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one job may take")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print("ulfm_spare: no Slurm here (see the usage in this file's docstring)", file=sys.stderr)
        return 2
    meta = {"commit": provenance.commit(), "versions": provenance.versions()}
    tally = {w: [0, 0] for w in args.where}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ulfm-spare-slurm.jsonl"), "a") as f:
        for k in range(args.runs):
            for where in args.where:
                row = dict(one(where, os.environ, args.timeout), run=k, **meta)
                f.write(json.dumps(row) + "\n")
                f.flush()
                tally[where][0] += row["grew_back"]
                tally[where][1] += 1
                print(f"ulfm_spare: {json.dumps({k: v for k, v in row.items() if k not in ('versions',)})}", flush=True)
    for where, (ok, n) in tally.items():
        print(f"ulfm_spare: newcomer on {where}: grew back in {ok} of {n} runs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
