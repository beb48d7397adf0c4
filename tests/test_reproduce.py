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


def test_a_reproduced_not_partly_and_undecided():
    fast_async = grid({"allreduce": 1.0, "easgd": 0.8, "gossip-push": 0.7})
    assert F.speed(fast_async, 0.3, "a", "").verdict == F.REPRODUCED
    slow_async = grid({"allreduce": 0.7, "easgd": 0.8, "gossip-push": 0.9})
    assert F.speed(slow_async, 0.3, "a", "").verdict == F.NOT
    # easgd ahead only within the seeds' spread, gossip clearly behind: one sub-claim contradicted
    mixed = grid({"allreduce": 1.0, "easgd": 0.99}, jitter=0.05) + grid({"gossip-push": 1.3})
    assert F.speed(mixed, 0.3, "a", "").verdict == F.NOT
    # easgd clearly ahead, gossip ahead in one seed and behind in another: partly
    partly = grid({"allreduce": 1.0, "easgd": 0.8}) + [run("gossip-push", 8, 0.3, s, v)
                                                       for s, v in ((0, 0.8), (1, 1.2), (2, 1.0))]
    f = F.speed(partly, 0.3, "a", "")
    assert f.verdict == F.PARTLY and [d.outcome for d in f.decisions] == [F.HOLDS, F.UNDECIDED]
    # one seed decides nothing, however large the difference
    assert F.speed(grid({"allreduce": 1.0, "easgd": 0.5, "gossip-push": 0.5}, seeds=(0,)), 0.3, "a",
                   "").verdict == F.UNDECIDED_V


def test_a_is_judged_at_every_p():
    recs = grid({"allreduce": 1.0, "easgd": 0.8, "gossip-push": 0.7}, p=4) + \
        grid({"allreduce": 1.0, "easgd": 1.2, "gossip-push": 0.7}, p=16)
    f = F.speed(recs, 0.3, "a", "")
    assert f.verdict == F.NOT and len(f.decisions) == 4
    assert [d.outcome for d in f.decisions] == [F.HOLDS, F.HOLDS, F.CONTRADICTED, F.HOLDS]


def test_b_needs_allreduce_faster_and_more_accurate():
    assert F.speed(grid({"allreduce": 0.5, "easgd": 0.8, "gossip-pull": 0.9}, lr=0.01), 0.01, "b",
                   "").verdict == F.REPRODUCED
    assert F.speed(grid({"allreduce": 0.9, "easgd": 0.8}, lr=0.01), 0.01, "b", "").verdict == F.NOT


def test_paired_decision_rule():
    assert F.Decision("", [-0.1, -0.12, -0.09]).outcome == F.HOLDS
    assert F.Decision("", [0.1, 0.12, 0.09]).outcome == F.CONTRADICTED
    assert F.Decision("", [-0.1, 0.1, -0.05]).outcome == F.UNDECIDED
    assert F.Decision("", [-0.5]).outcome == F.UNDECIDED and F.Decision("", []).outcome == F.UNDECIDED
    assert F.Decision("", [0.004, 0.005, 0.006], 0.01).outcome == F.HOLDS  # below a threshold
    assert F.verdict([]) == F.UNTESTED
    assert F.verdict([F.Decision("", [-1, -1.1]), F.Decision("", [])]) == F.PARTLY  # a sub-claim not run lowers it


def test_c_same_minimum_and_easgd_best():
    recs = grid({"allreduce": 1.0, "easgd": 0.95, "gossip-push": 1.05}, jitter=0.001)
    assert F.same_minimum(recs, 8).verdict == F.REPRODUCED
    far = grid({"allreduce": 1.0, "easgd": 2.0, "gossip-push": 1.05})
    f = F.same_minimum(far, 8)
    assert f.verdict == F.NOT and f.rows[0][0] == "allreduce"


