"""The one-sided progress decision (mpigossip.onesided.progress): Open MPI's TCP progress thread on for
one-sided methods across nodes when each rank has a core, never over a setting already made."""

import os

import pytest

from mpigossip.onesided import progress
from mpigossip.onesided.progress import CORES_VARIABLE, VARIABLE, decide

# Open MPI's mpirun: 2 of 8 ranks on this node; srun: 1 task on node 2 of "2(x2),1"; Hydra.
MPIRUN = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "8"}
SRUN = {"SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2"}
HYDRA = {"MPI_LOCALNRANKS": "4", "PMI_SIZE": "16"}


def test_placement_from_each_launcher():
    assert progress.placement(MPIRUN) == (2, 8)
    assert progress.placement(SRUN) == (1, 5)
    assert progress.placement(dict(SRUN, SLURM_NODEID="0")) == (2, 5)
    assert progress.placement(HYDRA) == (4, 16)
    assert progress.placement({}) == (None, None)
    assert progress.placement({"SLURM_STEP_TASKS_PER_NODE": "2(x", "SLURM_NODEID": "0"}) == (None, None)
    assert progress.expand_counts("3,2(x3)") == [3, 2, 2, 2]


@pytest.mark.parametrize("env, algorithms, on, why", [
    (dict(MPIRUN, **{CORES_VARIABLE: "2"}), ["easgd"], True, "easgd across nodes, 2 ranks on a node of 2 cores"),
    (dict(MPIRUN, **{CORES_VARIABLE: "1"}), ["gossip-pull"], False, "no core for the thread"),
    (dict(MPIRUN, SLURM_CPUS_ON_NODE="4"), ["sgp", "asgd"], True, "asgd across nodes"),
    (dict(MPIRUN, SLURM_CPUS_ON_NODE="4", **{CORES_VARIABLE: "0"}), ["adpsgd"], False, "no core"),
    (dict(MPIRUN, **{CORES_VARIABLE: "8"}), ["allreduce", "sgp", "agp"], False, "no one-sided method"),
    (dict(SRUN, SLURM_CPUS_ON_NODE="1"), ["easgd"], True, "1 rank on a node of 1 core"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"}, ["easgd"], False, "one node"),
    ({CORES_VARIABLE: "8"}, ["easgd"], False, "does not say how many ranks"),
    (dict(MPIRUN, **{CORES_VARIABLE: "8", VARIABLE: "0"}), ["easgd"], False, "as set"),
    (dict(MPIRUN, **{CORES_VARIABLE: "0", VARIABLE: "1"}), ["sgp"], True, "as set"),
])
def test_decide(env, algorithms, on, why):
    decision = decide(algorithms, env)
    assert decision.on is on and why in decision.reason, decision
    assert decision.changed is (on and VARIABLE not in env)
    assert decision.describe().startswith(f"one-sided progress: Open MPI's TCP progress thread {'on' if on else 'off'}")


def test_apply_sets_the_variable_only_when_it_turns_the_thread_on():
    env = dict(MPIRUN, **{CORES_VARIABLE: "4"})
    assert progress.apply(["easgd"], env).on and env[VARIABLE] == "1"
    env = dict(MPIRUN, **{CORES_VARIABLE: "1"})
    assert not progress.apply(["easgd"], env).on and VARIABLE not in env
    with pytest.raises(ValueError, match="whole number of cores"):
        progress.apply(["easgd"], dict(MPIRUN, **{CORES_VARIABLE: "two"}))


def test_train_decides_before_mpi_starts(monkeypatch):
    """The command line applies the decision before the training job (and MPI) starts."""
    from mpigossip import __main__ as main
    from mpigossip.train import compare, job
    seen = {}
    monkeypatch.setattr(job, "main", lambda args, arrival=None: seen.setdefault("train", os.environ.get(VARIABLE)) and 0)
    monkeypatch.setattr(compare, "main", lambda args: seen.setdefault("compare", os.environ.get(VARIABLE)) and 0)
    for key, value in dict(MPIRUN, **{CORES_VARIABLE: "2"}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(VARIABLE, "")   # unset, as decide() reads it; restored afterwards
    main._run(main.parse(["train", "--algorithm", "sgp"]))
    assert seen["train"] == ""
    main._run(main.parse(["compare", "--algorithms", "sgp", "gossip-pull"]))
    assert seen["compare"] == "1"
