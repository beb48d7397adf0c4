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


def test_readme_documents_every_cli_flag():
    from mpigossip.__main__ import build_parser
    readme = read("README.md")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, cmd in sub.choices.items():
        assert f"mpigossip {name}" in readme, name
        for action in cmd._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert re.search(re.escape(flag) + r"\b", readme), f"README.md lacks {name} {flag}"
