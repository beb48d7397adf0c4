"""Time to accuracy (mpigossip.sim.accuracy_time): the accuracy simulator's steps joined to the
time model's steps per second, and the command that maps which method is first."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpigossip import sim
from mpigossip.sim import accuracy_time as AT
from mpigossip.sim.timing import Costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = os.path.join(ROOT, "benchmarks", "results", "time-calibration-1gbit.json")


def small_problem(seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 4)) * 3
    y = rng.integers(0, 3, 600)
    return sim.SoftmaxRegression(centres[y] + rng.normal(size=(600, 4)), y, 3)


def test_steps_to_and_the_median_over_seeds():
    curve = {"steps": [0, 10, 20, 30], "accuracy": [0.1, 0.5, 0.8, 0.9]}
    assert AT.steps_to(curve, 0.8) == 20 and AT.steps_to(curve, 0.95) is None
    assert AT._median([10, 30, None]) == 30        # a run that never reached it counts as infinite
    assert AT._median([10, None, None]) is None    # most never reached it
    assert AT._median([10, 20]) == 15


def test_accuracy_steps_sets_the_target_from_allreduce():
    acc = AT.accuracy_steps(small_problem, [4, 8], schemes=["sgp", "gossip-pull"], steps=60, lr=0.2, seeds=(0, 1),
                            drop=0.02, evals=30)
    for p in (4, 8):
        assert set(acc[p]["steps"]) == {"allreduce", "sgp", "gossip-pull"}
        # AllReduce reaches its own final accuracy less the drop, by its last step at the latest
        assert acc[p]["steps"]["allreduce"] is not None and acc[p]["steps"]["allreduce"] <= 60
        assert 0 < acc[p]["target"] < 1


def test_time_to_accuracy_is_steps_over_rate_and_the_winner_is_the_first():
    """With the steps fixed by hand the rows are their steps at the time model's pace; the
    winner is the least time; faster links never make AllReduce slower to the target."""
    costs = Costs.load(CALIBRATION)
    accuracy = {4: {"target": 0.8, "steps": {"allreduce": 100.0, "sgp": 130.0, "gossip-pull": None}},
                8: {"target": 0.8, "steps": {"allreduce": 100.0, "sgp": 100.0, "gossip-pull": 400.0}}}
    rows = AT.time_to_accuracy(costs, accuracy, rates_gbit=[0.1, 1, 10], per_node=2, mb=4, compute=0.05,
                               methods=["allreduce", "sgp", "agp", "gossip-pull"], stragglers=(1.0,), time_steps=4)
    for r in rows:
        n = accuracy[r["ranks"]]["steps"][AT.CURVE_OF[r["method"]]]
        if n is None:
            assert r["seconds_to_target"] is None
        else:
            assert r["seconds_to_target"] == pytest.approx(n / r["steps_per_s"])
    assert all(r["steps_to_target"] == 130.0 for r in rows if r["method"] == "agp" and r["ranks"] == 4)  # SGP's
    best = AT.winners(rows)
    for (factor, p, rate), (method, seconds, vs_ar) in best.items():
        cell = [r for r in rows if (r["ranks"], r["rate_gbit"]) == (p, rate) and r["seconds_to_target"] is not None]
        assert seconds == min(r["seconds_to_target"] for r in cell) and method in {r["method"] for r in cell}
    for p in (4, 8):
        ar = [r["seconds_to_target"] for r in sorted(rows, key=lambda r: r["rate_gbit"])
              if r["ranks"] == p and r["method"] == "allreduce"]
        assert ar == sorted(ar, reverse=True)
    text = AT.markdown(rows, accuracy)
    assert "| 4 | 0.1 |" in text and "agp takes sgp's steps" in text
    with pytest.raises(ValueError, match="no accuracy scheme for \\['adpsgd'\\]"):
        AT.time_to_accuracy(costs, accuracy, rates_gbit=[1], per_node=2, mb=1, compute=0.05, methods=["adpsgd"])


def test_the_accuracy_command_writes_table_json_and_map(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mpigossip", "timemodel", "--costs", CALIBRATION, "--out",
                        str(tmp_path), "accuracy", "--ranks", "4", "8", "--per-node", "2", "--rate-gbit", "1", "10",
                        "--mb", "1", "--compute-ms", "50", "--methods", "allreduce", "sgp", "--steps", "3",
                        "--sim-steps", "40", "--seeds", "0"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "timemodel-accuracy.json").read_text())
    assert {r["method"] for r in data["rows"]} == {"allreduce", "sgp"} and set(data["accuracy"]) == {"4", "8"}
    assert data["meta"]["calibration"] == CALIBRATION
    assert (tmp_path / "timemodel-accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](timemodel-accuracy.png)" in (tmp_path / "timemodel-accuracy.md").read_text()


def test_steps_to_target_reads_simulator_records():
    def rec(scheme, p, seed, acc, lr=0.05):
        return {"scheme": scheme, "p": p, "seed": seed, "lr": lr, "steps": [0, 10, 20], "accuracy": acc}
    records = [rec("allreduce", 16, 0, [0.1, 0.7, 0.9]), rec("sgp", 16, 0, [0.1, 0.5, 0.895]),
               rec("easgd", 16, 0, [0.1, 0.2, 0.3]), rec("allreduce", 16, 0, [0.1, 0.1, 0.1], lr=1.0)]
    acc = AT.steps_to_target(records, lr=0.05, drop=0.01)
    assert acc == {16: {"target": pytest.approx(0.89), "steps": {"allreduce": 20.0, "sgp": 20.0, "easgd": None}}}
    with pytest.raises(ValueError, match="no AllReduce run at p = 16, seed 0, lr 0.05"):
        AT.steps_to_target(records[1:3], lr=0.05)


def test_measured_firsts_from_a_reproductions_timed_runs(tmp_path):
    """The method first to the reproduction's target (95% of the lowest final accuracy without
    a straggler), by the median over repeats, per case."""
    from mpigossip.sim.cli import measured_firsts

    def run(algorithm, case, repeat, times, final=0.8):
        curve = [{"time_s": t, "accuracy": a} for t, a in zip(times, (0.2, 0.5, 0.8))]
        return {"algorithm": algorithm, "case": case, "repeat": repeat, "world_size": 8, "final_accuracy": final,
                "curve": curve}
    timed = [run("allreduce", "normal", k, (1, 5, 9)) for k in range(3)]
    timed += [run("sgp", "normal", k, (1, 3, t)) for k, t in enumerate((6, 99, 7))]
    timed += [run("allreduce", "straggler", 0, (2, 9, 17)), run("agp", "straggler", 0, (1, 6, 10))]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"timed_runs": timed}))
    got = measured_firsts(str(path), 1.0)
    # target 0.76: reached at the third point; SGP's median over (6, 99, 7) is 7 < AllReduce's 9
    assert got == [(1.0, 8, 1.0, "sgp", "sgp 7.0 s, AllReduce 9.0 s"),
                   (2.0, 8, 1.0, "agp", "agp 10.0 s, AllReduce 17.0 s")]
