"""The time model (mpigossip.sim.events, .cluster, .timing, .validation, .scaling): the engine's
sharing rules against closed forms, and each method's waits where their effect is known."""

import json
import math
import subprocess
import sys

import pytest

from mpigossip.sim import scaling, validation
from mpigossip.sim.cluster import Cluster
from mpigossip.sim.events import Engine, Fabric
from mpigossip.sim.timing import Costs, Workload, simulate

MB = 2 ** 20


def finish_times(fabric, flows):
    """Start ``flows`` [(amount, resources, kwargs)] at 0; the time each one ends."""
    ends = [None] * len(flows)
    for i, (amount, resources, kw) in enumerate(flows):
        fabric.transfer(amount, resources, **kw).then(lambda _, i=i: ends.__setitem__(i, fabric.engine.now))
    fabric.engine.run()
    return ends


def test_a_flow_alone_and_flows_sharing_a_link():
    e = Engine()
    f = Fabric(e, {"link": 100.0, "other": 100.0})
    assert finish_times(f, [(50, ["link"], {"latency": 0.5})]) == [pytest.approx(1.0)]
    e = Engine()
    f = Fabric(e, {"link": 100.0})
    # two flows share the link: the short one ends at 2 x 50 / 100; the long one then runs alone
    assert finish_times(f, [(50, ["link"], {}), (150, ["link"], {})]) == [pytest.approx(1.0), pytest.approx(2.0)]


def test_max_min_fairness_with_two_bottlenecks():
    """A crosses link a (cap 10); B crosses a and b (cap 2): B is held to 2 by b, A gets the rest, 8."""
    e = Engine()
    f = Fabric(e, {"a": 10.0, "b": 2.0})
    ends = finish_times(f, [(80, ["a"], {}), (20, ["a", "b"], {})])
    assert ends == [pytest.approx(10.0), pytest.approx(10.0)]
    assert f.carried["a"] == pytest.approx(100) and f.carried["b"] == pytest.approx(20)


def test_cores_are_shared_one_core_at_most_each():
    e = Engine()
    f = Fabric(e, {"cpu": 2.0})
    # three tasks of 1 core-second on 2 cores: each gets 2/3 of a core, all end at 1.5 s
    assert finish_times(f, [(1.0, ["cpu"], {"cap": 1.0})] * 3) == [pytest.approx(1.5)] * 3
    e = Engine()
    f = Fabric(e, {"cpu": 2.0})
    assert finish_times(f, [(1.0, ["cpu"], {"cap": 1.0})]) == [pytest.approx(1.0)]  # one core, not two


def test_flows_of_different_units_share_a_pool_by_their_own_pace():
    """A transfer that needs 0.5 core at its link's full rate and a CPU task on one core: each
    gets the same fraction of what it would alone (the transfer is not starved to bytes per
    core-second)."""
    e = Engine()
    f = Fabric(e, {"link": 100.0, "cpu": 1.0})
    ends = finish_times(f, [(100, {"link": 1.0, "cpu": 0.005}, {}), (1.0, ["cpu"], {"cap": 1.0})])
    # alone: the transfer 1 s (0.5 core), the task 1 s (1 core); together 1.5 cores on one: 2/3 each
    assert ends == [pytest.approx(1.5), pytest.approx(1.5)]


class _OneGroup(Fabric):
    """Every resource in one group from the first flow on: each change reshares every flow (how
    the engine shared before its groups)."""

    def _join(self, index):
        return super()._join(list(range(len(self._cap))))


