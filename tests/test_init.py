"""The public API: what `actcfg.__all__` names exists, and `import actcfg` stays light."""

from __future__ import annotations

import subprocess
import sys

import actcfg


def test_every_public_name_resolves():
    assert all(getattr(actcfg, name) is not None for name in actcfg.__all__)
    assert issubclass(actcfg.OffloadError, actcfg.PolicyApplyError)
    from actcfg.runtime import AppliedPolicy

    assert actcfg.AppliedPolicy is AppliedPolicy


def test_import_loads_neither_torch_nor_deepspeed():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, actcfg; actcfg.load('version: 1\\n');"
         "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "[]"