def test_d_easgd_degrading_with_p_at_every_step_size():
    recs = grid({"allreduce": 1.0, "easgd": 1.0, "gossip-push": 1.0}, p=8, lr=0.01) + \
        grid({"allreduce": 1.0, "easgd": 1.3, "gossip-push": 1.1}, p=16, lr=0.01)
    assert F.easgd_scaling(recs, 8, 16).verdict == F.REPRODUCED
    better = grid({"allreduce": 1.0, "easgd": 1.2, "gossip-push": 1.0}, p=8, lr=0.01) + \
        grid({"allreduce": 1.0, "easgd": 1.0, "gossip-push": 1.1}, p=16, lr=0.01)
    assert F.easgd_scaling(better, 8, 16).verdict == F.NOT
    # degrading at the small step size only: the large one contradicts it
    large = grid({"allreduce": 1.0, "easgd": 1.2, "gossip-push": 1.0}, p=8, lr=0.3) + \
        grid({"allreduce": 1.0, "easgd": 1.0, "gossip-push": 0.9}, p=16, lr=0.3)
    f = F.easgd_scaling(recs + large, 8, 16)
    assert f.verdict == F.NOT and len(f.decisions) == 4


def test_d_sim_with_time_is_the_simulators_steps_over_the_time_models_pace():
    def rec(scheme, p, acc, ranks=None):
        return {"scheme": scheme, "p": p, "lr": 0.05, "seed": 0, "steps": [0, 10, 20, 30], "accuracy": acc,
                "rank_accuracy": ranks or acc, "loss": [2.0, 1.0, 0.9, 0.8 if scheme != "easgd" else 0.95]}
    sims = [rec(s, p, [0.1, 0.5, 0.8, 0.8], ranks=[0.1, 0.2, 0.6, 0.8] if s == "sgp" else None)
            for p in (4, 16) for s in ("allreduce", "sgp", "gossip-push", "gossip-pull", "easgd")]
    speeds = [{"ranks": p, "method": m, "steps_per_s": v} for p in (4, 16)
              for m, v in (("allreduce", 2.0), ("sgp", 4.0), ("gossip-pull", 5.0), ("easgd", 1.0))]
    f = F.easgd_scaling_sim(sims, speeds, "setting X")
    text = "\n".join(f.extra)
    # target: the best of AllReduce's first half (0.5) less 0.01; AllReduce at step 10 at 2 steps/s: 5 s;
    # SGP's own models at step 20 at 4 steps/s; gossip push has no time
    assert "| 0.05 | 4 | 0.490 | 5.0 (10) | 5.0 (20) | (10) | 2.0 (10) | 10.0 (10) |" in text
    assert "setting X" in text and "gossip-push: not in the time model" in text
    assert F.easgd_scaling_sim(sims).extra == []     # without speeds: steps are judged as before, no times


def test_e_accuracy_gap_and_timing_judged_only_on_a_cluster():
    recs = grid({"allreduce": 1.0, "sgp": 1.0})
    recs = [dict(r, final_accuracy=0.80 if r["algorithm"] == "allreduce" else 0.795) for r in recs]
    timed = [dict(run(a, 8, 0.3, 0, 1.0, ms=ms + k, case="normal"), repeat=k)
             for a, ms in (("allreduce", 100), ("sgp", 150)) for k in range(3)]
    assert F.sgp(recs, timed, timed_on_cluster=False).verdict == F.REPRODUCED  # timing shown, not judged
    assert F.sgp(recs, timed, timed_on_cluster=True).verdict == F.NOT          # SGP clearly slower per step
    low = [dict(r, final_accuracy=0.75) if r["algorithm"] == "sgp" else r for r in recs]
    assert F.sgp(low, [], timed_on_cluster=False).verdict == F.NOT


def _timed(keeps):
    """Timed runs over 3 repeats: each algorithm 10 ms a step, and 10 / keep with the straggler."""
    return [dict(run(a, 4, 0.3, 0, 1.0, ms=ms * (1 + 0.01 * k), case=c), repeat=k)
            for a, keep in keeps.items() for c, ms in (("normal", 10), ("straggler", 10 / keep)) for k in range(3)]