def _random_flows(fabric, seed):
    """Flows over random resources (one, or two or three of a zone's; weights, caps) started at
    random times, and after 20 s some that join two zones: groups form, then merge while flows
    are under way. Returns each flow's end time, by flow, and the groups at 15 s."""
    import random
    rng = random.Random(seed)
    names = list(fabric.capacity)
    zones = [names[i::4] for i in range(4)]
    ends, seen = {}, []

    def start(i):
        zone = rng.choice(zones)
        if fabric.engine.now > 20 and rng.random() < 0.3:
            zone = zone + rng.choice(zones)
        chosen = rng.sample(zone, rng.choice([1, 1, 2, 3]))
        uses = {n: rng.choice([1.0, 0.5, 2e-3]) for n in chosen}
        kw = {"cap": rng.choice([math.inf, math.inf, 3.0, 40.0]), "latency": rng.choice([0.0, 1e-3])}
        fabric.transfer(rng.uniform(1, 200), uses, **kw).then(lambda _, i=i: ends.__setitem__(i, fabric.engine.now))
    for i in range(300):
        fabric.engine.call_at(rng.uniform(0, 30), start, i)
    fabric.engine.call_at(15, lambda: seen.append(len({fabric._find(r) for r in range(len(names))})))
    fabric.engine.run()
    return ends, seen[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sharing_by_groups_gives_the_rates_of_sharing_everything(seed):
    """The engine reshares only the group of resources a change reaches (resources joined by
    the flows that crossed them). Max-min fairness of one group does not depend on another's
    flows, so every flow ends when it would with every flow shared together, while groups form
    and merge mid-run."""
    capacity = {**{f"link{i}": 100.0 + 10 * i for i in range(8)}, **{f"cpu{i}": 2.0 for i in range(4)}}
    grouped = Fabric(Engine(), capacity)
    ends, groups = _random_flows(grouped, seed)
    assert groups >= 4 and len({grouped._find(r) for r in range(len(capacity))}) < groups   # formed, then merged
    whole = _OneGroup(Engine(), capacity)
    assert _random_flows(whole, seed)[0] == pytest.approx(ends, rel=1e-9, abs=1e-12)
    assert len(ends) == 300


def test_a_change_in_one_group_leaves_the_others_rates_alone():
    """A core pool's task starting and ending does not reshare an unrelated link's flows: the
    link's flow keeps the rate it has (the sharing's cost at 1,024 ranks is the number of
    flows each change reshares)."""
    e = Engine()
    f = Fabric(e, {"up0": 100.0, "down1": 100.0, "cpu0": 1.0})
    resharing = []
    real = Fabric._rates

    def counting(self):
        resharing.append(sorted(self._dirty))
        real(self)
    f._rates = counting.__get__(f)
    ends = finish_times(f, [(100, ["up0", "down1"], {}), (0.5, ["cpu0"], {"cap": 1.0, "latency": 0.2})])
    assert ends == [pytest.approx(1.0), pytest.approx(0.7)]
    groups = [g for g in resharing if g]
    link, cpu = f._find(0), f._find(2)
    assert link != cpu and [link] in groups and [cpu] in groups and [link, cpu] not in groups


def test_nothing_is_scheduled_in_the_past():
    e = Engine()
    e.call_at(1.0, lambda: None)
    e.run()
    with pytest.raises(ValueError, match="before now"):
        e.call_at(0.0, lambda: None)


def test_processes_wait_for_events_and_messages_wait_for_their_receive():
    """A message above the eager limit flows only once its receive is posted (rendezvous)."""
    cl = Cluster(2, 1, link_rate=100.0, latency=0.0, eager=10)
    log = {}

    def sender():
        yield cl.send(0, 1, 100, ("m",))
        log["sent"] = cl.engine.now

    def receiver():
        yield cl.sleep(2.0)
        yield cl.receive(1, ("m",))
        log["received"] = cl.engine.now
    cl.engine.process(sender())
    cl.engine.process(receiver())
    cl.engine.run()
    assert log == {"sent": pytest.approx(3.0), "received": pytest.approx(3.0)}


NO_CPU = Costs(link_rate=100 * MB, latency=0.0, rma_lock=0.0, rma_rate=1.0, message_cpu=0.0, step_cpu=0.0,
               step_cpu0=0.0, pass_rate=1e18, shm_rate=1e18, cores=64)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_allreduce_takes_its_bandwidth_limit(n):
    """No compute and no CPU: a ring allreduce step is 2 (n - 1) / n models through each link."""
    r = simulate("allreduce", n, 1, Workload(mb=10, compute=0.0, steps=4, warmup=1), NO_CPU)
    assert r["step_s"] == [pytest.approx(2 * (n - 1) / n * 0.1)] * n


def test_the_allreduce_formula_agrees_with_the_ring_message_by_message():
    work = Workload(mb=16, compute=0.2, steps=4, straggler={1: 2.0})
    costs = Costs(link_rate=120e6, latency=5e-5, cores=4)
    messages = simulate("allreduce", 4, 2, work, costs)["steps_per_s"]
    from mpigossip.sim import methods
    run_init = methods.Steps.__init__

    def formula(self, *a, **k):
        run_init(self, *a, **k)
        self.message_level_up_to = 0
    methods.Steps.__init__ = formula
    try:
        by_formula = simulate("allreduce", 4, 2, work, costs)["steps_per_s"]
    finally:
        methods.Steps.__init__ = run_init
    assert by_formula == pytest.approx(messages, rel=0.05)
    flat = simulate("allreduce", 8, 1, Workload(mb=16, steps=2), costs)["models_moved_per_step"]
    assert flat == pytest.approx(2 * 7 / 8)   # each rank of a ring sends 2 (n - 1) / n of the model


def test_a_straggler_holds_back_the_synchronous_methods_not_the_asynchronous_ones():
    steady = Workload(mb=1, compute=0.1, steps=20)
    slow = Workload(mb=1, compute=0.1, steps=20, straggler={1: 2.0})
    costs = Costs(link_rate=120e6, cores=4)
    for sync in ("allreduce", "sgp"):
        r = simulate(sync, 4, 1, slow, costs)
        assert max(r["step_s"]) == pytest.approx(min(r["step_s"]), rel=0.05), (sync, r["step_s"])  # lockstep
        assert r["steps_per_s"] < 0.6 * simulate(sync, 4, 1, steady, costs)["steps_per_s"]
    r = simulate("agp", 4, 1, slow, costs)
    fast = [s for i, s in enumerate(r["step_s"]) if i != 1]
    assert max(fast) < 1.1 * 0.1 and r["step_s"][1] > 0.19   # the others keep their own pace
    osgp = simulate("osgp:4", 4, 1, slow, costs)["steps_per_s"]
    assert simulate("sgp", 4, 1, slow, costs)["steps_per_s"] < osgp < r["steps_per_s"]


def test_one_center_serialises_easgd_and_shards_spread_it():
    """EASGD's exchanges queue on the center's lock and link: every exchange moves the model
    out and back through rank 0's link; with the center on every rank, the links share it."""
    work = Workload(mb=10, compute=0.0, steps=4, warmup=1)
    one = simulate("easgd", 4, 1, work, NO_CPU)
    spread = simulate("easgd:4", 4, 1, work, NO_CPU)
    # 3 remote workers x (read + write) of 10 MB through rank 0's link at 100 MB/s, one at a time
    assert one["seconds"] / 5 == pytest.approx(0.6, rel=0.05)
    assert spread["steps_per_s"] > 2 * one["steps_per_s"]


def test_every_method_runs_and_a_deadlock_is_named(monkeypatch):
    costs = Costs(link_rate=120e6, cores=2, cores_shared=True)
    for m in ("allreduce", "sgp", "osgp:2", "agp", "gossip-pull", "adpsgd", "easgd", "easgd:2"):
        r = simulate(m, 2, 2, Workload(mb=1, steps=3), costs)
        assert 0 < r["steps_per_s"] < 4 / 0.2 and len(r["step_s"]) == 4, m
    with pytest.raises(ValueError, match="unknown method 'dpsgd'"):
        simulate("dpsgd", 2, 1, Workload(mb=1), costs)
    from mpigossip.sim import methods
    monkeypatch.setattr(methods.Steps, "_step_sgp", lambda self, r, k: iter([self.cl.engine.event()]))
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] never finished"):
        simulate("sgp", 2, 1, Workload(mb=1, steps=2), costs)


