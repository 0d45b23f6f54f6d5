"""`--help`: every command shows examples and its exit codes, and the examples that need no GPU
and name only bundled files run as written (issue 19, item 5)."""

from __future__ import annotations

import glob
import shlex

import pytest
from conftest import ROOT

from actcfg.cli import COMMANDS, EPILOGS


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)], ids=["actcfg", *COMMANDS])
def test_help_ends_with_examples_and_exit_codes(run_cli, command):
    run = run_cli(*command, "--help")
    assert run.code == 0
    epilog = EPILOGS[command[0] if command else "actcfg"]
    assert run.out.endswith(epilog + "\n")
    assert epilog.startswith("examples") and "\nexit codes: 0" in epilog


def _bundled_examples() -> list[list[str]]:
    """Example lines that name only files of this checkout and need no GPU."""
    out: list[list[str]] = []
    for name, epilog in EPILOGS.items():
        if "GPU" in epilog.split("\n", 1)[0]:
            continue
        for line in epilog.split("\n\n", 1)[0].splitlines()[1:]:
            if "(GPU)" in line:
                continue
            words = shlex.split(line.strip())
            files = [w for w in words[2:] if "/" in w or w.endswith((".yaml", ".json", ".yml"))]
            if words[0] == "actcfg" and files and all(w.startswith("configs/") and "-o" not in words
                                                       for w in files):
                if words[1:] not in out:
                    out.append(words[1:])
    return out


@pytest.mark.parametrize("argv", _bundled_examples(), ids=" ".join)
def test_bundled_examples_run_as_written(run_cli, monkeypatch, argv):
    monkeypatch.chdir(ROOT)
    expanded = [p for a in argv for p in (sorted(glob.glob(a)) if "*" in a else [a])]
    assert run_cli(*expanded).code == 0
