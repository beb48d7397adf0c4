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
from mpigossip.sim.scaling import predict
from mpigossip.sim.timing import Costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = os.path.join(ROOT, "benchmarks", "results", "time-calibration-1gbit.json")


def small_problem(seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 4)) * 3
    y = rng.integers(0, 3, 600)
    return sim.SoftmaxRegression(centres[y] + rng.normal(size=(600, 4)), y, 3)


def test_steps_to_and_the_median_over_seeds():
    curve = {"steps": [0, 10, 20, 30], "accuracy": [0.1, 0.5, 0.8, 0.9], "rank_accuracy": [0.1, 0.2, 0.3, 0.85]}
    assert AT.steps_to(curve, 0.8) == 20 and AT.steps_to(curve, 0.95) is None
    assert AT.steps_to(curve, 0.8, "rank_accuracy") == 30
    assert AT._median([10, 30, None]) == 30        # a run that never reached it counts as infinite
    assert AT._median([10, None, None]) is None    # most never reached it
    assert AT._median([10, 20]) == 15


def test_mixing_of_each_method():
    assert AT.mixing_of("allreduce") == ("allreduce", 1, 0, None)
    assert AT.mixing_of("sgp") == ("sgp", 1, 0, None)          # SGP waits for its messages: it mixes every step
    assert AT.mixing_of("osgp:2") == ("sgp", 1, 2, None) and AT.mixing_of("osgp") == ("sgp", 1, 1, None)
    assert AT.mixing_of("agp", [1, 1, 2, 40]) == ("agp", 1, 0, (1, 1, 2, 40))   # its own messages' delays
    with pytest.raises(ValueError, match="agp: the accuracy simulator mixes it by the time model's message delays"):
        AT.mixing_of("agp")
    assert AT.label("sgp", 3, 1) == "sgp every 3 delay 1" and AT.label("allreduce") == "allreduce"
    assert AT.label("agp", delays=(1, 2)) == "agp delays 1,2" and AT.label("agp", delays=()) == "agp never"
    with pytest.raises(ValueError, match="no accuracy scheme for 'adpsgd'"):
        AT.mixing_of("adpsgd")


def test_agps_mixing_follows_the_time_models_schedule_of_its_messages():
    """Where the link cannot keep up, AGP's messages wait: the time model's delays between a
    share leaving and its receiver taking it in are many steps for the shares that cross a
    node's link (100 MB at 1 Gbit: ~7 s on the wire, ~28 steps of 0.25 s), one or two within a
    node or on a fast link. The old join mixed AGP as a PushSum round every 1 / moved steps,
    one round late, whatever the link."""
    costs = Costs.load(CALIBRATION)
    rows = predict(costs, ranks=[16], rates_gbit=[1, 100], per_node=8, mb=100, compute=0.1, methods=("agp",),
                   steps=10, stragglers=(1.0,))
    AT.assign_mixing(rows)
    slow, fast = sorted(rows, key=lambda r: r["rate_gbit"])
    assert slow["scheme"] == fast["scheme"] == "agp" and slow["tau"] == fast["tau"] == 1
    assert len(slow["delays"]) == 10 and slow["delays"] == sorted(slow["delays"])
    assert slow["delays"][-1] >= 20 and slow["delays"][0] <= 2     # between nodes late, within a node soon
    assert fast["delays"][-1] <= 3
    assert slow["mixing"] == "agp delays " + ",".join(map(str, slow["delays"]))
    from mpigossip.sim.scaling import delay_deciles
    assert delay_deciles(range(1, 101)) == [5, 15, 25, 35, 45, 55, 65, 75, 85, 95]
    assert delay_deciles([-2, -1, 3]) == [0, 0, 0, 0, 0, 0, 0, 3, 3, 3]   # a straggler's lag: taken at once
    assert delay_deciles([]) == []


