"""The training job end to end under mpiexec: accuracy of every algorithm, checkpoints, errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.train

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")


def mg(n, *args, env=None, timeout=300):
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpigossip", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    return proc


def metrics(folder, rank=0, initial=False):
    """The per-step records (and, with ``initial``, the evaluation before training first)."""
    with open(os.path.join(folder, f"metrics-rank{rank}.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return records if initial else [r for r in records if r["step"] >= 0]


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("all")
    proc = mg(4, "train", "--algorithm", "all", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_every_algorithm_reaches_90_percent_and_loss_falls(all_runs):
    out, proc = all_runs
    assert "diloco over allreduce-params: 4 ranks" in proc.stdout, proc.stdout   # the outer method's base named
    for algo in ("allreduce", "allreduce-params", "easgd", "asgd", "gossip-pull", "gossip-push", "sgp", "osgp", "agp",
                 "dpsgd", "adpsgd", "localsgd", "slowmo", "diloco"):
        s = summary(out / algo)
        assert s["final_accuracy"] >= 0.90, (algo, s)
        assert s["world_size"] == 4 and s["steps"] == 300
        for key in ("final_loss", "consensus_distance", "wall_time_s", "time_per_step_s", "comm_time_s"):
            assert key in s
        m = metrics(out / algo, rank=3)
        early = sum(r["loss"] for r in m[:20]) / 20
        late = sum(r["loss"] for r in m[-20:]) / 20
        assert late < 0.5 * early, (algo, early, late)
        assert {"compute_s", "comm_s", "wait_s", "time_s"} <= m[0].keys()
        assert any("test_accuracy" in r and "consensus_distance" in r for r in m)
        first = metrics(out / algo, rank=0, initial=True)[0]
        assert first["steps_done"] == 0 and first["test_accuracy"] < 0.5  # the curves start before training
        assert m[-1]["steps_done"] == 300 and "test_accuracy" in m[-1]
        outer = " over allreduce-params" if algo in ("localsgd", "slowmo", "diloco") else ""
        assert f"{algo}{outer}: 4 ranks" in proc.stdout
    assert abs(summary(out / "sgp")["final_accuracy"] - summary(out / "allreduce")["final_accuracy"]) <= 0.01
    for algo in ("allreduce", "allreduce-params"):
        assert summary(out / algo)["consensus_distance"] < 1e-6
    with open(out / "sgp" / "config.json") as f:
        assert json.load(f)["algorithm"] == "sgp"


def test_plot_styles_and_zoom():
    """Every run its own colour up to 20 and its own colour and line style up to 80 (allreduce
    and sgp shared a colour under --algorithm all); the zoom fits the last half's points."""
    from mpigossip.train import plot
    assert len(set(plot.styles(14))) == 14 and len({c for c, _ in plot.styles(20)}) == 20
    assert len(set(plot.styles(80))) == 80
    runs = [[(0, 0.1), (100, 0.95), (200, 0.97)], [(0, 0.1), (100, 0.96), (200, 0.99)]]
    x0, x1, y0, y1 = plot.zoom(runs)
    assert (x0, x1) == (100, 200) and y0 < 0.95 < 0.99 < y1 < 1.0   # not 0..1: the differences show
    assert plot.zoom([[(0, 1.0), (10, 1.0)]]) is None


