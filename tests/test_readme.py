"""README.md stays true: its set-up and test commands are the ones CI runs."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_ci_runs_the_readme_commands():
    readme, ci = read("README.md"), read(".ci/run")
    commands = [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd ", "rm "))]
    assert len(commands) == 2
    for command in commands:
        assert command in readme, f"README.md lacks the CI command: {command}"


def test_readme_documents_every_cli_flag_and_docs_every_benchmark():
    from mpigossip.__main__ import build_parser
    readme = read("README.md")
    guide = readme + read(os.path.join("docs", "TRAIN.md"))   # README links the flag reference
    assert "docs/TRAIN.md" in readme
    _, commands = build_parser()
    for name, cmd in commands.items():
        assert f"mpigossip {name}" in readme, name
        for action in cmd._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert re.search(re.escape(flag) + r"\b", guide), f"README.md and docs/TRAIN.md lack {name} {flag}"
    benchmarks = read(os.path.join("docs", "BENCHMARKS.md"))   # README links it
    assert "docs/BENCHMARKS.md" in readme
    for script in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
        if script.endswith((".py", ".sh")) and not script.startswith("_"):  # _timing.py: a shared helper
            assert f"benchmarks/{script}" in benchmarks, f"docs/BENCHMARKS.md lacks {script}"


def test_readme_python_snippets_are_python():
    """Every ```python block of README compiles (a `...compute...` placeholder did not)."""
    blocks = re.findall(r"```python\n(.*?)```", read("README.md"), re.S)
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        compile(block, f"README.md python block {i + 1}", "exec")


def test_readme_info_sample_matches_info():
    """The `info` sample's lines are the ones `info` prints (the machine's values aside)."""
    from mpigossip.launch import info
    sample = read("README.md").split("python -m mpigossip info\n", 1)[1].split("```", 1)[0]
    assert sample.startswith("mpigossip ") and "thread level:" in sample and "world size:" in sample
    assert "one-sided progress across nodes:" in sample
    source = open(info.__file__).read()
    for label in ("thread level:", "CUDA-aware MPI:", "one-sided progress across nodes:", "world size:",
                  "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        assert label in source, label
