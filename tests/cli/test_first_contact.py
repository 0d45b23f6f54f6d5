"""What a new user meets on a fresh machine (issue 19): each documented path works as written or
says what it needs, and every install hint works from a checkout (no package index has actcfg)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _timeouts import scaled
from conftest import CONFIGS, ROOT

from actcfg.errors import install_command

SEED = ROOT / "configs" / "seed-linear-offload.yaml"


def test_verify_without_torch_says_it_needs_torch_and_the_extra_not_the_probe_import(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as on a base install
    done = run_cli("verify", SEED)
    assert (done.code, done.err) == (2, "actcfg: error: actcfg verify needs torch, which is not installed: "
                                        "python -m pip install -e '.[torch]' in the actcfg checkout\n")


def test_plan_without_torch_says_it_needs_torch_before_importing_the_model(run_cli, monkeypatch, tmp_path):
    # It imported the model first: "cannot import actcfg.probes: No module named 'torch'".
    monkeypatch.setitem(sys.modules, "torch", None)
    done = run_cli("plan", ROOT / "configs" / "torch-memory-budget.yaml", "--model", "actcfg.probes:blocks",
                   "-o", tmp_path / "plan.yaml")
    assert (done.code, done.err) == (2, "actcfg: error: actcfg plan needs torch, which is not installed: "
                                        "python -m pip install -e '.[torch]' in the actcfg checkout\n")
    assert not (tmp_path / "plan.yaml").exists()


def test_verify_on_a_base_install_in_a_fresh_interpreter_says_the_same():
    """The subprocess that finds no torch: a meta-path finder refuses it, as a missing package."""
    code = (
        "import sys, importlib.abc\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from actcfg.cli import main\n"
        f"sys.exit(main(['verify', {str(SEED)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=scaled(120))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("actcfg: error: actcfg verify needs torch, which is not "
                                            "installed: python -m pip install -e '.[torch]' in the actcfg checkout")
    assert "probes" not in proc.stderr


@pytest.mark.parametrize("extra", ["torch", "plot", "deepspeed"])
def test_every_install_hint_names_an_extra_pyproject_defines_and_installs_from_the_checkout(extra):
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras
    assert install_command(extra) == f"python -m pip install -e '.[{extra}]' in the actcfg checkout"


def test_no_message_or_doc_advises_an_install_from_the_package_index():
    import re

    offenders = []
    for path in [*(ROOT / "actcfg").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                 ROOT / ".pre-commit-hooks.yaml"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pip install (-q )?actcfg\b", line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("name", ["torch-checkpoint-offload.yaml", "torch-rules.yaml", "torch-offload-all.yaml",
                                  "seed-linear-offload.yaml", "deepspeed-cpu-checkpointing.yaml"])
def test_each_bundled_policy_that_offloads_says_it_needs_a_gpu(name):
    assert (ROOT / "configs" / name) in CONFIGS
    header = [line for line in (ROOT / "configs" / name).read_text().splitlines() if line.startswith("#")]
    assert any("needs a CUDA GPU" in line for line in header), header


@pytest.mark.parametrize("probe", ["blocks", "linear_chain"])
def test_a_probe_model_on_a_machine_without_a_gpu_is_a_sentence_with_a_cpu_call(probe):
    # The README's memory-budget snippet, run on a CPU, ended in torch's "Torch not compiled
    # with CUDA enabled" traceback from inside the probe.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe builds on it")
    import re

    from actcfg import ActcfgError, probes

    factory = getattr(probes, probe)
    with pytest.raises(ActcfgError, match=rf"^actcfg\.probes\.{probe} builds its model on the GPU") as e:
        factory()
    call = re.search(rf"e\.g\. ({probe}\(.*\))$", str(e.value)).group(1)
    model, x = eval(call, {probe: factory, "torch": torch})  # the suggested call works as written
    assert next(model.parameters()).device.type == x.device.type == "cpu"