def test_straggler_rule_with_its_negative_control():
    f = F.Finding("e", "", "", "")
    checks = F.timing_checks(f, _timed({"allreduce": 0.5, "sgp": 0.5, "osgp": 0.91}))
    assert checks[-1].outcome == F.HOLDS and "osgp 0.91" in f.rows[-1][1]
    assert F.timing_checks(F.Finding("e", "", "", ""),
                           _timed({"allreduce": 0.5, "sgp": 0.5, "osgp": 0.55}))[-1].outcome == F.CONTRADICTED
    # synchronous SGP keeping 0.95: the measurement cannot tell tolerance apart, not decided
    g = F.Finding("e", "", "", "")
    checks = F.timing_checks(g, _timed({"allreduce": 0.5, "sgp": 0.95, "osgp": 0.95}))
    assert checks[-1].outcome == F.UNDECIDED and any("control" in n for n in g.notes)


def test_problem_flags_fashion_synthetic_or_cifar(tmp_path):
    from mpigossip.__main__ import parse
    from mpigossip.reproduce import experiments as E
    from mpigossip.train import cli
    assert E.problem() == E.FASHION and E.problem("synthetic") == E.PROBLEM
    assert E.problem("fashion-mnist", str(tmp_path)) == E.FASHION + ("--data-dir", str(tmp_path))
    cifar = E.problem("cifar10", str(tmp_path))
    assert cifar == ("--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", "cnn")
    with pytest.raises(ValueError, match="--data-dir"):
        E.problem("cifar10")
    for flags in (E.FASHION, E.PROBLEM, cifar):  # each a valid compare command line
        args = parse(["compare", "--algorithms", "sgp", "--lrs", "0.1", *flags])
        cli.check_arguments(args, ["sgp"], [0.1], 4)


def test_resume_reuses_a_finished_job_and_reruns_an_incomplete_one(tmp_path):
    from mpigossip.reproduce import experiments as E
    out = tmp_path / "job"
    out.mkdir()
    summaries = [{"algorithm": a, "lr": 0.1} for a in ("allreduce", "sgp")]
    (out / "compare.json").write_text(json.dumps(summaries))
    with open(tmp_path / "jobs.log", "w") as log:
        launcher = E.Launcher(["false"], log, resume=True)  # would fail if it launched
        assert launcher.compare(4, str(out), ("allreduce", "sgp"), (0.1,), 10) == summaries
        with pytest.raises(RuntimeError, match="job failed"):  # a third algorithm: not all there, runs again
            launcher.compare(4, str(out), ("allreduce", "sgp", "osgp"), (0.1,), 10)
    assert "reused" in (tmp_path / "jobs.log").read_text()


def test_accuracy_from_reuses_only_this_modes_grid(tmp_path):
    """--accuracy-from: an earlier run's accuracy records are taken only if they hold the whole
    grid the mode would run; anything else is refused with one line (exit 1), before any job."""
    from mpigossip import reproduce
    from mpigossip.reproduce import experiments as E
    quick = E.for_problem(E.SETTINGS["quick"], "fashion-mnist")
    grid = [{"world_size": p, "lr": lr, "seed": seed, "steps": quick["steps"], "curve": []}
            for p in quick["sizes"] for lr in quick["lrs"] for seed in quick["seeds"]]
    good = tmp_path / "results.json"
    good.write_text(json.dumps({"accuracy_runs": grid}))
    assert reproduce.reused_accuracy_runs(str(good), quick) == grid
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"accuracy_runs": grid[1:]}))
    with pytest.raises(ValueError, match="not this mode's grid"):
        reproduce.reused_accuracy_runs(str(short), quick)
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(tmp_path / "r"),
                        "--accuracy-from", str(short), "--mpiexec", "false"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "not this mode's grid" in p.stderr, p.stderr
    assert not (tmp_path / "r" / "jobs.log").read_text()  # nothing launched


