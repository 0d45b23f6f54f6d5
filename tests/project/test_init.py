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


# What the light path reads: a policy, a policy with a mistake, and a ds_config with a comment
# and a trailing comma (DeepSpeed reads those with hjson; validate must too, to name it).
_LIGHT_FILES = {
    "policy.yaml": "version: 1\ncheckpoint: {mode: full, modules: [Block]}\n",
    "typo.yaml": "version: 1\ncheckpoint: {mode: full, modlues: [Block]}\n",
    "ds_config.json": '{\n  // a comment\n  "train_batch_size": 8,\n  "activation_checkpointing": {},\n}\n',
}


def test_the_light_path_imports_only_the_base_install(tmp_path):
    """`actcfg validate`, `import` and `translate --merge` import nothing beyond the standard
    library and the base install's dependencies (with theirs): the pre-commit hook's environment
    and a CI job get exactly those. hjson was missing from them: a commented ds_config then
    read as a YAML syntax error in a fresh base install, not as the DeepSpeed config it is."""
    import importlib.metadata as metadata
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name, text in _LIGHT_FILES.items():
        (tmp_path / name).write_text(text)
    code = (
        "import sys; from actcfg.cli import main\n"
        "codes = [main(argv) for argv in (\n"
        "    ['validate', 'policy.yaml', 'typo.yaml', 'ds_config.json'],\n"
        "    ['import', 'ds_config.json', '--modules', 'Block'],\n"
        "    ['translate', 'policy.yaml', '--backend', 'deepspeed', '--merge', 'ds_config.json'])]\n"
        "print('CODES', codes)\n"
        "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
        "import json; print('FILES', json.dumps({m: str(getattr(sys.modules[m], '__file__', None))\n"
        "                                        for m in list(sys.modules) if '.' not in m}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=120)
    assert "error deepspeed-config" in out.stdout, out.stdout + out.stderr
    assert "CODES [1, 0, 0]" in out.stdout, out.stdout + out.stderr  # every path ran to its end
    assert '"train_batch_size": 8,' in out.stdout  # the merge printed the ds_config it edited
    imported = set(out.stdout.rsplit("MODULES ", 1)[1].split("\n", 1)[0].split()) - set(sys.stdlib_module_names)
    files = __import__("json").loads(out.stdout.rsplit("FILES ", 1)[1])
    # what the interpreter loads before any code (site's .pth files: certifi here)
    startup = subprocess.run([sys.executable, "-c", "import sys; print(' '.join(sys.modules))"],
                             capture_output=True, text=True, check=True).stdout.split()
    imported -= {"actcfg", *startup}

    def requires(dist: str) -> list[str]:
        try:
            return metadata.requires(dist) or []
        except metadata.PackageNotFoundError:  # a dependency for another platform, not installed
            return []

    def requirement(spec: str) -> str | None:
        name, _, marker = spec.partition(";")
        if "extra ==" in marker:
            return None  # an optional extra of that dependency, not installed with it
        return re.split(r"[<>=!~\[ (]", name.strip(), maxsplit=1)[0].lower().replace("_", "-")

    base = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    closure, todo = set(), [requirement(s) for s in base]
    while todo:
        dist = todo.pop()
        if dist is None or dist in closure:
            continue
        closure.add(dist)
        todo.extend(requirement(s) for s in requires(dist))
    owners = metadata.packages_distributions()
    # Judged by the distribution that installed each module. None installed these: the script
    # itself, the interpreter's own files (`_sysconfigdata_*`, beside the standard library) and
    # the module entries a Cython extension (PyYAML's) adds.
    import sysconfig

    stdlib = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib"))
    unowned = {m for m in imported - set(owners) if m != "__main__" and not m.startswith("_cython_")
               and m != "cython_runtime" and not files.get(m, "None").startswith(stdlib)}
    assert unowned == set(), f"imported, installed by no distribution: {sorted(unowned)}"
    outside = {m: owners[m] for m in imported
               if m in owners and not {d.lower().replace("_", "-") for d in owners[m]} & closure}
    assert outside == {}, f"imported, not in the base install ({sorted(closure)}): {outside}"