def test_measured_method_cpu_replaces_the_structural_costs():
    base = Costs(link_rate=1e12, cores=1, cores_shared=True, latency=0.0, message_cpu=0.0)
    work = Workload(mb=10, compute=0.0, steps=4, warmup=1)
    measured = Costs(**{**base.__dict__, "method_cpu": {"sgp": [0.01, 0.002]}})
    # one core for 2 ranks: each step takes both ranks' 0.01 + 0.02 s of CPU
    assert simulate("sgp", 2, 1, work, measured)["step_s"] == [pytest.approx(0.06, rel=0.01)] * 2


def test_validation_table_and_its_misses(tmp_path):
    row = {"what": "P4", "mb": 1.0, "ranks": 2, "nodes": 2, "algorithm": "allreduce", "compute_ms": 100.0,
           "steps": 5, "steps_per_s": 1.0, "steps_per_s_straggler": 1.0, "runs": [[1.0, 1.0], [1.2, 0.9]]}
    path = tmp_path / "p4.json"
    path.write_text(json.dumps({"meta": {"commit": "abc"}, "rows": [row]}))
    costs = Costs(link_rate=120e6, cores=2)
    table = validation.p4_table([str(path)], costs)
    assert [t["case"] for t in table] == ["no straggler", "rank 1 2x slow"]
    predicted = simulate("allreduce", 2, 1, Workload(mb=1, compute=0.1, steps=5), costs)["steps_per_s"]
    assert table[0]["predicted"] == pytest.approx(predicted) and table[0]["error"] == pytest.approx(predicted - 1)
    assert table[0]["measured_range"] == [1.0, 1.2]
    assert sum(table[0]["predicted_by_rank"]) == pytest.approx(predicted) and table[0]["measured_by_rank"] is None
    # where the row has each rank's rate per repeat: their medians, rank by rank
    row.update(rank_steps_per_s=[[0.4, 0.6], [0.5, 0.9], [0.7, 0.3]], rank_steps_per_s_straggler=[[0.5, 0.5]])
    path.write_text(json.dumps({"meta": {"commit": "abc"}, "rows": [row]}))
    by_rank = [t["measured_by_rank"] for t in validation.p4_table([str(path)], costs)]
    assert by_rank == [[0.5, 0.6], [0.5, 0.5]]
    text = validation.markdown(table)
    assert text.count("**miss**") == 2 and text.endswith("0 of 2 rows within 15%.")


