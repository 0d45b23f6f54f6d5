"""The deepspeed route of every ported peer test, in one subprocess capped in memory and time:
DeepSpeed keeps process-wide state, its first init compiles an op (once here, not once per
file), and a regression on this route (backward re-entering itself) once took 17 GB and the
machine with it. Each test file also runs its other routes in the pytest process."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    from tests.peer._capped import assert_passed
except ImportError:  # pytest's rootdir-relative import mode
    from peer._capped import assert_passed

HERE = Path(__file__).parent


@pytest.mark.deepspeed
@pytest.mark.slow
def test_every_peer_test_on_the_deepspeed_route():
    pytest.importorskip("deepspeed")
    files = sorted(str(p) for p in HERE.glob("test_*.py") if p.name != Path(__file__).name)
    out = assert_passed([*files, "-m", "deepspeed and not slow"], timeout_s=600, memory_gib=10)
    assert " skipped" not in out.strip().splitlines()[-1]  # each case ran on DeepSpeed
