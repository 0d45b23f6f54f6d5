"""Run a pytest selection in a subprocess under a memory cap (RLIMIT_AS) and a time cap, so
that a regression that recurses or grows without bound fails instead of taking the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_INNER = """
import resource, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def run_capped(pytest_args: list[str], *, timeout_s: int = 300, memory_gib: int = 10) -> tuple[int, str]:
    """(exit code, output) of `pytest pytest_args` in a capped subprocess; exit code -9 and a
    note in the output when it ran past `timeout_s`."""
    env = {**os.environ, "ACTCFG_CAPPED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", _INNER, str(memory_gib << 30), "-q", "-p", "no:cacheprovider",
         *pytest_args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: DeepSpeed's compiler too
        out, _ = proc.communicate()
        return -9, f"{out}\n[killed after {timeout_s} s]"


def assert_passed(pytest_args: list[str], **caps: int) -> str:
    """Run capped and fail with the output's tail unless every selected test passed."""
    code, out = run_capped(pytest_args, **caps)
    assert code == 0, f"capped run exited {code}:\n{out[-6000:]}"
    assert " passed" in out and " failed" not in out, out[-6000:]
    return out