def test_held_out_rows_are_predicted_at_their_link_rate_and_in_the_core_per_rank_regime(tmp_path):
    base = {"what": "P4", "mb": 4.0, "algorithm": "sgp", "compute_ms": 100.0, "steps": 4,
            "steps_per_s": 1.0, "steps_per_s_straggler": 1.0}
    rows = [dict(base, ranks=2, nodes=2, rate_gbit=0.1, cores=2),   # a core per rank, 100 Mbit
            dict(base, ranks=3, nodes=3, rate_gbit=0.5, cores=2),   # three ranks on two cores
            dict(base, ranks=4, nodes=4)]                           # an old row: no rate, no cores
    path = tmp_path / "p4.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    costs = Costs(link_rate=0.9 * 1e9 / 8, cores=2, cores_shared=True, wire_cpu=1e-8)
    table = validation.p4_table([str(path)], costs)
    assert [t["regime"] for t in table[::2]] == ["core per rank", "shared cores", "shared cores"]
    work = Workload(mb=4.0, compute=0.1, steps=4)
    own = scaling.cluster_costs(costs, 0.1, per_node=1)
    assert own.link_rate == pytest.approx(0.1 * costs.link_rate) and own.wire_cpu == 0 and not own.cores_shared
    assert table[0]["predicted"] == pytest.approx(simulate("sgp", 2, 1, work, own)["steps_per_s"])
    half = Costs(**{**costs.__dict__, "link_rate": 0.5 * costs.link_rate})
    assert table[2]["predicted"] == pytest.approx(simulate("sgp", 3, 1, work, half)["steps_per_s"])
    assert table[4]["predicted"] == pytest.approx(simulate("sgp", 4, 1, work, costs)["steps_per_s"])
    # the link's rate matters at 4 MB: 100 Mbit is far slower than the calibration's 1 Gbit
    assert table[0]["predicted"] < 0.7 * simulate("sgp", 2, 1, work, costs)["steps_per_s"]
    assert "| 2 (2) | 0.1 | 4 | sgp | no straggler, core per rank |" in validation.markdown(table)