def test_accuracy_steps_sets_the_target_from_allreduce():
    settings = {(4, "sgp", 1, 0, None), (8, "sgp", 1, 0, None), (8, "sgp", 4, 1, None), (4, "gossip-pull", 1, 0, None),
                (8, "agp", 1, 0, (1, 3))}
    acc = AT.accuracy_steps(small_problem, settings, steps=60, lr=0.2, seeds=(0, 1), drop=0.02, evals=30)
    assert set(acc[4]["steps"]) == {"allreduce", "sgp", "gossip-pull"}
    assert set(acc[8]["steps"]) == {"allreduce", "sgp", "sgp every 4 delay 1", "agp delays 1,3"}
    for p in (4, 8):
        # AllReduce reaches its best accuracy of its first half less the drop within that half
        assert acc[p]["steps"]["allreduce"] is not None and acc[p]["steps"]["allreduce"] <= 30
        assert 0 < acc[p]["target"] < 1


def test_steps_to_target_reads_simulator_records():
    def rec(scheme, seed, acc, ranks=None, tau=1, delay=0):
        return {"scheme": scheme, "p": 16, "seed": seed, "tau": tau, "delay": delay, "steps": [0, 10, 20, 30, 40],
                "accuracy": acc, "rank_accuracy": ranks or acc}
    records = [rec("allreduce", 0, [0.1, 0.7, 0.9, 0.85, 0.95]),          # target: best of steps 0-20, 0.9, less 0.01
               rec("sgp", 0, [0.1, 0.5, 0.895, 0.9, 0.9], ranks=[0.1, 0.2, 0.3, 0.5, 0.9]),
               rec("sgp", 0, [0.1, 0.5, 0.6, 0.7, 0.8], tau=4, delay=1),
               rec("easgd", 0, [0.1, 0.2, 0.3, 0.9, 0.9], ranks=[0.1, 0.1, 0.1, 0.1, 0.1])]
    acc = AT.steps_to_target(records, drop=0.01)
    assert acc == {16: {"target": pytest.approx(0.89), "steps": {"allreduce": 20.0, "sgp": 40.0,
                                                                 "sgp every 4 delay 1": None, "easgd": 30.0}}}
    # the exact mean: SGP reaches it at 20; EASGD is its center either way
    assert AT.steps_to_target(records, drop=0.01, evaluate="mean")[16]["steps"]["sgp"] == 20.0
    with pytest.raises(ValueError, match="no AllReduce run at p = 16, seed 0"):
        AT.steps_to_target(records[1:3])
    with pytest.raises(ValueError, match="evaluate must be"):
        AT.steps_to_target(records, evaluate="best")


def test_join_is_steps_over_rate_and_the_winner_is_the_first():
    """With the steps fixed by hand the rows are their mixing's steps at the time model's pace;
    the winner is the least time; faster links never make AllReduce slower to the target."""
    costs = Costs.load(CALIBRATION)
    rows = predict(costs, ranks=[4, 8], rates_gbit=[0.1, 1, 10], per_node=2, mb=4, compute=0.05,
                   methods=("allreduce", "sgp", "agp", "gossip-pull"), steps=4, stragglers=(1.0,))
    AT.assign_mixing(rows)
    agp = {r["mixing"] for r in rows if r["method"] == "agp"}
    assert all(m.startswith("agp delays ") for m in agp) and len(agp) > 1   # its delays differ with the link
    steps = {"allreduce": 100.0, "sgp": 130.0, "gossip-pull": None}
    steps.update({m: 150.0 for m in agp})
    accuracy = {4: {"target": 0.8, "steps": dict(steps)}, 8: {"target": 0.8, "steps": dict(steps, sgp=100.0)}}
    AT.join(rows, accuracy)
    for r in rows:
        n = accuracy[r["ranks"]]["steps"][r["mixing"]]
        if n is None:
            assert r["seconds_to_target"] is None
        else:
            assert r["seconds_to_target"] == pytest.approx(n / r["steps_per_s"])
    best = AT.winners(rows)
    for (factor, p, rate), (method, seconds, vs_ar) in best.items():
        cell = [r for r in rows if (r["ranks"], r["rate_gbit"]) == (p, rate) and r["seconds_to_target"] is not None]
        assert seconds == min(r["seconds_to_target"] for r in cell) and method in {r["method"] for r in cell}
    for p in (4, 8):
        ar = [r["seconds_to_target"] for r in sorted(rows, key=lambda r: r["rate_gbit"])
              if r["ranks"] == p and r["method"] == "allreduce"]
        assert ar == sorted(ar, reverse=True)
    text = AT.markdown(rows, accuracy)
    assert "| 4 | 0.1 |" in text and "(delay " in text and "AGP's steps to the target" in text