def test_plot_renders_figures(all_runs, tmp_path):
    out, _ = all_runs
    proc = subprocess.run([sys.executable, "-m", "mpigossip", "plot", str(out), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "accuracy.png", "consensus.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.resume
@pytest.mark.parametrize("algo", ["allreduce", "sgp", "gossip-push", "dpsgd", "diloco --base sgp --inner-steps 6"])
def test_resume_continues_exactly(tmp_path, algo):
    """A run stopped at step 20 (its last step checkpointed) and resumed to 40 takes the steps an
    uninterrupted 40-step run (checkpointing at 20) takes."""
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    common = ["train", "--algorithm", *algo.split(), "--quiet", "--eval-every", "20"]
    assert mg(2, *common, "--steps", "40", "--out", str(full), "--checkpoint-every", "20").returncode == 0
    assert mg(2, *common, "--steps", "20", "--out", str(part), "--checkpoint-every", "20").returncode == 0
    proc = mg(2, *common, "--steps", "40", "--out", str(resumed), "--resume", str(part))
    assert proc.returncode == 0, proc.stderr
    a = {r["step"]: r["loss"] for r in metrics(full, 1)}
    b = {r["step"]: r["loss"] for r in metrics(resumed, 1)}
    assert sorted(b) == list(range(20, 40))
    assert all(a[k] == b[k] for k in b), "resumed run diverged from the uninterrupted one"
    assert summary(full)["final_accuracy"] == summary(resumed)["final_accuracy"]
    # every time counts from step 0 across the resume (the wall clock once restarted at it)
    times = {r["step"]: r["time_s"] for r in metrics(part, 1)}
    again = {r["step"]: r["time_s"] for r in metrics(resumed, 1)}
    assert again[20] > times[19], (times[19], again[20])
    s = summary(resumed)
    assert s["compute_time_s"] + s["comm_time_s"] <= s["train_time_s"] <= s["wall_time_s"], s


@pytest.mark.resume
def test_resume_at_another_world_size_starts_from_consensus(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert mg(4, "train", "--steps", "40", "--checkpoint-every", "20", "--quiet", "--out", str(first)).returncode == 0
    proc = mg(2, "train", "--steps", "80", "--out", str(second), "--resume", str(first))
    assert proc.returncode == 0, proc.stderr
    assert "(step 40, 4 ranks)" in proc.stdout   # the last step is checkpointed
    assert summary(second)["world_size"] == 2 and summary(second)["final_accuracy"] > 0.9


@pytest.mark.resume
def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = mg(2, "train", "--steps", "40", "--checkpoint-every", "10", "--quiet", "--out", str(out),
              env={"MPIGOSSIP_CRASH_IN_CHECKPOINT": "20"})
    assert proc.returncode != 0
    with open(out / "checkpoints" / "latest.json") as f:
        assert json.load(f)["step"] == 10
    proc = mg(2, "train", "--steps", "40", "--out", str(tmp_path / "again"), "--resume", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "(step 10, 2 ranks)" in proc.stdout


@pytest.mark.resume
def test_hierarchical_runs_reach_the_bar_and_resume_exactly(tmp_path):
    """Two emulated nodes of two ranks: the node mean in shared memory, each algorithm
    between the nodes. With two nodes every inter-node graph averages exactly, so all of
    them equal AllReduce."""
    out = tmp_path / "h"
    proc = mg(4, "compare", "--algorithms", "sgp", "dpsgd", "allreduce-params", "gossip-push", "--hierarchical",
              "--node-size", "2", "--lrs", "0.1", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["algorithm"]: r for r in json.load(open(out / "compare.json"))}
    assert "sgp (hierarchical: 2 nodes): 4 ranks" in proc.stdout, proc.stdout   # the summary line says so
    for algo, row in rows.items():
        assert row["final_accuracy"] >= 0.90, (algo, row)
        assert row["hierarchical_nodes"] == 2, row
    for algo in ("sgp", "dpsgd"):
        assert rows[algo]["consensus_distance"] < 1e-9
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    common = ["train", "--algorithm", "sgp", "--hierarchical", "--node-size", "2", "--topology", "ring",
              "--quiet", "--eval-every", "20"]
    assert mg(4, *common, "--steps", "40", "--out", str(full), "--checkpoint-every", "20").returncode == 0
    assert mg(4, *common, "--steps", "20", "--out", str(part), "--checkpoint-every", "20").returncode == 0
    proc = mg(4, *common, "--steps", "40", "--out", str(resumed), "--resume", str(part))
    assert proc.returncode == 0, proc.stderr
    a = {r["step"]: r["loss"] for r in metrics(full, 3)}
    b = {r["step"]: r["loss"] for r in metrics(resumed, 3)}
    assert sorted(b) == list(range(20, 40)) and all(a[k] == b[k] for k in b)


def test_compare_writes_a_table(tmp_path):
    proc = mg(2, "compare", "--algorithms", "allreduce", "sgp", "--lrs", "0.05", "0.1", "--steps", "60",
              "--quiet", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "| algorithm | lr | test accuracy |" in proc.stdout
    rows = json.load(open(tmp_path / "compare.json"))
    assert [(r["algorithm"], r["lr"]) for r in rows] == [("allreduce", 0.05), ("allreduce", 0.1),
                                                          ("sgp", 0.05), ("sgp", 0.1)]
    assert (tmp_path / "compare.md").read_text().count("\n") == 6


@pytest.mark.parametrize("args, code, message", [
    (["--dataset", "/nonexistent/data.npz"], 1, "/nonexistent/data.npz: no such file"),
    (["--lr", "1e30", "--steps", "50"], 3, "loss is"),
    # without ULFM a dead rank would end the job after all (a RuntimeWarning, then exit 137): refused up front
    (["--on-failure", "continue", "--steps", "5"], 2, "--on-failure continue needs Open MPI's fault tolerance"),
])
def test_bad_data_or_a_diverging_run_give_a_clear_message_and_nonzero_exit(args, code, message):
    """Found once MPI runs (bad flags are refused before it starts: tests/test_cli.py)."""
    proc = mg(2, "train", "--quiet", *args, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code and message in out, out
    if code != 3:
        assert out.count(message) == 1, "message printed by more than rank 0"


def test_bad_npz_shapes(tmp_path):
    import numpy as np
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=np.zeros((10, 4)), y_train=np.zeros(9, dtype=np.int64),
             x_test=np.zeros((5, 4)), y_test=np.zeros(5, dtype=np.int64))
    proc = mg(2, "train", "--quiet", "--dataset", str(path), timeout=120)
    assert proc.returncode == 1 and "10 inputs of shape (4,) but 9 labels" in proc.stderr, proc.stderr
    good = tmp_path / "good.npz"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 6)).astype(np.float32)
    np.savez(good, x=x, y=(x[:, 0] > 0).astype(np.int64))
    proc = mg(2, "train", "--quiet", "--dataset", str(good), "--model", "logreg", "--steps", "100",
              "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert summary(tmp_path / "o")["final_accuracy"] > 0.9


def test_npz_x_and_y_of_different_lengths_are_refused(tmp_path):
    import numpy as np
    for n_y in (399, 401):  # shorter y used to crash every rank; longer y silently dropped labels
        path = tmp_path / f"xy{n_y}.npz"
        np.savez(path, x=np.zeros((400, 3), np.float32), y=np.zeros(n_y, np.int64))
        proc = mg(2, "train", "--quiet", "--dataset", str(path), timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and out.count(f"x has 400 samples but y has {n_y}") == 1, out


def test_epochs_give_every_rank_the_same_steps_on_uneven_shards(tmp_path):
    """1438 digits over 4 ranks: shards of 360 and 359 samples. Steps, evaluations and the
    end must agree on every rank (each used to count its own shard and wait at the deadline)."""
    proc = mg(4, "train", "--epochs", "1", "--batch-size", "1", "--quiet", "--out", str(tmp_path),
              env={"MPIGOSSIP_TIMEOUT": "30"}, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(tmp_path)["steps"] == 360  # ceil(1438 / 4)
    assert all(len(metrics(tmp_path, r)) == 360 for r in range(4))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """One 25-step run of 2 ranks with checkpoints at steps 10, 20 and the last, 25, shared by the
    tests that tamper with a copy of it."""
    run = tmp_path_factory.mktemp("checkpointed") / "run"
    proc = mg(2, "train", "--steps", "25", "--checkpoint-every", "10", "--quiet", "--out", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


@pytest.mark.resume
def test_the_last_step_is_checkpointed(checkpointed):
    with open(checkpointed / "checkpoints" / "latest.json") as f:
        assert json.load(f)["step"] == 25
    assert sorted(os.listdir(checkpointed / "checkpoints")) == ["latest.json", "step-00000025"]


@pytest.mark.resume
def test_resume_refuses_a_run_with_nothing_left_to_train(tmp_path, checkpointed):
    """--steps counts from the run's start: 25 steps resumed at step 25 would train nothing."""
    proc = mg(2, "train", "--steps", "25", "--quiet", "--out", str(tmp_path / "again"), "--resume", str(checkpointed))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "latest checkpoint is at step 25" in out and "nothing left to train" in out, out
    assert out.count("nothing left to train") == 1   # rank 0 alone prints


@pytest.mark.resume
def test_an_out_folder_with_another_runs_checkpoints_is_refused_unless_overwritten(tmp_path, checkpointed):
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    proc = mg(2, "train", "--steps", "5", "--quiet", "--out", str(run))
    assert proc.returncode == 2 and f"--out {run} holds another run's checkpoints" in proc.stderr, proc.stderr
    proc = mg(2, "train", "--steps", "5", "--quiet", "--out", str(run), "--resume", str(run), "--overwrite")
    assert proc.returncode == 2 and "--overwrite and --resume" in proc.stderr, proc.stderr
    proc = mg(2, "train", "--steps", "5", "--quiet", "--out", str(run), "--overwrite")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (run / "checkpoints").exists() and summary(run)["steps"] == 5


def latest_step_dir(run):
    with open(run / "checkpoints" / "latest.json") as f:
        return run / "checkpoints" / json.load(f)["dir"]


class _Planted:
    """Unpickling this runs a command: what a crafted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.resume
def test_resume_refuses_a_checkpoint_that_runs_code(tmp_path, checkpointed):
    import torch
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    step_dir = latest_step_dir(run)
    marker = tmp_path / "planted-command-ran"
    state = torch.load(step_dir / "rank-1.pt", weights_only=True)
    state["times"] = _Planted(marker)
    torch.save(state, step_dir / "rank-1.pt")
    proc = mg(2, "train", "--steps", "30", "--quiet", "--out", str(tmp_path / "again"), "--resume", str(run),
              env={"MPIGOSSIP_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert not marker.exists(), "the planted command ran"
    assert proc.returncode == 1 and "rank-1.pt is not a plain checkpoint" in out, out
    assert out.count("not a plain checkpoint") == 1, "every rank raises; rank 0 alone prints"


@pytest.mark.resume
def test_an_exception_on_one_rank_ends_the_job_at_once(tmp_path, checkpointed):
    """Rank 0's checkpoint lacks the model: rank 0 raises KeyError while rank 1 goes on to
    wait for it. The job must end within seconds with rank 0's traceback, not at the deadline."""
    import time

    import torch
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    path = latest_step_dir(run) / "rank-0.pt"
    state = torch.load(path, weights_only=True)
    del state["model"]
    torch.save(state, path)
    start = time.monotonic()
    proc = mg(2, "train", "--steps", "30", "--quiet", "--out", str(tmp_path / "again"), "--resume", str(run),
              env={"MPIGOSSIP_TIMEOUT": "300"}, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "KeyError: 'model'" in out and "uncaught exception; aborting" in out, out
    assert time.monotonic() - start < 60, "the other rank waited for the one that failed"


def test_resnet18_batchnorm_statistics_are_synchronised(tmp_path):
    """ResNet-18 has BatchNorm: with AllReduce every rank's checkpoint holds the same
    running statistics (they used to stay each rank's own); SGP runs and evaluates its
    consensus model with the mean statistics."""
    import torch
    out = tmp_path / "allreduce"
    proc = mg(2, "train", "--algorithm", "allreduce", "--model", "resnet18", "--steps", "6", "--batch-size", "8",
              "--checkpoint-every", "3", "--eval-every", "3", "--quiet", "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step_dir = latest_step_dir(out)
    models = [torch.load(step_dir / f"rank-{r}.pt", weights_only=True)["model"] for r in range(2)]
    stats = [k for k in models[0] if k.endswith("running_mean") or k.endswith("running_var")]
    assert len(stats) >= 40
    for key in stats:
        torch.testing.assert_close(models[0][key], models[1][key])
    assert models[0]["stem.1.running_var"].sub(1).abs().max() > 1e-3  # the statistics did move
    proc = mg(2, "train", "--algorithm", "sgp", "--model", "resnet18", "--steps", "6", "--batch-size", "8",
              "--quiet", "--out", str(tmp_path / "sgp"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 0.0 <= summary(tmp_path / "sgp")["final_accuracy"] <= 1.0