def test_the_reproductions_timed_runs_are_validated_where_the_model_has_the_method_and_case(tmp_path):
    run = {"world_size": 4, "steps": 10}
    runs = [dict(run, algorithm="sgp", case="normal", throughput_steps_s=v) for v in (3.0, 5.0)]
    runs += [dict(run, algorithm="osgp", case="straggler", throughput_steps_s=2.0),
             dict(run, algorithm="gossip-push", case="normal", throughput_steps_s=9.0),  # not in the model
             dict(run, algorithm="sgp", case="delays", throughput_steps_s=9.0)]           # transient delays: neither
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"timed_runs": runs}))
    costs = Costs(link_rate=120e6, cores=2)
    table = validation.reproduction_table(str(path), costs, mb=1.0, compute=0.1, nodes=2, per_node=2)
    assert [(t["algorithm"], t["case"]) for t in table] == [("sgp", "no straggler"), ("osgp", "rank 1 2x slow")]
    assert table[0]["measured"] == 4.0 and table[0]["measured_range"] == [3.0, 5.0]
    slow = Workload(mb=1.0, compute=0.1, straggler={1: 2.0}, steps=30)
    assert table[1]["predicted"] == pytest.approx(simulate("osgp:1", 2, 2, slow, costs)["steps_per_s"])


def test_outer_methods_average_every_h_steps_and_bench_outer_is_validated_at_its_rates(tmp_path):
    costs = Costs(link_rate=120e6, cores=4)
    work = Workload(mb=4, compute=0.01, steps=8, warmup=0)
    local = simulate("localsgd:4", 4, 1, work, costs)
    assert local["models_moved_per_step"] == pytest.approx(simulate("allreduce", 4, 1, work, costs)
                                                           ["models_moved_per_step"] / 4, rel=0.01)
    assert local["steps_per_s"] > simulate("allreduce", 4, 1, work, costs)["steps_per_s"]
    assert simulate("slowmo:4", 4, 1, work, costs)["steps_per_s"] < simulate("sgp", 4, 1, work, costs)["steps_per_s"]
    meta = {"ranks": 4, "compute_ms": 10.0, "inner_steps": 4}
    run = {"seed": 0, "throughput_steps_s": 1.0}
    runs = [dict(run, rate=rate, algorithm=a, flags=f, row=a.upper()) for rate in ("100mbit", "1gbit")
            for a, f in (("allreduce", []), ("diloco", ["--momentum", "0"]))]
    runs += [dict(run, rate="1gbit", algorithm="sgp", flags=["--wire", "int8"], row="SGP int8")]  # not stated
    path = tmp_path / "outer.json"
    path.write_text(json.dumps({"meta": meta, "runs": runs}))
    table = validation.outer_table(str(path), costs, mb=1.0)
    assert [(t["rate_gbit"], t["algorithm"]) for t in table] == [(0.1, "ALLREDUCE"), (0.1, "DILOCO"),
                                                                 (1.0, "ALLREDUCE"), (1.0, "DILOCO")]
    slow = Costs(link_rate=12e6, cores=4)   # 100 Mbit: the 1 Gbit calibration's link scaled by 0.1
    expected = simulate("localsgd:4", 4, 1, Workload(mb=1.0, compute=0.01, steps=12), slow)["steps_per_s"]
    assert table[1]["predicted"] == pytest.approx(expected)


