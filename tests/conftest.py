"""Shared fixtures: repository paths and `run_cli`, which drives `actcfg.cli.main` in-process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from actcfg.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DATA = ROOT / "tests" / "data"


@dataclasses.dataclass
class CliRun:
    """What one `actcfg` invocation printed and returned."""

    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Call `main(argv)` and capture stdout, stderr and the exit code (GITHUB_ACTIONS unset)."""
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)

    def run(*argv: str) -> CliRun:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliRun(code, captured.out, captured.err)

    return run
