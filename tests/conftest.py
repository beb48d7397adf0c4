import os

# Short deadlines in tests: a deadlock or a lost message fails within a minute.
os.environ.setdefault("MPIGOSSIP_TIMEOUT", "60")

# The long end-to-end pieces, each a timed step of its own in tests/run.sh (pytest -m NAME).
STEPS = {
    "train": "the training job end to end under mpiexec (tests/test_train.py)",
    "reproduce": "python -m mpigossip reproduce --quick end to end",
    "slurm": "the jobs/ scripts on a local Slurm (tests/test_slurm.py)",
    "faults": "lost and killed ranks under mpiexec, with and without ULFM (tests/test_faults.py)",
    "resume": "the training job's checkpoints and resumes (tests/test_train.py; with the train marker)",
}


def pytest_configure(config):
    for name, what in STEPS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