def test_predictions_at_scale_keep_the_payload_fraction_and_give_a_core_per_rank():
    costs = Costs(link_rate=0.96 * 1e9 / 8, cores=2, cores_shared=True, wire_cpu=1e-9)
    c = scaling.cluster_costs(costs, 100, per_node=8)
    assert c.link_rate == pytest.approx(0.96 * 100e9 / 8) and c.cores == 8 and not c.cores_shared
    assert c.wire_cpu == 0.0
    rows = scaling.predict(costs, ranks=[16], rates_gbit=[1, 10], per_node=8, mb=10, compute=0.1,
                           methods=("allreduce", "agp"), steps=3)
    assert len(rows) == 2 * 2 * 2
    fast = {r["method"]: r["steps_per_s"] for r in rows if r["rate_gbit"] == 10 and r["straggler"] == 1.0}
    slow = {r["method"]: r["steps_per_s"] for r in rows if r["rate_gbit"] == 1 and r["straggler"] == 1.0}
    assert fast["allreduce"] > slow["allreduce"]   # a faster link speeds the synchronous method
    assert "fastest in bold" in scaling.markdown(rows)
    with pytest.raises(ValueError, match="whole number of nodes"):
        scaling.predict(costs, ranks=[12], rates_gbit=[1], per_node=8, mb=1, compute=0.1)


def test_timemodel_command(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"meta": {"commit": "x"}, "costs": {"link_rate": 120e6, "cores": 2}}))
    proc = subprocess.run([sys.executable, "-m", "mpigossip", "timemodel", "--costs", str(costs), "--out",
                           str(tmp_path), "predict", "--ranks", "8", "--per-node", "4", "--rate-gbit", "1",
                           "--mb", "1", "--methods", "sgp", "allreduce", "--steps", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "timemodel-predict.json").read_text())
    assert data["meta"]["calibration_meta"] == {"commit": "x"} and len(data["rows"]) == 4
    assert "| 8 | 1 |" in (tmp_path / "timemodel-predict.md").read_text()
    assert math.isfinite(data["rows"][0]["steps_per_s"])


# --- the steady state (#43): bytes counted when delivered, rates once steady, AGP as the package runs it

CALIBRATED = Costs.load("benchmarks/results/time-calibration-1gbit.json")


def test_bytes_count_when_delivered_not_when_sent():
    """A 1 GB model over 1 Gbit takes ~8 s; five AGP steps of 10 ms deliver none of it (a
    model that counted bytes when a message started said 0.5 models a step)."""
    costs = Costs(link_rate=125e6, cores=1)
    r = simulate("agp", 2, 1, Workload(mb=1000, compute=0.01, steps=5, warmup=0), costs)
    assert r["models_moved_per_step"] == 0.0 and r["internode_models_per_step"] == 0.0
    sgp = simulate("sgp", 2, 1, Workload(mb=10, compute=0.01, steps=5, warmup=0), costs)
    assert sgp["models_moved_per_step"] == pytest.approx(1.0, rel=0.01)   # it waits: every share arrived


def test_agp_at_its_steady_state_not_its_start():
    """AGP, 16 ranks on 2 nodes of 8, 100 MB over 1 Gbit: the first steps send into idle links
    (0.45 models a step in 5 steps); at the steady state it delivers what the link carries,
    the same again over twice the steps."""
    c = scaling.cluster_costs(CALIBRATED, 1, per_node=8)
    work = Workload(mb=100, compute=0.1, steps=10)
    start = simulate("agp", 2, 8, Workload(mb=100, compute=0.1, steps=5), c)
    steady = simulate("agp", 2, 8, work, c, until_steady=True)
    assert steady["steady"] and steady["steps"] >= 100
    assert start["models_moved_per_step"] > 1.5 * steady["models_moved_per_step"]
    again = simulate("agp", 2, 8, Workload(mb=100, compute=0.1, steps=2 * steady["steps"]), c, until_steady=True)
    assert again["models_moved_per_step"] == pytest.approx(steady["models_moved_per_step"], rel=0.1)
    assert steady["held"] > 0   # the weight floor is met: ranks step faster than shares arrive


