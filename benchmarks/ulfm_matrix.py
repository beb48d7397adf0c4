"""Open MPI's ULFM under the settings a user could pick: which let the survivors of a killed
rank finish (benchmarks/ulfm_probe.py, launched afresh per run).

    python benchmarks/ulfm_matrix.py [--where node|cluster] [--repeats 3] [--limit 40]
        [--out benchmarks/results] [--name ulfm-node]

``node``: 4 ranks on this machine, shared memory (Open MPI's default transports) and TCP only
(``--mca btl tcp,self``). ``cluster`` (root): 4 emulated nodes at 1 Gbit, one rank each
(``tests/cluster/start.sh``; TCP between nodes). For each: message sizes 1 KB (eager), 1 MB and
16 MB (rendezvous), three ways of waiting (:data:`WAITS`), and two ways to end (``MPI_Finalize``,
or none: ``--no-finalize``). A run is: ``recovered`` (every survivor finished every step over 3 ranks and
the launcher ended), ``finalize hung`` (every survivor finished, then the launcher did not end
within the limit), ``aborted`` (an MPI error ended it; the first error line is kept) or
``hung``. Writes OUT/NAME.json (every run, the commit and versions) and OUT/NAME.md.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpigossip.reproduce import setup  # noqa: E402

PROBE = os.path.join(HERE, "ulfm_probe.py")
STEPS, RANKS, DIE = 20, 4, 5
#: How a step waits for its requests: one Waitall of all; the receives first and the sends only if
#: they succeeded; persistent requests (a completion in error does not deallocate them).
WAITS = {"all": ["--order", "all"], "recvs-first": ["--order", "recvs-first"], "persistent": ["--persistent"]}


def launch(where, transport):
    py = sys.executable
    if where == "cluster":
        return [os.path.join(ROOT, "tests/cluster/mpiexec"), "--with-ft", "ulfm", "-n", str(RANKS),
                "--map-by", "node", py, PROBE]
    extra = ["--mca", "btl", "tcp,self"] if transport == "tcp" else []
    return [os.path.join(os.path.dirname(py), "mpigossip-mpiexec"), "--with-ft", "ulfm", *extra, "-n", str(RANKS),
            py, PROBE]


def run_once(cmd, limit):
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        out, rc, timed_out = p.stdout + p.stderr, p.returncode, False
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        rc, timed_out = None, True
        subprocess.run(["pkill", "-9", "-f", PROBE], capture_output=True)
        subprocess.run(["pkill", "-9", "-f", "prterun|prted"], capture_output=True)
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"rank"')]
    done = [r for r in rows if r["steps"] == STEPS and r["size"] == RANKS - 1]
    if len(done) == RANKS - 1:
        outcome = "finalize hung" if timed_out else "recovered"
    else:
        outcome = "hung" if timed_out else "aborted"
    error = next((line.strip() for line in out.splitlines()
                  if "MPI_ERR" in line or "error occurred" in line or "Error" in line), None)
    recover = [rec["seconds"] for r in rows for rec in r["recoveries"]]
    detect = [e["t"] for r in rows for e in r["errors"]]
    return {"outcome": outcome, "rc": rc, "wall_s": round(wall, 2), "survivors_done": len(done),
            "recover_s_max": max(recover, default=None), "error": error if outcome != "recovered" else None,
            "first_error_t": min(detect, default=None)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--where", choices=("node", "cluster"), default="node")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=float, default=40.0, help="seconds before a run counts as hung")
    p.add_argument("--sizes", nargs="+", type=float, default=[0.001, 1.0, 16.0], help="MB per message")
    p.add_argument("--ends", nargs="+", choices=("finalize", "skip"), default=["finalize", "skip"],
                   help="how the survivors end: MPI_Finalize, or without it (mpi4py.rc.finalize = False)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default=None)
    a = p.parse_args()
    name = a.name or f"ulfm-{a.where}"
    transports = ["tcp"] if a.where == "cluster" else ["sm", "tcp"]
    if a.where == "cluster":
        subprocess.run(["bash", os.path.join(ROOT, "tests/cluster/start.sh"), str(RANKS), "1gbit", "1"], check=True)
    runs = []
    try:
        for transport in transports:
            for mb in a.sizes:
                for order in WAITS:
                    for end in a.ends:
                        for rep in range(a.repeats):
                            cmd = launch(a.where, transport) + ["--steps", str(STEPS), "--die", str(DIE), "--mb",
                                                                str(mb), *WAITS[order]]
                            cmd += ["--no-finalize"] if end == "skip" else []
                            row = {"where": a.where, "transport": transport, "mb": mb, "order": order, "end": end,
                                   "run": rep, **run_once(cmd, a.limit)}
                            print(json.dumps(row), flush=True)
                            runs.append(row)
    finally:
        if a.where == "cluster":
            subprocess.run(["bash", os.path.join(ROOT, "tests/cluster/stop.sh")])
        for f in os.listdir("/dev/shm"):
            if f.startswith("sm_segment."):
                try:
                    os.unlink(os.path.join("/dev/shm", f))
                except OSError:
                    pass
    command = " ".join(["benchmarks/ulfm_matrix.py"] + sys.argv[1:])
    info = {"meta": {"commit": setup.commit(), "versions": setup.versions(), "command": command,
                     "machine": f"{os.cpu_count()} cores"}, "runs": runs}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(info, f, indent=1)
    lines = [f"# ULFM: do the survivors of a killed rank go on? ({a.where})", "",
             f"`{info['meta']['command']}` at {info['meta']['commit']} ({info['meta']['versions']}).",
             f"{RANKS} ranks exchange with both ring neighbours for {STEPS} steps; rank {RANKS - 1} is killed "
             f"(SIGKILL) at step {DIE}; survivors revoke, shrink, agree and go on (benchmarks/ulfm_probe.py).", "",
             "| transport | message | wait | end | recovered | finalize hung | aborted | hung | recovery (max s) "
             "| first error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for transport in transports:
        for mb in a.sizes:
            for order in WAITS:
                for end in a.ends:
                    rs = [r for r in runs if (r["transport"], r["mb"], r["order"], r["end"]) == (transport, mb, order, end)]
                    count = {k: sum(r["outcome"] == k for r in rs)
                             for k in ("recovered", "finalize hung", "aborted", "hung")}
                    rec = max((r["recover_s_max"] for r in rs if r["recover_s_max"] is not None), default=None)
                    err = next((r["error"] for r in rs if r["error"]), "")
                    lines.append(f"| {transport} | {mb:g} MB | {order} | {end} | {count['recovered']}/{len(rs)} | "
                                 f"{count['finalize hung']} | {count['aborted']} | {count['hung']} | "
                                 f"{'' if rec is None else f'{rec:.3f}'} | {err[:90]} |")
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
