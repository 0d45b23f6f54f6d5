"""checker: every configs/ and tests/data file is a case with exact codes and positions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from actcfg.policy.checker import check_file, check_text, load
from actcfg.policy.diagnostics import Diagnostic
from actcfg.errors import ActcfgError, ConfigLoadError
from actcfg.policy.schema import Backend, Policy
from conftest import CONFIGS, DATA

VALID = sorted((DATA / "valid").glob("*.yaml"))
INVALID = sorted((DATA / "invalid").glob("*.yaml"))
EXPECTED = json.loads((DATA / "invalid" / "expected.json").read_text())


def _at(path: Path) -> str | None:
    """The `# at: KEY` header of a data file, if any."""
    match = re.search(r"^# at: (\S+)$", path.read_text(), re.M)
    return match.group(1) if match else None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_is_valid(path):
    policy, diagnostics = check_file(path)
    assert isinstance(policy, Policy)
    assert [d for d in diagnostics if d.severity == "error"] == []
    assert path.read_text().startswith("# yaml-language-server: $schema=../docs/actcfg.schema.json\n")


def test_configs_cover_the_worked_examples():
    assert {p.name for p in CONFIGS} >= {
        "deepspeed-cpu-checkpointing.yaml",
        "torch-checkpoint-offload.yaml",
        "torch-selective.yaml",
        "deepspeed-partition-model-parallel.yaml",
        "torch-offload-all.yaml",
    }


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_data(path):
    policy, diagnostics = check_file(path, at=_at(path))
    assert diagnostics == []
    assert isinstance(policy, Policy)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_data(path):
    policy, diagnostics = check_file(path, at=_at(path))
    assert policy is None
    assert [[d.line, d.column, d.code] for d in diagnostics] == EXPECTED[path.name]
    for d in diagnostics:
        assert d.file == str(path) and d.severity == "error" and d.message and d.hint


def test_every_invalid_file_has_expectations():
    assert sorted(EXPECTED) == [p.name for p in INVALID]


def test_seed_bug_checkpoint_in_cpu_names_the_key_and_its_origin():
    _, [d] = check_file(DATA / "invalid" / "seed-checkpoint-in-cpu.yaml")
    assert d == Diagnostic(
        str(DATA / "invalid" / "seed-checkpoint-in-cpu.yaml"), 7, 1, "unknown-key", "error",
        "unknown key `checkpoint_in_cpu` at the top level",
        "`checkpoint_in_cpu` is the keyword of deepspeed.checkpointing.configure(); "
        "in actcfg it is `cpu_checkpointing`",
    )


def test_yes_is_refused_with_the_true_false_hint():
    _, [d] = check_file(DATA / "invalid" / "yaml11-boolean.yaml")
    assert d.message == "`cpu_checkpointing` must be a boolean (true or false), got string 'yes'"
    assert d.hint == "YAML 1.1 reads `yes` as a boolean, actcfg does not guess: write true or false"


def test_section_positions_are_those_of_the_whole_file(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("lr: 1\ntrain:\n  act:\n    version: 1\n    pin: 3\n")
    _, [d] = check_file(path, at="train.act")
    assert (d.line, d.column, d.code) == (5, 10, "wrong-type")


def test_section_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("train:\n  act: [1, 2]\n")
    _, [d] = check_file(path, at="train.act")
    assert (d.line, d.column, d.code) == (2, 8, "yaml-not-mapping")


def test_duplicate_key_outside_the_section_is_not_reported(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("lr: 1\nlr: 2\nact:\n  version: 1\n")
    policy, diagnostics = check_file(path, at="act")
    assert diagnostics == [] and policy == Policy(version=1)


def test_backend_flag_adds_that_backends_rules():
    path = next(p for p in CONFIGS if p.name == "torch-offload-all.yaml")
    assert check_file(path)[1] == []
    policy, diagnostics = check_file(path, backends=(Backend.DEEPSPEED,))
    assert policy is None
    assert [(d.code, d.line, d.column) for d in diagnostics] == [
        ("needs-checkpointing", 8, 20),  # cpu_checkpointing with mode none
        ("torch-only", 9, 13),  # pin_budget
    ]
    assert diagnostics[0].message.endswith("(deepspeed backend, from --backend), but checkpoint.mode is "
                                           "none: it would do nothing")


def test_warnings_come_from_check_rules():
    path = next(p for p in CONFIGS if p.name == "deepspeed-partition-model-parallel.yaml")
    policy, [d] = check_file(path)
    assert policy is not None
    assert (d.code, d.severity, d.line, d.column) == ("partition-needs-model-parallel", "warning", 10, 12)


def test_rule_findings_are_one_diagnostic_each(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nbackend: deepspeed\ncontiguous: true\n")
    _, diagnostics = check_file(path)
    assert [d.code for d in diagnostics] == ["contiguous-needs-partition", "needs-checkpointing"]
    assert {(d.line, d.column) for d in diagnostics} == {(3, 13)}


@pytest.mark.parametrize(("key", "hint"), [
    # Under `mode: full` the hint offered `save_ops` (a selective-only key): renaming the typo
    # to it only led to the next error.
    ("save_op", "valid keys here: `modules`, `every`, `reentrant`, `mode`"),
    ("zzz", "valid keys here: `modules`, `every`, `reentrant`, `mode`"),
    ("save_ops", "`save_ops` is valid only with `mode: selective`"),
    ("modles", "did you mean `modules`?"),
])
def test_unknown_key_under_mode_full_is_hinted_with_full_keys_only(key, hint):
    text = f"version: 1\ncheckpoint:\n  mode: full\n  modules: [Block]\n  {key}: 1\n"
    assert check_text(text) == (None, [Diagnostic(
        "<string>", 5, 3, "unknown-key", "error", f"unknown key `{key}` under `checkpoint:`", hint)])


# --- load() ------------------------------------------------------------------------------


def test_load_accepts_path_str_yaml_dict_and_policy(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ncpu_checkpointing: true\n")
    expected = Policy(version=1, cpu_checkpointing=True)
    assert load(path) == expected
    assert load(str(path)) == expected
    assert load("version: 1\ncpu_checkpointing: true\n") == expected
    assert load({"version": 1, "cpu_checkpointing": True}) == expected
    assert load(expected) is expected
    assert load({"train": {"version": 1}}, at="train") == Policy(version=1)


def test_load_raises_with_every_error_as_text():
    with pytest.raises(ConfigLoadError) as info:
        load("version: 1\npartition: yes\ncheckpoint_in_cpu: true\n")
    assert str(info.value) == (
        "invalid actcfg policy:\n"
        "<string>:2:12: error wrong-type: `partition` must be a boolean (true or false), got "
        "string 'yes' (YAML 1.1 reads `yes` as a boolean, actcfg does not guess: write true or false)\n"
        "<string>:3:1: error unknown-key: unknown key `checkpoint_in_cpu` at the top level "
        "(`checkpoint_in_cpu` is the keyword of deepspeed.checkpointing.configure(); in actcfg "
        "it is `cpu_checkpointing`)"
    )
    assert [d.code for d in info.value.diagnostics] == ["wrong-type", "unknown-key"]


def test_load_missing_path_is_file_not_found():
    with pytest.raises(ConfigLoadError, match=r"^invalid actcfg policy:\nno/such.yaml: error file-not-found"):
        load("no/such.yaml")


def test_load_dict_errors_have_no_position():
    with pytest.raises(ConfigLoadError) as info:
        load({"version": 1, "pin": "false"})
    [d] = info.value.diagnostics
    assert (d.file, d.line, d.column, d.code) == ("<dict>", None, None, "wrong-type")


def test_load_policy_rechecked_against_backends():
    policy = Policy(version=1, cpu_checkpointing=True)
    with pytest.raises(ConfigLoadError, match="needs-checkpointing"):
        load(policy, backends=("deepspeed",))


@pytest.mark.parametrize("call", [
    lambda: load("version: 1\n", backends=["deepsped"]),
    lambda: check_text("version: 1\n", backends=("torch", "deepsped")),
])
def test_an_unknown_backend_is_refused_with_the_choices(call):
    with pytest.raises(ActcfgError,
                       match=r"^unknown backend 'deepsped': choose one of deepspeed, hf, lightning, torch$"):
        call()


def test_load_refuses_other_types():
    with pytest.raises(ConfigLoadError, match=r"^cannot load a policy from a int"):
        load(3)


def test_top_level_package_load_delegates():
    import actcfg

    assert actcfg.load("version: 1\n") == Policy(version=1)


@pytest.mark.parametrize(("text", "written", "kind"), [
    ("~", "~", "null"), ("null", "null", "null"), ("true", "true", "boolean true"),
    ("1", "1", "integer 1"),
])
def test_a_key_that_is_not_a_name_is_named_as_written_where_written(tmp_path, text, written, kind):
    # Pydantic names such a key by its Python value (`None`, `1` for `true`) at no position.
    path = tmp_path / "p.yaml"
    path.write_text(f"version: 1\ncheckpoint:\n  mode: none\n  {text}: 2\n")
    _, [d] = check_file(path)
    assert (d.line, d.column, d.code) == (4, 3, "unknown-key")
    assert d.message == f"unknown key `{written}` under `checkpoint:`: YAML reads it as {kind}, not a name"


def test_a_null_module_is_one_wrong_type_not_also_an_empty_list(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ncheckpoint: {mode: full, modules: [~]}\n")
    _, diagnostics = check_file(path)
    assert [(d.code, d.message) for d in diagnostics] == [
        ("wrong-type", "`checkpoint.modules.0` must be a string, got null")]
    path.write_text("version: 1\ncheckpoint: {mode: full, modules: []}\n")
    assert [d.code for d in check_file(path)[1]] == ["out-of-range"]