@pytest.mark.parametrize("ranks, rate", [(16, 1), (16, 100), (64, 10), (256, 1), (1024, 1)])
def test_no_method_moves_more_than_its_links_carry(ranks, rate):
    """Each method's steady state: the bytes its ranks deliver between nodes per second, each
    rank's over its own steps, stay within what the nodes' links carry (each such byte crosses
    one uplink: nodes x the link's rate; 10% for messages straddling the windows' edges); and
    where every rank steps alike, the models moved per step x the model x the steps per second
    say the same. 256 and 1024 ranks: AllReduce by formula (AGP's steady state takes minutes
    to simulate there)."""
    c = scaling.cluster_costs(CALIBRATED, rate, per_node=8)
    work = Workload(mb=4, compute=0.02, steps=4)
    methods = ("allreduce", "sgp", "osgp:2", "agp", "gossip-pull", "adpsgd", "easgd") if ranks <= 64 else \
        ("allreduce",)
    nodes = ranks // 8
    for m in methods:
        r = simulate(m, nodes, 8, work, c, until_steady=True, max_steps=512)
        assert r["internode_bytes_per_s"] <= 1.1 * nodes * c.link_rate, (m, r["internode_bytes_per_s"] / nodes /
                                                                          c.link_rate, r["steps"])
        if m in ("allreduce", "sgp", "osgp:2"):   # lockstep: the per-step figures multiply out
            link = r["internode_models_per_step"] * work.nbytes * r["steps_per_s"]
            assert link == pytest.approx(r["internode_bytes_per_s"], rel=0.05), m


def test_agp_model_keeps_mass_one_message_per_out_peer_and_its_receive_slots():
    """The time model's AGP as AsyncPushSum: at most one message in flight per out-peer (a rank
    has several out-peers over the schedule, so several at once), at most ``receives`` receives
    posted, the weights summing with what is in flight to the ranks' count, and none below
    half the floor."""
    from mpigossip.sim.methods import Steps
    c = scaling.cluster_costs(CALIBRATED, 1, per_node=4)
    cl = Cluster(2, 4, link_rate=c.link_rate, latency=c.latency, cores=c.cores, shm_rate=c.shm_rate,
                 message_cpu=c.message_cpu)
    work = Workload(mb=50, compute=0.05, steps=120)
    run = Steps("agp", cl, c, work, 0)
    seen = {"in flight": 0, "posted": 0, "min weight": 1.0}

    def watch():
        while any(len(t) < work.warmup + work.steps for t in run.times):
            for r in range(cl.size):
                flying = [d for d, (ev, _) in run.outs[r].items() if ev is not None and not ev.done]
                seen["in flight"] = max(seen["in flight"], len(flying))
                seen["posted"] = max(seen["posted"], len(run.posted[r]))
                seen["min weight"] = min(seen["min weight"], run.weight[r])
            total = sum(run.weight) + sum(w for outs in run.outs for _, w in outs.values())
            total += sum(w for a in run.announced for _, w, _ in a) + sum(w for p in run.posted for _, w, _ in p)
            # (a message's weight is in `announced`, then `posted`, until combined)
            assert total == pytest.approx(cl.size, rel=1e-12)
            yield cl.engine.timeout(0.01)
    for r in range(cl.size):
        cl.engine.process(run.rank(r))
    cl.engine.process(watch())
    cl.engine.run()
    assert seen["in flight"] >= 2 and seen["posted"] <= run.receives
    assert seen["min weight"] >= run.min_weight / 2 and sum(run.held) > 0
    # every share combined is on the schedule the accuracy simulator mixes by, once
    assert 0 < len(run.combined) <= sum(run.sent) and len(run.combined) >= sum(run.sent) - cl.size * 8
    assert all(0 <= k < work.warmup + work.steps and 0 <= sent <= work.warmup + work.steps
               for _, k, sent in run.combined)
    assert max(k - sent for _, k, sent in run.combined) > 1     # 50 MB over 1 Gbit: shares wait steps


