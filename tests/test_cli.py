"""cli: exit codes, formats, and the wiring of validate, schema, translate and import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import actcfg.cli
from actcfg.schema import policy_json_schema
from conftest import CONFIGS, DATA, ROOT

DS_CPU = ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"
PARTITION = ROOT / "configs" / "deepspeed-partition-model-parallel.yaml"
OFFLOAD_ALL = ROOT / "configs" / "torch-offload-all.yaml"
SEED = DATA / "invalid" / "seed-checkpoint-in-cpu.yaml"


# --- validate ------------------------------------------------------------------------------


def test_validate_all_configs_exit_0(run_cli):
    result = run_cli("validate", *CONFIGS)
    assert result.code == 0
    assert result.err.endswith(f"actcfg: {len(CONFIGS)} files checked: 0 errors, 1 warning\n")


def test_validate_invalid_exit_1_with_text_lines(run_cli):
    result = run_cli("validate", SEED, DS_CPU)
    assert result.code == 1
    assert result.out == (
        f"{SEED}:7:1: error unknown-key: unknown key `checkpoint_in_cpu` at the top level "
        "(`checkpoint_in_cpu` is the keyword of deepspeed.checkpointing.configure(); "
        "in actcfg it is `cpu_checkpointing`)\n"
    )
    assert result.err == "actcfg: 2 files checked: 1 error, 0 warnings\n"


@pytest.mark.parametrize("bad", ["missing.yaml", "."])
def test_unreadable_file_exit_2(run_cli, bad):
    result = run_cli("validate", DS_CPU, bad)
    assert result.code == 2
    code = "file-not-found" if bad == "missing.yaml" else "file-unreadable"
    assert result.out.startswith(f"{bad}: error {code}: ")


@pytest.mark.parametrize(
    "argv", [(), ("validate",), ("validate", "--format", "xml", "f.yaml"), ("bogus",),
             ("validate", "--backend", "jax", "f.yaml")],
)
def test_usage_errors_exit_2(run_cli, argv):
    result = run_cli(*argv)
    assert result.code == 2 and "usage: actcfg" in result.err


def test_help_and_version_exit_0(run_cli):
    assert run_cli("--help").code == 0
    result = run_cli("--version")
    assert result.code == 0 and result.out.startswith("actcfg ")


def test_strict_turns_warnings_into_failure(run_cli):
    assert run_cli("validate", PARTITION).code == 0
    result = run_cli("validate", "--strict", PARTITION)
    assert result.code == 1
    assert result.out.startswith(f"{PARTITION}:10:12: warning partition-needs-model-parallel: ")


def test_backend_flag(run_cli):
    assert run_cli("validate", OFFLOAD_ALL).code == 0
    result = run_cli("validate", "--backend", "deepspeed", OFFLOAD_ALL)
    assert result.code == 1
    assert [line.split(": ")[0:2] for line in result.out.splitlines()] == [
        [f"{OFFLOAD_ALL}:8:20", "error needs-checkpointing"],
        [f"{OFFLOAD_ALL}:9:13", "error torch-only"],
    ]


def test_at_selects_a_section(run_cli):
    path = DATA / "valid" / "section-of-training-yaml.yaml"
    assert run_cli("validate", "--at", "training.memory", path).code == 0
    result = run_cli("validate", path)
    assert result.code == 1 and "missing required key `version`" in result.out


def test_json_format(run_cli):
    result = run_cli("validate", "--format", "json", SEED, PARTITION)
    assert result.code == 1 and result.err == ""
    body = json.loads(result.out)
    assert body["status"] == "invalid"
    assert [(e["file"], e["line"], e["column"], e["code"], e["severity"]) for e in body["errors"]] == [
        (str(SEED), 7, 1, "unknown-key", "error"),
        (str(PARTITION), 10, 12, "partition-needs-model-parallel", "warning"),
    ]
    assert json.loads(run_cli("validate", "--format", "json", DS_CPU).out) == {"status": "ok", "errors": []}


def test_github_format_is_automatic_under_actions(run_cli, monkeypatch):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result = run_cli("validate", SEED)
    lines = result.out.splitlines()
    assert lines[0].startswith(f"::error file={SEED},line=7,col=1,title=actcfg unknown-key::unknown key")
    assert lines[1].startswith(f"{SEED}:7:1: error unknown-key:")
    assert result.code == 1
    assert run_cli("validate", "--format", "text", SEED).out.startswith(f"{SEED}:7:1:")


def test_internal_error_is_reported_not_raised(run_cli, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kaput")

    monkeypatch.setattr(actcfg.cli, "check_file", boom)
    result = run_cli("validate", DS_CPU)
    assert result.code == 2
    assert result.err == "actcfg: internal error, please report: RuntimeError: kaput\n"


# --- schema ------------------------------------------------------------------------------


def test_schema_prints_the_json_schema(run_cli, tmp_path):
    result = run_cli("schema")
    assert result.code == 0 and json.loads(result.out) == policy_json_schema()
    assert run_cli("schema", "-o", tmp_path / "s.json").code == 0
    assert json.loads((tmp_path / "s.json").read_text()) == policy_json_schema()


# --- translate and import --------------------------------------------------------------


def test_translate_deepspeed_carries_cpu_checkpointing_through_both_surfaces(run_cli):
    result = run_cli("translate", DS_CPU, "--backend", "deepspeed")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert set(out) >= {"activation_checkpointing", "configure_kwargs", "route"}
    assert out["activation_checkpointing"]["cpu_checkpointing"] is True
    assert out["configure_kwargs"]["checkpoint_in_cpu"] is True


def test_translate_defaults_to_the_policy_backend_and_writes_out(run_cli, tmp_path):
    target = tmp_path / "out.json"
    assert run_cli("translate", DS_CPU, "-o", target).code == 0
    assert json.loads(target.read_text())["configure_kwargs"]["checkpoint_in_cpu"] is True


def test_translate_torch(run_cli):
    result = run_cli("translate", ROOT / "configs" / "torch-checkpoint-offload.yaml", "--backend", "torch")
    assert result.code == 0, result.err
    assert json.loads(result.out)  # the plan; its exact shape is pinned in tests/golden


def test_translate_refuses_what_the_backend_cannot_express(run_cli):
    result = run_cli("translate", OFFLOAD_ALL, "--backend", "deepspeed")
    assert result.code == 1 and result.out == ""
    assert result.err.startswith(f"{OFFLOAD_ALL}:8:20: error needs-checkpointing:")


def test_translate_invalid_policy_exit_1(run_cli):
    result = run_cli("translate", SEED)
    assert result.code == 1 and result.out == ""
    assert result.err.startswith(f"{SEED}:7:1: error unknown-key:")
    assert run_cli("translate", "missing.yaml").code == 2


def test_translate_merge(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": True}}))
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 0, result.err
    merged = json.loads(result.out)
    assert merged["train_batch_size"] == 8
    assert merged["activation_checkpointing"]["cpu_checkpointing"] is True
    assert merged["activation_checkpointing"]["partition_activations"] is False


def test_translate_merge_refuses_a_conflict(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": False}}))
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 1 and result.out == ""
    assert result.err.startswith(f"{ds}: error ds-config-conflict: activation_checkpointing.cpu_checkpointing")


def test_translate_merge_bad_json_has_line_and_column(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"train_batch_size": 8,\n  "activation_checkpointing": {,}}\n')
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 1
    assert result.err.startswith(f"{ds}:2:32: error json-syntax: invalid JSON: ")


def test_translate_merge_needs_deepspeed(run_cli, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    result = run_cli("translate", OFFLOAD_ALL, "--merge", ds)
    assert result.code == 2
    assert result.err == "actcfg: error: --merge needs the deepspeed backend (it edits a ds_config)\n"


def test_import_prints_yaml_and_warns_about_ignored_keys(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"activation_checkpointing": {
        "cpu_checkpointing": True, "checkpoint_in_cpu": True, "partition_activations": "false"}}))
    result = run_cli("import", ds)
    assert result.code == 0, result.err
    err_keys = [line.split("`")[1] for line in result.err.splitlines()]
    assert err_keys == ["checkpoint_in_cpu", "partition_activations"]
    assert all(line.startswith(f"{ds}: warning ignored-key: ") for line in result.err.splitlines())
    assert "cpu_checkpointing: true" in result.out and "version: 1" in result.out


def test_import_bad_json(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text("[1, 2]")
    result = run_cli("import", ds)
    assert result.code == 1 and "a ds_config is a JSON object" in result.err
    assert run_cli("import", tmp_path / "missing.json").code == 2


# --- real processes ------------------------------------------------------------------------


def _python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"} | env
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=environ, timeout=60)


def test_python_m_actcfg_validate():
    proc = _python("-m", "actcfg", "validate", str(SEED))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"{SEED}:7:1: error unknown-key:")
    assert "Traceback" not in proc.stderr


def test_python_m_actcfg_github_from_env():
    proc = _python("-m", "actcfg", "validate", str(SEED), GITHUB_ACTIONS="true")
    assert proc.returncode == 1 and proc.stdout.startswith("::error file=")


def test_validate_imports_neither_torch_nor_deepspeed():
    code = (
        "import sys\n"
        "from actcfg.cli import main\n"
        f"rc = main(['validate', {str(DS_CPU)!r}, {str(SEED)!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed'))\n"
        "print(rc, heavy)\n"
    )
    proc = _python("-c", code)
    assert proc.stdout.splitlines()[-1] == "1 []", proc.stderr


def test_pre_commit_hook_runs_validate(run_cli):
    import re

    import yaml

    [hook] = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert (hook["id"], hook["entry"], hook["language"], hook["types"]) == (
        "actcfg-validate", "actcfg validate", "python", ["yaml"])
    files = re.compile(hook["files"])
    assert all(files.search(str(p.relative_to(ROOT))) for p in CONFIGS)
    assert not files.search("docs/other.yaml") and not files.search(".pre-commit-hooks.yaml")
    assert run_cli(*hook["entry"].split()[1:], *CONFIGS).code == 0
