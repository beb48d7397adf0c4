"""``python -m mpigossip launch`` (mpigossip/launch/slurm.py) without Slurm: the command and
environment built for each launcher, the crash inside MPI_Init recognised and launched again
(through a stand-in ``srun`` on PATH), and signals passed on. The real thing runs under Slurm
in tests/test_slurm.py and, across nodes, tests/cluster/slurm_jobs.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpigossip.launch import slurm

HERE = os.path.dirname(os.path.abspath(__file__))
CRASH = os.path.join(HERE, "scripts", "init_crash.py")
GPUS = {"SLURM_GPUS_PER_TASK": "1", "SLURM_GPUS_ON_NODE": "2", "SLURM_NTASKS": "8"}


def test_even_tasks():
    for value, even in [("2(x4)", True), ("4", True), ("1,1", True), ("2(x3),1", False), ("2,1", False)]:
        assert slurm.even_tasks({"SLURM_TASKS_PER_NODE": value}) is even, value


def test_srun_command():
    argv, env = slurm.command("srun", ["python", "-m", "x"], {"SLURM_NTASKS": "4", "SLURM_GPUS_PER_TASK": "1"})
    assert argv == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "python", "-m", "x"]
    assert env["SLURM_GPUS_PER_TASK"] == "1"      # srun binds one GPU per task itself


def test_mpirun_command_gives_each_node_daemon_all_its_gpus(tmp_path):
    environ = dict(GPUS, SLURM_TASKS_PER_NODE="2(x4)", SLURM_GPU_BIND="single:1", MPIRUN="/site/bin/mpirun")
    argv, env = slurm.command("mpirun", ["python", "t.py"], environ)
    assert argv == ["/site/bin/mpirun", "--bind-to", "none", "-n", "8", "python", "t.py"]
    assert "SLURM_GPUS_PER_TASK" not in env and "SLURM_GPU_BIND" not in env
    assert env["SLURM_GPUS_PER_NODE"] == "2"
    assert environ["SLURM_GPUS_PER_TASK"] == "1"  # the caller's environment is left alone
    _, env = slurm.command("mpirun", ["p"], {"SLURM_NTASKS": "4", "MPIRUN": "mpirun"})
    assert "SLURM_GPUS_PER_NODE" not in env       # no GPUs: nothing to change
    with pytest.raises(slurm.LaunchError, match="same tasks on every node"):
        slurm.command("mpirun", ["p"], dict(GPUS, SLURM_TASKS_PER_NODE="2(x3),1", MPIRUN="mpirun"))
    with pytest.raises(slurm.LaunchError, match="not inside a Slurm allocation"):
        slurm.command("mpirun", ["p"], {"MPIRUN": "mpirun"})
    with pytest.raises(slurm.LaunchError, match="no command"):
        slurm.command("srun", [], {})


def test_fault_tolerant_launch_is_mpirun_with_ulfm():
    argv, env = slurm.command("mpirun", ["p"], {"SLURM_NTASKS": "4", "MPIRUN": "mpirun"}, fault_tolerant=True)
    assert argv == ["mpirun", "--bind-to", "none", "-n", "4", "--with-ft", "ulfm", "p"]
    assert env["OMPI_MCA_coll"] == "^han"  # han's collectives are not fault tolerant
    assert env["OMPI_MCA_btl_tcp_eager_limit"] == str(4 << 20)  # pieces eager (a rendezvous hung)
    assert env["PRTE_MCA_state_base_recoverable"] == "1"  # a spawned replacement's end is not an error
    assert env["OMPI_MCA_btl_sm_free_list_max"] == "65536"  # a revoke with no fragment free crashed a survivor
    _, env = slurm.command("mpirun", ["p"], {"SLURM_NTASKS": "4", "MPIRUN": "mpirun", "OMPI_MCA_coll": "^hcoll"},
                           fault_tolerant=True)
    assert env["OMPI_MCA_coll"] == "^hcoll"  # the user's choice stands
    plain = slurm.command("mpirun", ["p"], {"SLURM_NTASKS": "4", "MPIRUN": "mpirun"})[1]
    assert "OMPI_MCA_coll" not in plain and "OMPI_MCA_btl_tcp_eager_limit" not in plain
    with pytest.raises(slurm.LaunchError, match="not supported under a direct srun launch: use --launcher mpirun"):
        slurm.command("srun", ["p"], {"SLURM_NTASKS": "4"}, fault_tolerant=True)


def test_spares_keep_the_last_nodes_empty_and_name_them():
    environ = {"SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "4(x4)", "MPIRUN": "mpirun"}
    hosts = ["n1", "n2", "n3", "n4"]
    argv, env = slurm.command("mpirun", ["p"], environ, fault_tolerant=True, spares=1, hostnames=hosts)
    assert argv[:5] == ["mpirun", "--bind-to", "none", "-n", "12"] and argv[-1] == "p"
    assert argv[5:9] == ["--map-by", "slot", "-x", slurm.SPARES] and env[slurm.SPARES] == "n4"
    argv, env = slurm.command("mpirun", ["p"], dict(environ, SLURM_TASKS_PER_NODE="2,1(x3)"), fault_tolerant=True,
                              spares=2, hostnames=hosts)
    assert argv[4] == "3" and env[slurm.SPARES] == "n3,n4"
    assert slurm.SPARES not in slurm.command("mpirun", ["p"], environ, fault_tolerant=True)[1]
    with pytest.raises(slurm.LaunchError, match="at least one must start ranks"):
        slurm.command("mpirun", ["p"], environ, fault_tolerant=True, spares=4, hostnames=hosts)
    with pytest.raises(slurm.LaunchError, match="need --launcher mpirun --fault-tolerant"):
        slurm.command("mpirun", ["p"], environ, spares=1, hostnames=hosts)
    with pytest.raises(slurm.LaunchError, match="cannot tell the tasks of each node"):
        slurm.command("mpirun", ["p"], dict(environ, SLURM_TASKS_PER_NODE="4(x3)"), fault_tolerant=True, spares=1,
                      hostnames=hosts)


def test_newcomers_go_to_a_free_spare_else_where_a_survivor_lives():
    from types import SimpleNamespace

    from mpigossip.train.regrow import _placement
    # ranks 0-3 on a, a, b, c; rank 3 (c's only one) died
    run = SimpleNamespace(hosts=["a", "a", "b", "c"], lost=[3], size=3)
    assert _placement(run, spares=[])["host"] == "a,b"              # never c, where only the dead lived
    assert _placement(run, spares=["s2", "s1"])["host"] == "s1,s2"
    assert _placement(run, spares=["c"])["host"] == "a,b"           # a spare whose newcomer died
    run = SimpleNamespace(hosts=["a", "a", "b", "s1"], lost=[0], size=3)   # a newcomer on s1 lives
    assert _placement(run, spares=["s1", "s2"])["host"] == "s2"
    assert _placement(run, spares=["s1"])["host"] == "a,b,s1"       # the spares all taken
    assert _placement(SimpleNamespace(hosts=["a"], lost=[3], size=3), spares=["s1"]) is None


def test_crash_inside_mpi_init_is_told_apart():
    for where, expected in [("init", True), ("late", False)]:
        proc = subprocess.run([sys.executable, CRASH, where], capture_output=True, text=True, timeout=30)
        assert proc.returncode == -signal.SIGSEGV
        assert slurm.crashed_in_init(proc.stderr) is expected, proc.stderr
    assert not slurm.crashed_in_init("srun: error: node2: task 1: Segmentation fault\n")
    assert not slurm.crashed_in_init("python -m mpigossip: error: ompi_mpi_init+1 is not a flag\n")


@pytest.fixture
def fake_srun(tmp_path):
    """An ``srun`` on PATH that drops its options and runs the command as task 0 of the next step."""
    counter = tmp_path / "steps"
    counter.write_text("0")
    srun = tmp_path / "srun"
    srun.write_text(f"""#!/bin/sh