def test_each_ranks_cpu_and_parts_of_a_step_are_reported():
    """What ``benchmarks/p4_parts.py`` sets beside the measured parts: each rank's CPU charge per
    step (its work and the network stack's on both sides of each message between nodes) and
    each method's parts (gossip pull's reads, AGP's messages)."""
    wire_cpu = 1e-9
    costs = Costs(link_rate=100 * MB, cores=4, cores_shared=True, latency=0.0, message_cpu=0.0, wire_cpu=wire_cpu,
                  rma_rate=1.0, rma_lock=0.0, method_cpu={"sgp": [0.01, 0.002], "gossip-pull": [0.0, 0.001]},
                  gets_shared=True)
    work = Workload(mb=10, compute=0.05, steps=8, warmup=2)
    sgp = simulate("sgp", 2, 1, work, costs)   # a message out and one in each step
    assert sgp["cpu_s"] == [pytest.approx(0.01 + 0.02 + 2 * 10 * MB * wire_cpu)] * 2
    pull = simulate("gossip-pull", 2, 1, work, costs)
    for parts in pull["parts"]:
        assert 0 < parts["reads"] <= 1
        # a read alone at the link's rate; at most twice that while the target reads from its reader
        assert 0.1 * 0.99 <= parts["read"] / parts["reads"] <= 0.2 * 1.01
    agp = simulate("agp", 2, 1, Workload(mb=1, compute=0.05, steps=8, warmup=2), costs)
    sent = sum(p.get("sent", 0.0) for p in agp["parts"]) / 2
    assert sent == pytest.approx(1.0)   # a 10 ms message every 50 ms step: each step's share leaves at once
    assert agp["models_moved_per_step"] == pytest.approx(sent, rel=0.2)


@pytest.mark.parametrize("nodes", [2, 3])
def test_one_sided_gets_through_one_rank_share_its_rate_and_sends_do_not(nodes):
    """Measured with Open MPI 5's TCP transport (``benchmarks/bench_directions.py``): a ring of
    64 MB gets (rank r reads rank r+1), or two gets both ways, take twice one get's time, where a
    ring of sends and puts both ways take one. The model: a rank's gets, served and its own,
    cross one resource of a link's rate; a get alone, a put and a send do not slow."""
    rate, nbytes = 100 * MB, 50 * MB

    def ends(kind):
        cl = Cluster(nodes, 1, link_rate=rate, latency=0.0, gets_shared=True)
        times = []
        for r in range(nodes):
            peer = (r + 1) % nodes
            if kind == "get":    # r reads peer: the bytes flow peer -> r
                done = cl.wire(peer, r, nbytes, by=r, get=True)
            else:                # r sends (or puts) to peer
                done = cl.wire(r, peer, nbytes)
            done.then(lambda _, cl=cl: times.append(cl.engine.now))
        cl.engine.run()
        return times

    one = nbytes / rate
    assert ends("get") == [pytest.approx(2 * one)] * nodes
    assert ends("send") == [pytest.approx(one)] * nodes
    cl = Cluster(nodes, 1, link_rate=rate, latency=0.0, gets_shared=True)
    alone = []
    cl.wire(1, 0, nbytes, by=0, get=True).then(lambda _: alone.append(cl.engine.now))
    cl.engine.run()
    assert alone == [pytest.approx(one)]
    # off (RDMA NICs; the predictions at scale): every get of the ring at its links' rate
    cl = Cluster(nodes, 1, link_rate=rate, latency=0.0)
    ring = []
    for r in range(nodes):
        cl.wire((r + 1) % nodes, r, nbytes, by=r, get=True).then(lambda _: ring.append(cl.engine.now))
    cl.engine.run()
    assert ring == [pytest.approx(one)] * nodes