def test_time_to_accuracy_runs_the_mixing_the_time_model_found():
    costs = Costs.load(CALIBRATION)
    rows, acc = AT.time_to_accuracy(costs, small_problem, ranks=[4], rates_gbit=[0.05], per_node=2, mb=4,
                                    compute=0.05, methods=["allreduce", "agp"], stragglers=(1.0,), time_steps=4,
                                    sim_steps=40, lr=0.2, seeds=(0,), evals=20)
    agp = next(r for r in rows if r["method"] == "agp")
    assert agp["scheme"] == "agp" and agp["mixing"] in acc[4]["steps"]   # simulated with its own delays
    assert max(agp["delays"]) > 1                                        # 4 MB at 50 Mbit: shares wait
    with pytest.raises(ValueError, match="no accuracy scheme for 'adpsgd'"):
        AT.time_to_accuracy(costs, small_problem, ranks=[4], rates_gbit=[1], per_node=2, mb=1, compute=0.05,
                            methods=["adpsgd"])


def test_time_to_accuracy_takes_the_time_models_rows_made_before():
    """``predictions``: the rows of an earlier predict (the steady state at 256 ranks takes tens
    of minutes) are joined as if simulated now; a missing cell, or one made for another model
    size, is refused by name."""
    costs = Costs.load(CALIBRATION)
    made = predict(costs, ranks=[4], rates_gbit=[0.05], per_node=2, mb=4, compute=0.05,
                   methods=("allreduce", "agp"), steps=4, stragglers=(1.0,))
    kw = dict(ranks=[4], rates_gbit=[0.05], per_node=2, mb=4, compute=0.05, methods=["allreduce", "agp"],
              stragglers=(1.0,), sim_steps=40, lr=0.2, seeds=(0,), evals=20)
    rows, _ = AT.time_to_accuracy(costs, small_problem, predictions=made, **kw)
    direct, _ = AT.time_to_accuracy(costs, small_problem, time_steps=4, **kw)
    assert [(r["method"], r["steps_per_s"], r["mixing"], r["seconds_to_target"]) for r in rows] == \
        [(r["method"], r["steps_per_s"], r["mixing"], r["seconds_to_target"]) for r in direct]
    with pytest.raises(ValueError, match="no row for allreduce at 4 ranks, 1 Gbit"):
        AT.time_to_accuracy(costs, small_problem, predictions=made, **dict(kw, rates_gbit=[1]))
    with pytest.raises(ValueError, match="made with 2 ranks a node, 4 MB"):
        AT.time_to_accuracy(costs, small_problem, predictions=made, **dict(kw, mb=8))


def test_the_accuracy_command_writes_table_json_and_map(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mpigossip", "timemodel", "--costs", CALIBRATION, "--out",
                        str(tmp_path), "--tag", "t", "accuracy", "--ranks", "4", "8", "--per-node", "2",
                        "--rate-gbit", "1", "10", "--mb", "1", "--compute-ms", "50", "--methods", "allreduce", "sgp",
                        "--steps", "3", "--sim-steps", "40", "--seeds", "0", "--skew", "0.5", "--stragglers", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "timemodel-accuracy-t.json").read_text())
    assert {r["method"] for r in data["rows"]} == {"allreduce", "sgp"} and set(data["accuracy"]) == {"4", "8"}
    assert data["meta"]["calibration"] == CALIBRATION
    assert data["accuracy_setting"]["problem"] == "digits" and data["accuracy_setting"]["skew"] == 0.5
    assert (tmp_path / "timemodel-accuracy-t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](timemodel-accuracy-t.png)" in (tmp_path / "timemodel-accuracy-t.md").read_text()


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
