"""cli: exit codes, formats, and the wiring of validate, schema, translate and import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import actcfg.cli
import actcfg.cli.validate
from actcfg.policy.checker import check_file
from actcfg.policy.schema import policy_json_schema
from _timeouts import scaled
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

    monkeypatch.setattr(actcfg.cli.validate, "check_file", boom)
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


def test_translate_merge_refuses_every_conflict_with_its_line(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  "activation_checkpointing": {\n    "cpu_checkpointing": "true",\n'
                  '    "checkpoint_in_cpu": true,\n    "profile": 1\n  }\n}\n')
    before = ds.read_bytes()
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 1 and result.out == ""
    assert result.err.splitlines() == [
        f'{ds}:3:5: error ds-config-conflict: `cpu_checkpointing`: the ds_config has "true", the '
        'policy gives true; "true" is not a JSON boolean, DeepSpeed tests it for truth and runs it '
        "ON (write true in the ds_config, or remove `cpu_checkpointing` there; or pass --replace to "
        "take the policy's section)",
        f"{ds}:4:5: error ds-config-conflict: DeepSpeed reads only its six keys and ignores "
        "`checkpoint_in_cpu` (the configure() keyword argument name); the key is "
        "`cpu_checkpointing` (remove it from the ds_config; or pass --replace to take the policy's section)",
        f"{ds}:5:5: error ds-config-conflict: `profile`: the ds_config has 1, the policy gives "
        "false; 1 is not a JSON boolean, DeepSpeed tests it for truth and runs it ON (write false "
        "in the ds_config, or remove `profile` there, or set `profile: true` in the policy to keep "
        "what DeepSpeed ran; or pass --replace to take the policy's section)",
    ]
    assert ds.read_bytes() == before


def test_translate_merge_keeps_every_byte_outside_the_section(run_cli, tmp_path):
    """json.dumps of the whole file turned 1e400 into Infinity, 1e-5 into 1e-05, cut long
    decimals and escaped café: the section is spliced into the text instead."""
    ds = tmp_path / "ds_config.json"
    head = ('{\n    "lr": 1e-5,\n    "huge": 1e400,\n    "pi": 3.14159265358979323846264338327950288,\n'
            '    "name": "café",\n    "activation_checkpointing": ')
    tail = ',\n    "steps_per_print": 10\n}\n'
    ds.write_text(head + '{"cpu_checkpointing": true}' + tail, encoding="utf-8")
    target = tmp_path / "merged.json"
    result = run_cli("translate", DS_CPU, "--merge", ds, "-o", target)
    assert (result.code, result.err) == (0, "")
    out = target.read_text(encoding="utf-8")
    assert out.startswith(head) and out.endswith(tail)
    section = json.loads(out[len(head):-len(tail)])
    assert section == json.loads(run_cli("translate", DS_CPU).out)["activation_checkpointing"]


def test_translate_merge_keeps_a_byte_order_mark_and_crlf(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_bytes(b'\xef\xbb\xbf{\r\n  "train_batch_size": 8\r\n}\r\n')
    target = tmp_path / "merged.json"
    assert run_cli("translate", DS_CPU, "--merge", ds, "-o", target).code == 0
    out = target.read_bytes()
    assert out.startswith(b'\xef\xbb\xbf{\r\n  "train_batch_size": 8,\r\n  "activation_checkpointing": {\r\n')
    assert out.endswith(b"  }\r\n}\r\n") and b"\n" not in out.replace(b"\r\n", b"")


def test_translate_merge_keeps_comments_of_an_hjson_config(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  // DeepSpeed reads comments (hjson)\n  "train_batch_size": 8,\n}\n')
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 0, result.err
    assert result.out.startswith('{\n  // DeepSpeed reads comments (hjson)\n  "train_batch_size": 8,\n'
                                 '  "activation_checkpointing": {\n')
    assert result.out.endswith("  },\n}\n")


def test_translate_merge_refuses_duplicate_keys(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  "train_batch_size": 8,\n  "train_batch_size": 16\n}\n')
    result = run_cli("translate", DS_CPU, "--merge", ds)
    assert result.code == 1 and result.out == ""
    assert result.err.startswith(f"{ds}:3:3: error json-duplicate-key: key `train_batch_size` "
                                 "appears twice under the top level (first on line 2): DeepSpeed "
                                 "refuses the whole file")


def test_translate_merge_warns_when_the_count_is_left_to_apply(run_cli, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\n"
                      "partition: true\ncontiguous: true\n")
    ds = tmp_path / "ds.json"
    ds.write_text("{}\n")
    result = run_cli("translate", policy, "--merge", ds)
    assert result.code == 0
    assert f"{ds}:1:1: warning num-checkpoints-unset: " in result.err
    assert json.loads(result.out)["activation_checkpointing"]["number_checkpoints"] is None


def test_translate_contiguous_without_a_count_says_apply_fills_it_in(run_cli, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\n"
                      "partition: true\ncontiguous: true\n")
    result = run_cli("translate", policy)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["activation_checkpointing"]["number_checkpoints"] is None
    assert out["configure_kwargs"]["num_checkpoints"] is None
    assert out["fill_in"] == {"num_checkpoints": (
        "the number of modules the route selects: actcfg.apply passes it to configure(); passed "
        "as null, deepspeed.checkpointing.configure asserts")}


@pytest.mark.parametrize("argv", [
    ("translate", "{policy}", "--merge", "{ds}", "-o", "{ds}"),
    ("translate", "{policy}", "-o", "{policy}"),
    ("translate", "{policy}", "--merge", "{ds}", "-o", "{link}"),
    ("import", "{ds}", "-o", "{ds}"),
])
def test_output_naming_an_input_is_refused(run_cli, tmp_path, argv):
    policy = tmp_path / "p.yaml"
    policy.write_text(DS_CPU.read_text())
    ds = tmp_path / "ds.json"
    ds.write_text('{"activation_checkpointing": {"cpu_checkpointing": true}}')
    (tmp_path / "link.json").symlink_to(ds)
    names = {"policy": policy, "ds": ds, "link": tmp_path / "link.json"}
    before = {p: p.read_bytes() for p in (policy, ds)}
    result = run_cli(*(a.format(**names) for a in argv))
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("actcfg: error: -o ") and "actcfg does not write over its input" in result.err
    assert {p: p.read_bytes() for p in (policy, ds)} == before


def test_a_failed_write_leaves_the_old_file_whole(run_cli, tmp_path, monkeypatch):
    # The disk fills up at the end of the write: os.fsync reports it (ENOSPC).
    import errno

    target = tmp_path / "out.json"
    target.write_text("the user's file\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    result = run_cli("translate", DS_CPU, "-o", target)
    assert (result.code, result.err) == (2, f"actcfg: error: cannot write {target}: No space left on device\n")
    assert target.read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left behind


def test_output_keeps_the_mode_and_writes_through_a_symlink(run_cli, tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert run_cli("translate", DS_CPU, "-o", link).code == 0
    assert link.is_symlink() and json.loads(target.read_text())["route"]["modules"] == ["Block"]
    assert target.stat().st_mode & 0o777 == 0o640
    assert run_cli("translate", DS_CPU, "-o", tmp_path).code == 2  # a directory


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


def test_import_reports_every_finding_in_one_run(run_cli, tmp_path):
    """The seed's typo and a quoted "false" (which DeepSpeed runs as ON) both get reported,
    in file order, with their lines, and the YAML says what DeepSpeed ran."""
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  "activation_checkpointing": {\n    "cpu_checkpointing": true,\n'
                  '    "checkpoint_in_cpu": true,\n    "partition_activations": "false"\n  }\n}\n')
    result = run_cli("import", ds, "--modules", "Block")
    assert result.code == 0, result.err
    assert [line.split(": ")[:2] for line in result.err.splitlines()] == [
        [f"{ds}:4:5", "warning ignored-key"], [f"{ds}:5:5", "warning truthy-value"],
        [f"{ds}:5:5", "warning partition-needs-model-parallel"]]
    assert "partition: true\n" in result.out and "cpu_checkpointing: true\n" in result.out
    policy = tmp_path / "policy.yaml"
    policy.write_text(result.out)
    assert run_cli("validate", policy).code == 0


def test_import_placeholder_fails_validate_with_a_sentence(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"activation_checkpointing": {"cpu_checkpointing": true}}')
    out = tmp_path / "policy.yaml"
    result = run_cli("import", ds, "-o", out)
    assert result.code == 0
    assert result.err.startswith(f"{ds}:1:2: warning placeholder: the ds_config cannot say which "
                                 "modules the model checkpoints")
    checked = run_cli("validate", out)
    assert checked.code == 1
    assert "error placeholder: `CHANGE_ME` is the placeholder `actcfg import` writes" in checked.out
    assert "or write `mode: external` if the model calls deepspeed.checkpointing.checkpoint itself" in checked.out


def test_import_errors_write_nothing(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  "activation_checkpointing": null,\n  "train_batch_size": 8\n}\n')
    out = tmp_path / "policy.yaml"
    result = run_cli("import", ds, "--modules", "Block", "-o", out)
    assert (result.code, result.out) == (1, "")
    assert result.err.startswith(f"{ds}:2:3: error bad-value: `activation_checkpointing` is null: "
                                 "DeepSpeed fails when it builds its config")
    assert not out.exists()


def test_import_reads_hjson_and_refuses_duplicates_with_their_lines(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  // comment\n  "activation_checkpointing": {\n    "profile": true,\n'
                  '    "profile": false,\n  },\n}\n')
    result = run_cli("import", ds, "--modules", "Block")
    assert (result.code, result.out) == (1, "")
    assert result.err.startswith(f"{ds}:5:5: error json-duplicate-key: key `profile` appears twice "
                                 "under activation_checkpointing (first on line 4)")
    ds.write_text('{\n  // comment\n  "activation_checkpointing": {"profile": true,},\n}\n')
    result = run_cli("import", ds, "--modules", "Block")
    assert (result.code, result.err) == (0, "")
    assert "profile: true\n" in result.out


def test_import_gpt_neox_yaml(run_cli, tmp_path):
    config = tmp_path / "neox.yml"
    config.write_text('# gpt-neox\n{\n  "num-layers": 12,\n  "checkpoint-activations": true,\n'
                      '  "checkpoint-num-layers": 1,\n  "synchronize-each-layer": true,\n}\n')
    result = run_cli("import", config)
    assert (result.code, result.err) == (0, "")
    assert result.out.startswith("# actcfg policy imported from a gpt-neox config")
    assert "  mode: external\n" in result.out and "synchronize: true\n" in result.out


def test_import_external_and_its_count(run_cli, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"activation_checkpointing": {"partition_activations": true,\n'
                  '  "contiguous_memory_optimization": true}}')
    assert run_cli("import", ds, "--external", "--modules", "Block").code == 2  # one or the other
    result = run_cli("import", ds, "--external", "--num-checkpoints", "0")
    assert (result.code, result.err) == (2, "actcfg: error: --num-checkpoints must be at least 1, got 0\n")
    out = tmp_path / "p.yaml"
    result = run_cli("import", ds, "--external", "--num-checkpoints", "12", "-o", out)
    assert result.code == 0, result.err
    translated = json.loads(run_cli("translate", out).out)
    assert translated["route"] == {"function": "deepspeed.checkpointing.checkpoint", "called_by": "the model"}
    assert translated["configure_kwargs"]["num_checkpoints"] == 12


def test_import_bad_json(run_cli, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text("[1, 2]")
    result = run_cli("import", ds)
    assert result.code == 1
    assert result.err == (f"{ds}:1:1: error bad-value: a DeepSpeed config is a JSON object, not "
                          "[1, 2] (pass the ds_config.json file)\n")
    assert run_cli("import", tmp_path / "missing.json").code == 2


@pytest.mark.parametrize(("text", "message"), [
    ('{"train_batch_size": ' + "9" * 5000 + "}",
     "the file is too complex to read safely: a number of 5,000 digits (the limit is 4,300, Python's own)"),
    ('{"a": ' * 500 + "1" + "}" * 500, "the file is too complex to read safely: nested deeper than 64 levels"),
], ids=["5000-digits", "500-levels"])
@pytest.mark.parametrize("command", ["import", "merge"])
def test_oversized_json_exits_2_with_a_message(run_cli, tmp_path, text, message, command):
    ds = tmp_path / "ds.json"
    ds.write_text(text)
    argv = ("import", ds) if command == "import" else ("translate", DS_CPU, "--merge", ds)
    result = run_cli(*argv)
    assert (result.code, result.out) == (2, "")
    assert f" error json-too-complex: {message} (" in result.err
    assert "internal error" not in result.err


def test_control_characters_from_a_file_are_escaped(run_cli, tmp_path):
    # A JSON key may hold ESC (\u001b): printed raw, `ESC[1A ESC[2K` rewrites the line above.
    ds = tmp_path / "ds.json"
    ds.write_text('{"activation_checkpointing": {"\\u001b[1A\\u001b[2Kok\\u202e": true}}')
    result = run_cli("import", ds, "--modules", "Block")
    assert result.code == 0
    assert "\x1b" not in result.err and "\u202e" not in result.err
    assert "ignores `\\x1b[1A\\x1b[2Kok\\u202e`" in result.err
    policy = tmp_path / "p.yaml"
    policy.write_text('version: 1\n"\\e[2Kbad": 1\n')
    checked = run_cli("validate", policy)
    assert checked.code == 1 and "\x1b" not in checked.out
    assert "unknown key `\\x1b[2Kbad`" in checked.out


# --- verify refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "code", "status"), [
    (("{seed}", "--steps", "0"), 2, "usage-error"),
    (("{bad}",), 1, "invalid"),
    (("{missing}",), 2, "unreadable"),
])
def test_verify_format_json_answers_in_json_when_it_refuses(run_cli, tmp_path, argv, code, status):
    names = {"seed": ROOT / "configs" / "seed-linear-offload.yaml", "bad": SEED,
             "missing": tmp_path / "missing.yaml"}
    result = run_cli("verify", *(a.format(**names) for a in argv), "--format", "json")
    assert (result.code, result.err) == (code, "")
    body = json.loads(result.out)
    assert (body["ok"], body["status"]) == (False, status)
    if status == "usage-error":
        assert body["message"] == "--steps must be at least 1, got 0" and body["errors"] == []
    else:
        assert body["message"] is None and body["errors"][0]["file"] == names[argv[0][1:-1]].__str__()


def test_verify_format_json_without_a_gpu_is_json(run_cli):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_cli("verify", ROOT / "configs" / "seed-linear-offload.yaml", "--format", "json")
    assert (result.code, result.err) == (2, "")
    body = json.loads(result.out)
    assert body["status"] == "usage-error" and "needs a CUDA GPU" in body["message"]


# --- plan --------------------------------------------------------------------------------

BUDGET = ROOT / "configs" / "torch-memory-budget.yaml"


def test_plan_without_a_gpu_is_a_usage_error_in_one_sentence(run_cli):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_cli("plan", BUDGET, "--model", "actcfg.probes:blocks")
    assert (result.code, result.out) == (2, "")
    assert result.err == (
        "actcfg: error: actcfg plan profiles a training step on the GPU and needs a CUDA GPU, but "
        "torch.cuda.is_available() is False here: run it on a GPU machine\n")
    result = run_cli("plan", BUDGET, "--model", "actcfg.probes:blocks", "--format", "json")
    assert (result.code, result.err) == (2, "")
    body = json.loads(result.out)
    assert body["ok"] is False and body["status"] == "usage-error"
    assert body["message"].startswith("actcfg plan profiles a training step on the GPU")


@pytest.mark.parametrize(("argv", "code", "err"), [
    (["configs/torch-rules.yaml"], 2,
     "actcfg: error: actcfg plan plans for a policy that asks for one (`checkpoint: {mode: auto, "
     "modules: [...]}` with `memory_budget`), and configs/torch-rules.yaml has checkpoint.mode "
     "rules; write mode auto with the modules to plan over\n"),
    (["configs/torch-memory-budget.yaml", "--budget", "lots"], 2,
     "actcfg: error: --budget 'lots': 'lots' is not a size: write a number and one of B, KB, MB, GB, "
     "TB, KiB, MiB, GiB, TiB, such as 16GiB\n"),
    (["configs/torch-memory-budget.yaml", "--steps", "0"], 2,
     "actcfg: error: --steps must be at least 1, got 0\n"),
    (["configs/torch-memory-budget.yaml", "-o", "configs/torch-memory-budget.yaml"], 2,
     "actcfg: error: -o configs/torch-memory-budget.yaml is the input file configs/torch-memory-budget.yaml: "
     "actcfg does not write over its input; write to another file, check it, then move it\n"),
    (["configs/torch-memory-budget.yaml", "--model", "actcfg.probes"], 2,
     "actcfg: error: --model 'actcfg.probes': write it as pkg.module:factory (for example "
     "actcfg.probes:linear_chain)\n"),
    (["configs/torch-memory-budget.yaml", "--compile-backend", "aot_eager"], 2,
     "actcfg: error: --compile-backend names torch.compile's backend for --compile (or the "
     "file's `compile:`), and neither is given: add --compile blocks|model\n"),
    (["configs/torch-memory-budget.yaml", "--compile", "blocks", "--compile-backend", ""], 2,
     "actcfg: error: --compile-backend '': String should have at least 1 character\n"),
])
def test_plan_usage_errors_exit_2_before_any_gpu_work(run_cli, monkeypatch, argv, code, err):
    monkeypatch.chdir(ROOT)
    model = [] if "--model" in argv else ["--model", "actcfg.probes:blocks"]
    result = run_cli("plan", *argv, *model)
    assert (result.code, result.out, result.err) == (code, "", err)


def test_plan_of_an_invalid_config_is_1_with_its_diagnostics(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ncheckpoint: {mode: auto, modules: [Block]}\n")
    result = run_cli("plan", bad, "--model", "actcfg.probes:blocks")
    assert result.code == 1
    assert result.err == (
        f"{bad}:2:20: error budget-needed: checkpoint.mode `auto` asks for the fastest plan within "
        "`memory_budget`, which is not set (add `memory_budget: <size>` (the most GPU memory one "
        "training step may allocate, such as 40GiB), or choose the mode yourself: none, full, "
        "selective or rules)\n")


def test_plan_needs_a_model(run_cli):
    result = run_cli("plan", BUDGET)
    assert result.code == 2 and "the following arguments are required: --model" in result.err


# --- real processes ------------------------------------------------------------------------


def _python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"} | env
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=environ, timeout=scaled(60))


def test_python_m_actcfg_validate():
    proc = _python("-m", "actcfg", "validate", str(SEED))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"{SEED}:7:1: error unknown-key:")
    assert "Traceback" not in proc.stderr


def test_python_m_actcfg_github_from_env():
    proc = _python("-m", "actcfg", "validate", str(SEED), GITHUB_ACTIONS="true")
    assert proc.returncode == 1 and proc.stdout.startswith("::error file=")


@pytest.mark.parametrize("argv", [("validate", "{fifo}"), ("import", "{fifo}"),
                                  ("translate", str(DS_CPU), "--merge", "{fifo}"),
                                  ("translate", "{fifo}"), ("verify", "{fifo}")])
def test_a_fifo_is_refused_without_hanging(tmp_path, argv):
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    proc = _python("-m", "actcfg", *(a.format(fifo=fifo) for a in argv))  # 60 s timeout
    assert proc.returncode == 2, proc.stderr
    assert f"{fifo}: error file-unreadable: this is a FIFO (named pipe), not a regular file" in (
        proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(("argv", "stream"), [
    (("schema",), "stdout"), (("validate", str(SEED)), "stdout"), (("validate", str(SEED)), "stderr"),
    (("translate", str(DS_CPU)), "stdout"),
])
def test_a_full_disk_on_stdout_or_stderr_exits_2_without_a_traceback(argv, stream):
    environ = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"}
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "actcfg", *argv], cwd=ROOT, env=environ,
                              text=True, timeout=scaled(60), stdin=subprocess.DEVNULL,
                              stdout=full if stream == "stdout" else subprocess.PIPE,
                              stderr=full if stream == "stderr" else subprocess.PIPE)
    assert proc.returncode == 2
    if stream == "stdout":
        assert proc.stderr.endswith("actcfg: error: cannot write to standard output: No space left on device\n")
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


def test_merge_prints_non_ascii_to_a_terminal_that_is_not_utf8(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_bytes('{"name": "café"}'.encode())
    proc = _python("-m", "actcfg", "translate", str(DS_CPU), "--merge", str(ds), PYTHONIOENCODING="ascii")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith('{"name": "café", "activation_checkpointing": {')


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


def test_import_and_merge_import_neither_torch_nor_deepspeed():
    ds = DATA / "realworld" / "openrlhf-ddpo_ds_config.json"
    code = (
        "import sys\n"
        "from actcfg.cli import main\n"
        f"rc = main(['import', {str(ds)!r}, '--modules', 'Block'])\n"
        f"rc += main(['translate', {str(DS_CPU)!r}, '--merge', {str(ds)!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed'))\n"
        "print(rc, heavy)\n"
    )
    proc = _python("-c", code)
    assert proc.stdout.splitlines()[-1] == "1 []", proc.stderr  # merge refuses: partition differs


def test_readme_first_contact():
    """The first command's one warning is explained, and the CPU wheel is given as PyTorch
    documents it (the public index's torch is the CUDA build, over 2 GB)."""
    readme = (ROOT / "README.md").read_text()
    warned = [p for p in CONFIGS if any(d.severity == "warning" for d in check_file(p)[1])]
    assert [p.name for p in warned] == ["deepspeed-partition-model-parallel.yaml"]
    assert "The one warning `validate` prints is meant: `configs/deepspeed-partition-model-parallel.yaml`" in readme
    assert "`python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`" in readme
    assert (ROOT / "LICENSE").read_text().startswith("\n                                 Apache License\n"
                                                     "                           Version 2.0, January 2004\n")


def test_pre_commit_hooks_run_validate(run_cli):
    import re

    import yaml

    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert {i: (h["entry"], h["language"], h["types"]) for i, h in hooks.items()} == {
        "actcfg-validate": ("actcfg validate", "python", ["yaml"]),
        "actcfg-validate-system": ("actcfg validate", "system", ["yaml"]),
    }
    for hook in hooks.values():
        files = re.compile(hook["files"])
        assert all(files.search(str(p.relative_to(ROOT))) for p in CONFIGS)
        assert not files.search("docs/other.yaml") and not files.search(".pre-commit-hooks.yaml")
    assert run_cli(*hooks["actcfg-validate"]["entry"].split()[1:], *CONFIGS).code == 0


def _docs_pre_commit_block() -> str:
    """docs/keys.md's `.pre-commit-config.yaml`, the one yaml block of its pre-commit section."""
    text = (ROOT / "docs" / "keys.md").read_text()
    section = text[text.index("## pre-commit"):]
    section = section[:section.index("\n## ", 1)]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return block


def test_the_documented_hook_is_repo_local_and_runs_what_the_shipped_hook_runs():
    """No release is tagged: the documented form works from a checkout today, with the shipped
    hook's entry and files (issue 19: the old block named an unreleased tag and a placeholder)."""
    import yaml

    config = yaml.safe_load(_docs_pre_commit_block())
    (repo,) = config["repos"]
    (hook,) = repo["hooks"]
    shipped = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert repo["repo"] == "local" and "rev" not in repo
    assert (hook["id"], hook["language"]) == ("actcfg-validate", "system")
    assert {k: hook[k] for k in ("entry", "types", "files")} == {
        k: shipped["actcfg-validate-system"][k] for k in ("entry", "types", "files")}


def _git(cwd, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=actcfg-test", "-c", "user.email=test@actcfg.invalid",
                    "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True,
                   timeout=scaled(60))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tag", "local"])
def test_pre_commit_installs_the_hook_and_refuses_a_bad_policy(tmp_path, how):
    """Installs the hook into a throwaway repository and commits a good, then a bad policy. No
    network: docs/keys.md's block exactly as written (`repo: local`), or the shipped
    .pre-commit-hooks.yaml from a local clone tagged with the version (the form a release will
    use); both run the actcfg of this checkout."""
    import shutil

    import yaml

    from actcfg._version import __version__

    if shutil.which("pre-commit") is None or shutil.which("git") is None:
        pytest.skip("needs pre-commit and git")
    bin_dir = tmp_path / "bin"  # `actcfg` on PATH = this checkout, run by this interpreter
    bin_dir.mkdir()
    shim = bin_dir / "actcfg"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m actcfg "$@"\n')
    shim.chmod(0o755)
    if how == "tag":
        hooks_repo = tmp_path / "actcfg-hooks"
        hooks_repo.mkdir()
        (hooks_repo / ".pre-commit-hooks.yaml").write_text((ROOT / ".pre-commit-hooks.yaml").read_text())
        _git(hooks_repo, "init", "-q")
        _git(hooks_repo, "add", ".")
        _git(hooks_repo, "commit", "-qm", "hooks")
        _git(hooks_repo, "tag", f"v{__version__}")
        config = yaml.safe_dump({"repos": [{"repo": str(hooks_repo), "rev": f"v{__version__}",
                                            "hooks": [{"id": "actcfg-validate-system"}]}]})
    else:
        config = _docs_pre_commit_block()  # exactly as written
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / ".pre-commit-config.yaml").write_text(config)
    _git(project, "init", "-q")
    environ = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"} | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "GIT_CONFIG_NOSYSTEM": "1"}
    installed = subprocess.run(["pre-commit", "install"], cwd=project, env=environ,
                               capture_output=True, text=True, timeout=scaled(120))
    assert installed.returncode == 0, installed.stdout + installed.stderr

    def commit(name: str, source: Path) -> subprocess.CompletedProcess[str]:
        (project / "configs" / name).write_text(source.read_text())
        subprocess.run(["git", "add", "-A"], cwd=project, check=True, env=environ, timeout=scaled(60))
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@actcfg.invalid",
                               "-c", "commit.gpgsign=false", "commit", "-qm", name],
                              cwd=project, env=environ, capture_output=True, text=True, timeout=scaled(120))

    good = commit("good.yaml", DS_CPU)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = commit("bad.yaml", SEED)
    output = bad.stdout + bad.stderr  # git prints the hook's output on stderr
    assert bad.returncode == 1
    assert "configs/bad.yaml:7:1: error unknown-key: unknown key `checkpoint_in_cpu`" in output
    assert "actcfg: 1 file checked: 1 error, 0 warnings" in output  # only the staged file
    committed = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD"], cwd=project,
                               capture_output=True, text=True, check=True).stdout.split()
    assert committed == [".pre-commit-config.yaml", "configs/good.yaml"]  # the bad one was refused