def test_timed_from_reuses_every_case_and_repeat_and_says_where_they_ran(tmp_path):
    """--timed-from: an earlier run's timed records are taken only if every case and repeat of
    the mode is there at its size and steps; where they ran comes from the file's record, or
    for an older file from the report written beside it; anything else is refused (exit 1)."""
    from mpigossip import reproduce
    from mpigossip.reproduce import experiments as E
    quick = E.for_problem(E.SETTINGS["quick"], "fashion-mnist")
    timed = [{"case": case, "repeat": k, "world_size": quick["timed_size"], "steps": quick["timed_steps"],
              "algorithm": "allreduce"} for case in quick["timed_cases"] for k in range(quick["timed_repeats"])]
    line = "- timed runs: `tests/cluster/mpiexec` (emulated cluster: 4 nodes), 8 ranks"
    on = {"line": line, "on_cluster": True}
    new = tmp_path / "new" / "results.json"
    new.parent.mkdir()
    new.write_text(json.dumps({"timed_runs": timed, "timed_on": on}))
    assert reproduce.reused_timed_runs(str(new), quick) == (timed, on)
    old = tmp_path / "old" / "results.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"timed_runs": timed}))
    with pytest.raises(ValueError, match="does not say where"):
        reproduce.reused_timed_runs(str(old), quick)
    (old.parent / "report.md").write_text("# report\n\n" + line + "\n- simulator: ...\n")
    assert reproduce.reused_timed_runs(str(old), quick) == (timed, on)
    (old.parent / "report.md").write_text(line.replace("(emulated cluster: 4 nodes)", "(this machine)")
                                          + " (on this machine: communication is nearly free here)\n")
    assert reproduce.reused_timed_runs(str(old), quick)[1]["on_cluster"] is False
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"timed_runs": timed[1:], "timed_on": on}))
    with pytest.raises(ValueError, match="not this mode's"):
        reproduce.reused_timed_runs(str(short), quick)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"timed_runs": [dict(r, steps=r["steps"] + 1) for r in timed], "timed_on": on}))
    with pytest.raises(ValueError, match="not this mode's"):
        reproduce.reused_timed_runs(str(other), quick)
    grid = [{"world_size": p, "lr": lr, "seed": seed, "steps": quick["steps"], "curve": []}
            for p in quick["sizes"] for lr in quick["lrs"] for seed in quick["seeds"]]
    short.write_text(json.dumps({"accuracy_runs": grid, "timed_runs": timed[1:], "timed_on": on}))
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(tmp_path / "r"),
                        "--accuracy-from", str(short), "--timed-from", str(short), "--mpiexec", "false"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "--timed-from" in p.stderr and "not this mode's" in p.stderr, p.stderr
    assert not (tmp_path / "r" / "jobs.log").read_text()  # nothing launched


def test_reproduce_reports_a_failed_job(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(tmp_path),
                        "--mpiexec", "false"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "job failed" in p.stderr and "jobs.log" in p.stderr


@pytest.mark.reproduce
@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
                    reason="needs the venv's mpiexec")
@pytest.mark.skipif(not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"),
                    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist (tests/run.sh does, "
                    "as root)")
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "-m", "mpigossip", "reproduce", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (out / "report.md").read_text()
    with open(out / "results.json") as f:
        res = json.load(f)
    assert {r["world_size"] for r in res["accuracy_runs"]} == {2, 4}
    assert "Quick mode is a smoke test of the pipeline, not a reproduction" in text
    judged = F.judge(res["accuracy_runs"], res["timed_runs"], res["simulator"], timed_on_cluster=False)
    assert [f.key for f in judged] == ["a", "b", "c", "d", "d-sim", "e"]
    # (d-sim) with time: the time model's steps per second of the simulated schemes at each simulated p
    assert {(r["ranks"], r["method"]) for r in res["simulator_speeds"]} == {
        (p, m) for p in (4, 16, 64) for m in ("allreduce", "sgp", "gossip-pull", "easgd")}
    assert "Predicted time to the target (the time model calibrated in `time-calibration-1gbit.json`" in text
    for f in judged:  # the report states exactly the verdicts the rules give on the recorded runs
        assert f"| {f.key} | {f.claim} | **{f.verdict}** |" in text
        assert f.verdict in (F.REPRODUCED, F.PARTLY, F.NOT, F.UNDECIDED_V, F.UNTESTED)
    for name in ("curves-p2.png", "curves-p4.png", "timed.png", "sim-consensus.png",
                 "sim-scaling.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in text
    for r in res["accuracy_runs"]:
        assert 0 <= r["final_accuracy"] <= 1 and r["curve"][0]["steps"] == 0 and r["curve"][-1]["steps"] == 80
