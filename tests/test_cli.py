"""The command line without MPI: nothing initialises MPI or loads torch before it must:
the launcher, `table`, `plot` and flag errors leave /dev/shm as
they found it; a bad flag is answered by rank 0 alone with the subcommand's usage."""

import glob
import json
import os
import subprocess
import sys

import pytest

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")


def segments():
    return set(glob.glob("/dev/shm/sm_segment.*"))


def run(*cmd, timeout=120):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def test_importing_the_package_starts_neither_mpi_nor_torch():
    code = ("import sys, mpigossip, mpigossip.launch.launcher, mpigossip.__main__, mpigossip.train.table, "
            "mpigossip.train.plot, mpigossip.train.cli\n"
            "loaded = [m for m in ('mpi4py.MPI', 'torch') if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "assert mpigossip.PushSum.__name__ == 'PushSum' and 'mpi4py.MPI' in sys.modules\n")
    proc = run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr


def test_launcher_table_and_plot_leave_no_mpi_files(tmp_path):
    before = segments()
    assert run(MPIEXEC, "-n", "2", "true").returncode == 0
    proc = run(sys.executable, "-m", "mpigossip", "table", str(tmp_path))
    assert proc.returncode == 1 and "no summary.json" in proc.stdout
    run_dir = tmp_path / "runs" / "sgp"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "algorithm": "sgp", "lr": 0.1, "final_accuracy": 0.98, "final_loss": 0.1, "time_per_step_s": 0.01,
        "comm_time_s": 0.5, "consensus_distance": 1e-3}))
    proc = run(sys.executable, "-m", "mpigossip", "table", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md"))
    assert proc.returncode == 0 and (tmp_path / "t.md").is_file(), proc.stdout + proc.stderr   # a file, not a folder
    assert "| sgp | 0.1 |" in (tmp_path / "t.md").read_text() and (tmp_path / "t.json").is_file()
    run(sys.executable, "-m", "mpigossip", "plot", str(tmp_path), "--out", str(tmp_path))
    assert not segments() - before, "something initialised MPI"


@pytest.mark.parametrize("args, message", [
    (["train", "--lr", "-1"], "--lr must be > 0"),
    (["train", "--servers", "3"], "--servers 3 exceeds the world size 2"),
    (["train", "--topology", "bipartite", "--peers", "5"], "--topology bipartite --peers 5"),
    (["compare", "--algorithms", "sgd"], "--algorithm 'sgd'"),
    (["train", "--bogus", "3"], "unrecognized arguments: --bogus 3"),
])
def test_bad_flags_are_answered_before_mpi_starts(args, message):
    before = segments()
    proc = run(MPIEXEC, "-n", "2", sys.executable, "-m", "mpigossip", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count(message) == 1, out
    if "--bogus" in args:
        assert "usage: python -m mpigossip train" in out
    assert not segments() - before, "a rank initialised MPI before checking its flags"


def test_bipartite_needs_an_even_world_size_even_alone():
    proc = run(sys.executable, "-m", "mpigossip", "train", "--topology", "bipartite")
    assert proc.returncode == 2 and "even world size" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be > 0"),
    (["--algorithm", "sgd"], "--algorithm 'sgd'"),
    (["--servers", "9"], "--servers 9 exceeds the world size 2"),
    (["--topology", "bipartite", "--peers", "5"], "--topology bipartite --peers 5"),
    (["--algorithm", "dpsgd", "--topology", "random"], "dpsgd needs a doubly stochastic graph"),
    (["--algorithm", "easgd", "--hierarchical"], "--hierarchical: easgd cannot run hierarchically"),
    (["--algorithm", "easgd", "--wire", "bf16"], "--wire: easgd cannot send compressed messages"),
    (["--algorithm", "allreduce-params", "--wire", "int8"], "snaps the model to the format's grid"),
    (["--algorithm", "diloco", "--wire", "bf16"], "diloco: a compressed mean of the parameters"),
    (["--algorithm", "slowmo", "--wire", "int8", "--base", "sgp", "--wire", "bf17"], "--wire: invalid choice"),
    (["--algorithm", "sgp", "--hierarchical", "--node-size", "3"], "--node-size must be a positive divisor"),
    (["--algorithm", "sgp", "--node-size", "2"], "--node-size needs --hierarchical"),
    (["--straggler", "7:2"], "--straggler '7:2'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --out"),
    (["--kill", "2:5"], "--kill '2:5': rank must be in [0, 2)"),
    (["--algorithm", "easgd", "--on-failure", "continue"], "which Open MPI's fault tolerance (ULFM) does not cover"),
    (["--algorithm", "slowmo", "--base", "sgp", "--inner-mixing", "--on-failure", "continue"],
     "--on-failure continue: --inner-mixing over sgp: inner_mixing's exact mean"),
    (["--on-failure", "continue", "--eval-every", "5"], "--on-failure continue does not take --eval-every yet"),
    (["--on-failure", "continue", "--hierarchical"], "--on-failure continue does not take --hierarchical"),
])
def test_bad_train_flags_exit_2_with_a_clear_message(monkeypatch, capsys, args, message):
    """In process, as rank 0 of 2 announced by the launcher: the checks that need no MPI (the
    launches above show that only rank 0 prints and that MPI never starts)."""
    from mpigossip.__main__ import parse
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse(["train", "--quiet", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count(message) == 1, err


@pytest.mark.parametrize("command", [["train"], ["compare", "--algorithms", "sgp"]])
def test_a_task_of_a_launch_without_process_manager_stops(tmp_path, command):
    """What `srun` without PMI support gives: each task a singleton MPI world while Slurm says
    the step has 2 tasks. Each would train alone into the same --out; it must stop, saying how
    to launch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_PROCID="0")
    proc = subprocess.run([sys.executable, "-m", "mpigossip", *command, "--quiet", "--steps", "5",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI gives this one a world of 1" in proc.stderr
    assert "srun --mpi=pmix" in proc.stderr and not os.listdir(tmp_path)


def test_a_run_in_the_batch_scripts_own_shell_warns_once_and_trains(tmp_path):
    """`python -m mpigossip train` typed straight into an sbatch script of 2 tasks (no srun):
    one process, a world of 1, in an allocation of 2 tasks. Legitimate for a one-rank try, so it
    trains, but it says so in one warning line naming srun; without SLURM_NTASKS, no word."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    for ntasks, warned in (("2", True), (None, False)):
        env = dict(base, **({"SLURM_NTASKS": ntasks, "SLURM_JOB_ID": "7"} if ntasks else {}))
        out = tmp_path / str(ntasks)
        proc = subprocess.run([sys.executable, "-m", "mpigossip", "train", "--quiet", "--steps", "3",
                               "--out", str(out)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [line for line in proc.stderr.splitlines() if "warning: training alone" in line]
        assert len(lines) == (1 if warned else 0), proc.stderr
        if warned:
            assert "srun" in lines[0] and "SLURM_NTASKS=2" in lines[0]
        assert (out / "summary.json").exists()