while [ "${{1#--}}" != "$1" ]; do shift; done
step=$(cat {counter}); echo $((step + 1)) >{counter}
SLURM_STEP_ID=$step SLURM_PROCID=0 exec "$@"
""")
    srun.chmod(0o755)
    return dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", SLURM_NTASKS="1"), counter


def run_launch(env, *args):
    return subprocess.run([sys.executable, "-m", "mpigossip", "launch", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_srun_launch_that_crashed_in_mpi_init_runs_again(fake_srun):
    env, counter = fake_srun
    proc = run_launch(env, "--", sys.executable, CRASH, "init")     # srun is the default
    assert proc.returncode == 0, proc.stderr
    assert "mpigossip launch: srun --mpi=pmix --kill-on-bad-exit=1 ..." in proc.stderr
    assert "a rank crashed inside MPI_Init (exit 139)" in proc.stderr and "launching again (1 of 1)" in proc.stderr
    assert "*** Process received signal ***" in proc.stderr         # the crash is shown, not hidden
    assert proc.stdout == "started: step 1 task 0\n" and counter.read_text().strip() == "2"


def test_other_failures_and_spent_retries_return_the_status(fake_srun):
    env, counter = fake_srun
    proc = run_launch(env, "--launcher", "srun", "--", sys.executable, CRASH, "late")
    assert proc.returncode == 139 and "MPI_Init" not in proc.stderr.split("***")[-1]
    assert counter.read_text().strip() == "1"                        # a crash after MPI_Init: not again
    counter.write_text("0")
    proc = run_launch(env, "--launcher", "srun", "--retries", "0", "--", sys.executable, CRASH, "init")
    assert proc.returncode == 139 and "in all 1 launches" in proc.stderr and "try --launcher mpirun" in proc.stderr
    proc = run_launch(env, "--launcher", "srun", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert proc.returncode == 3 and counter.read_text().strip() == "2"


def test_signals_reach_the_ranks(fake_srun, tmp_path):
    env, _ = fake_srun
    ready = tmp_path / "ready"
    program = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
               f"open({str(ready)!r}, 'w').close()\n"
               "time.sleep(30)\nsys.exit(1)\n")
    proc = subprocess.Popen([sys.executable, "-m", "mpigossip", "launch", "--launcher", "srun", "--",
                             sys.executable, "-c", program], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 75, proc.stderr.read()
    proc.stderr.close()


def test_usage_errors():
    proc = run_launch(os.environ)
    assert proc.returncode == 2 and "no command" in proc.stderr
    proc = run_launch(os.environ, "--launcher", "mpiexec", "--", "true")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    with pytest.raises(slurm.LaunchError, match="--launcher must be one of srun, mpirun"):
        slurm.launch("auto", ["true"])
    outside = {k: v for k, v in os.environ.items() if k != "SLURM_NTASKS"}
    proc = run_launch(outside, "--launcher", "mpirun", "--", "true")
    assert proc.returncode == 2 and "not inside a Slurm allocation" in proc.stderr, proc.stderr
    proc = run_launch(os.environ, "--retries", "-1", "--", "true")
    assert proc.returncode == 2 and "--retries must be >= 0" in proc.stderr


def test_launch_sets_the_progress_thread_only_when_told():
    """`launch --progress-thread on|off` sets Open MPI's TCP progress thread for every task, never
    over the user's own setting; `auto` (the default) leaves it to train/compare on each node."""
    from mpigossip.launch import launcher
    key = "OMPI_MCA_btl_tcp_progress_thread"
    assert key not in launcher.local_env({}) and key not in slurm.command("srun", ["p"], {})[1]
    for value, expected in (("on", "1"), ("off", "0")):
        for env in (slurm.command("srun", ["p"], {}, progress_thread=value)[1],
                    slurm.command("mpirun", ["p"], {"SLURM_NTASKS": "4", "MPIRUN": "mpirun"},
                                  progress_thread=value)[1]):
            assert env[key] == expected
    assert slurm.command("srun", ["p"], {key: "0"}, progress_thread="on")[1][key] == "0"
    with pytest.raises(slurm.LaunchError, match="auto, on or off"):
        slurm.command("srun", ["p"], {}, progress_thread=True)
    from mpigossip.__main__ import parse
    assert parse(["launch", "--progress-thread", "--", "true"]).progress_thread == "on"
    assert parse(["launch", "--progress-thread", "off", "--", "true"]).progress_thread == "off"
    assert parse(["launch", "--", "true"]).progress_thread == "auto"


def test_info_reports_one_sided_progress(monkeypatch):
    from mpigossip.launch import info
    monkeypatch.setenv("OMPI_MCA_btl_tcp_progress_thread", "1")
    assert info.one_sided_progress().startswith("on (Open MPI TCP progress thread)")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_progress_thread", "0")
    assert info.one_sided_progress().startswith("off: ")
