"""The public API: what `actcfg.__all__` names exists, and `import actcfg` stays light."""

from __future__ import annotations

import subprocess
import sys

import actcfg


def test_every_public_name_is_what_it_says():
    import inspect

    functions = {"apply", "load", "strip_policy", "translate", "verify"}
    errors = {n for n in actcfg.__all__ if n.endswith("Error")}
    assert {n for n in actcfg.__all__ if inspect.isfunction(getattr(actcfg, n))} == functions
    assert all(issubclass(getattr(actcfg, n), actcfg.ActcfgError) for n in errors)
    assert issubclass(actcfg.ActcfgError, ValueError)
    assert issubclass(actcfg.OffloadError, actcfg.PolicyApplyError)
    assert actcfg.Policy.__module__ == "actcfg.policy.schema"
    assert [b.value for b in actcfg.Backend] == ["deepspeed", "hf", "lightning", "torch"]
    assert isinstance(actcfg.__version__, str) and actcfg.__version__[0].isdigit()
    from actcfg.runtime.handle import AppliedPolicy

    assert actcfg.AppliedPolicy is AppliedPolicy


def test_import_loads_neither_torch_nor_deepspeed():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, actcfg; actcfg.load('version: 1\\n');"
         "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "[]"


def test_ci_runs_exactly_the_readmes_test_command():
    """README's second command is what CI runs (.ci/run): one command, in both places."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    ci = [line for line in (root / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands[1]]
    for extra in ("hf", "lightning", "deepspeed", "test"):  # the stacks the tests go through
        assert extra in commands[1].split("'")[1]
