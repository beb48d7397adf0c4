"""``python -m mpigossip reproduce``: the verdict rules on made-up runs (each direction), and
the quick mode end to end (report, figures, verdicts equal to the rules applied to the
recorded runs)."""

import json
import os
import subprocess
import sys

import pytest

from mpigossip.reproduce import findings as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(algorithm, p, lr, seed, level, final_acc=0.8, consensus=0.1, ms=10.0, case=None):
    """A made-up run whose test loss curve sits at ``level`` (lower = faster)."""
    curve = [{"steps": s, "time_s": s * ms / 1e3, "loss": 2.0 if s == 0 else level * (1 + 1 / s),
              "accuracy": final_acc * min(1, s / 50), "consensus": consensus} for s in (0, 10, 20, 50)]
    r = {"algorithm": algorithm, "world_size": p, "lr": lr, "seed": seed, "steps": 50, "curve": curve,
         "final_loss": curve[-1]["loss"], "final_accuracy": final_acc, "consensus_distance": consensus,
         "time_per_step_s": ms / 1e3, "wall_time_s": 50 * ms / 1e3, "comm_time_s": 0.1}
    if case:
        r["case"] = case
    return r


def grid(levels, p=8, lr=0.3, seeds=(0, 1, 2), jitter=0.0):
    return [run(a, p, lr, s, level + jitter * (s - 1)) for a, level in levels.items() for s in seeds]


def test_a_reproduced_not_and_partly():
    fast_async = grid({"allreduce": 1.0, "easgd": 0.8, "gossip-push": 0.7})
    assert F.speed(fast_async, 8, 0.3, "a", "").verdict == F.REPRODUCED
    slow_async = grid({"allreduce": 0.7, "easgd": 0.8, "gossip-push": 0.9})
    assert F.speed(slow_async, 8, 0.3, "a", "").verdict == F.NOT
    # easgd ahead only within the seeds' spread, gossip clearly behind
    mixed = grid({"allreduce": 1.0, "easgd": 0.99}, jitter=0.05) + grid({"gossip-push": 1.3})
    assert F.speed(mixed, 8, 0.3, "a", "").verdict == F.PARTLY


def test_b_needs_allreduce_faster_and_more_accurate():
    assert F.speed(grid({"allreduce": 0.5, "easgd": 0.8, "gossip-pull": 0.9}, lr=0.01), 8, 0.01, "b",
                   "").verdict == F.REPRODUCED
    assert F.speed(grid({"allreduce": 0.9, "easgd": 0.8}, lr=0.01), 8, 0.01, "b", "").verdict == F.NOT


def test_c_same_minimum_and_easgd_best():
    recs = grid({"allreduce": 1.0, "easgd": 0.95, "gossip-push": 1.05}, jitter=0.001)
    assert F.same_minimum(recs, 8).verdict == F.REPRODUCED
    far = grid({"allreduce": 1.0, "easgd": 2.0, "gossip-push": 1.05})
    f = F.same_minimum(far, 8)
    assert f.verdict == F.NOT and f.rows[0][0] == "allreduce"


def test_d_easgd_degrading_with_p():
    recs = grid({"allreduce": 1.0, "easgd": 1.0, "gossip-push": 1.0}, p=8, lr=0.01) + \
        grid({"allreduce": 1.0, "easgd": 1.3, "gossip-push": 1.1}, p=16, lr=0.01)
    assert F.easgd_scaling(recs, 8, 16, 0.01).verdict == F.REPRODUCED
    better = grid({"allreduce": 1.0, "easgd": 1.2, "gossip-push": 1.0}, p=8, lr=0.01) + \
        grid({"allreduce": 1.0, "easgd": 1.0, "gossip-push": 1.1}, p=16, lr=0.01)
    assert F.easgd_scaling(better, 8, 16, 0.01).verdict == F.NOT


def test_e_accuracy_gap_and_timing_judged_only_on_a_cluster():
    recs = [run("allreduce", 8, 0.3, 0, 1.0, final_acc=0.80), run("sgp", 8, 0.3, 0, 1.0, final_acc=0.795)]
    timed = [run("allreduce", 8, 0.3, 0, 1.0, ms=100, case="normal"), run("sgp", 8, 0.3, 0, 1.0, ms=150, case="normal")]
    assert F.sgp(recs, timed, timed_on_cluster=False).verdict == F.REPRODUCED  # timing shown, not judged
    assert F.sgp(recs, timed, timed_on_cluster=True).verdict == F.PARTLY      # SGP slower per step
    low = [run("allreduce", 8, 0.3, 0, 1.0, final_acc=0.80), run("sgp", 8, 0.3, 0, 1.0, final_acc=0.75)]
    assert F.sgp(low, [], timed_on_cluster=False).verdict == F.NOT


def test_straggler_rule():
    timed = [run(a, 4, 0.3, 0, 1.0, ms=ms, case=c) for a, ms, c in
             (("allreduce", 10, "normal"), ("allreduce", 20, "straggler"), ("osgp", 10, "normal"),
              ("osgp", 11, "straggler"))]
    f = F.Finding("e", "", "", "")
    assert F.timing_checks(f, timed) == [(True, True)]
    assert "osgp keeps 0.91" in f.rows[-1][1]
    osgp_slow = timed[:3] + [run("osgp", 4, 0.3, 0, 1.0, ms=18, case="straggler")]
    assert F.timing_checks(F.Finding("e", "", "", ""), osgp_slow) == [(False, False)]
    # a straggler that hardly slows AllReduce tests nothing: not judged
    mild = [dict(r, time_per_step_s=0.0105) if r["case"] == "straggler" else r for r in timed]
    g = F.Finding("e", "", "", "")
    assert F.timing_checks(g, mild) == [] and "not judged" in g.rows[-1][-1]


def test_problem_flags_synthetic_or_cifar(tmp_path):
    from mpigossip.reproduce import experiments as E
    from mpigossip.train import cli
    from mpigossip.__main__ import parse
    assert E.problem() == E.PROBLEM
    cifar = E.problem(str(tmp_path))
    assert cifar == ("--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", "cnn")
    for flags in (E.PROBLEM, cifar):  # both are valid compare command lines
        args = parse(["compare", "--algorithms", "sgp", "--lrs", "0.1", *flags])
        cli.check_arguments(args, ["sgp"], [0.1], 4)


def test_reproduce_reports_a_failed_job(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(tmp_path),
                        "--mpiexec", "false"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "job failed" in p.stderr and "jobs.log" in p.stderr


@pytest.mark.reproduce
@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
                    reason="needs the venv's mpiexec")
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (out / "report.md").read_text()
    with open(out / "results.json") as f:
        res = json.load(f)
    assert {r["world_size"] for r in res["accuracy_runs"]} == {4, 8, 16}
    judged = F.judge(res["accuracy_runs"], res["timed_runs"], res["simulator"], timed_on_cluster=False)
    assert [f.key for f in judged] == ["a", "b", "c", "d", "d-sim", "e"]
    for f in judged:  # the report states exactly the verdicts the rules give on the recorded runs
        assert f"| {f.key} | {f.claim} | **{f.verdict}** |" in text
        assert f.verdict in (F.REPRODUCED, F.PARTLY, F.NOT)
    for name in ("curves-p4.png", "curves-p8.png", "curves-p16.png", "timed.png", "sim-consensus.png",
                 "sim-scaling.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in text
    for r in res["accuracy_runs"]:
        assert 0 <= r["final_accuracy"] <= 1 and r["curve"][0]["steps"] == 0 and r["curve"][-1]["steps"] == 80
