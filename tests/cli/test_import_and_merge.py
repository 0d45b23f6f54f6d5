"""issue 19, item 3: `actcfg import` of trainer keywords takes --modules and --external and warns
of the placeholder as the DeepSpeed import does; importing a policy says what the file is;
`validate` of a ds_config points at `actcfg import` (comments and all); `translate --merge`
refuses a section that disagrees unless `--replace` is given, and then names each old value."""

from __future__ import annotations

import json

import pytest
from _timeouts import scaled
from conftest import ROOT

import actcfg

DS_CPU = ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"
SELECTIVE = ROOT / "configs" / "torch-selective.yaml"
PLACEHOLDER_HF = ("warning placeholder: the TrainingArguments keywords cannot say which modules the model "
                  "checkpoints")


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


HF_ARGS = "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\n"


def test_hf_import_with_modules_names_them_and_has_no_placeholder(run_cli, tmp_path):
    run = run_cli("import", write(tmp_path, "args.yaml", HF_ARGS), "--backend", "hf",
                  "--modules", "LlamaDecoderLayer")
    assert (run.code, run.err) == (0, "")
    policy = actcfg.load(run.out)
    assert (policy.checkpoint.mode, policy.checkpoint.modules, policy.checkpoint.reentrant) == (
        "full", ("LlamaDecoderLayer",), False)


def test_hf_import_without_modules_warns_of_the_placeholder_as_deepspeeds_does(run_cli, tmp_path):
    run = run_cli("import", write(tmp_path, "args.yaml", HF_ARGS), "--backend", "hf")
    assert run.code == 0
    assert PLACEHOLDER_HF in run.err
    assert "the ds_config cannot say" not in run.out
    assert "# checkpoint.modules: the TrainingArguments keywords cannot say which layers" in run.out


def test_hf_import_external_keeps_transformers_checkpointing_and_reports_use_reentrant(run_cli, tmp_path):
    path = write(tmp_path, "args.yaml", HF_ARGS)
    run = run_cli("import", path, "--backend", "hf", "--external")
    assert run.code == 0
    assert actcfg.load(run.out).checkpoint.mode == "external"
    assert run.err.splitlines() == [
        f"{path}:2:33: warning ignored-key: `gradient_checkpointing_kwargs.use_reentrant`: with --external "
        "transformers keeps checkpointing and passes it to torch itself; a `mode: external` policy has no "
        "reentrant field: not imported"]


def test_hf_import_refuses_num_checkpoints_as_a_usage_error(run_cli, tmp_path):
    run = run_cli("import", write(tmp_path, "args.yaml", HF_ARGS), "--backend", "hf", "--num-checkpoints", "4")
    assert (run.code, run.err) == (2, "actcfg: error: --num-checkpoints sizes DeepSpeed's contiguous buffers: "
                                      "it is for --backend deepspeed or lightning, not hf\n")


def test_lightning_import_takes_modules_and_num_checkpoints(run_cli, tmp_path):
    path = write(tmp_path, "strategy.yaml", "partition_activations: true\ncontiguous_memory_optimization: true\n"
                                            "cpu_checkpointing: true\n")
    run = run_cli("import", path, "--backend", "lightning", "--external", "--num-checkpoints", "12")
    assert "placeholder" not in run.err
    policy = actcfg.load(run.out)
    assert (policy.checkpoint.mode, policy.num_checkpoints, policy.contiguous) == ("external", 12, True)
    run = run_cli("import", path, "--backend", "lightning", "--modules", "Block")
    assert actcfg.load(run.out).checkpoint.modules == ("Block",)


def test_lightning_import_placeholder_names_the_keywords_not_a_ds_config(run_cli, tmp_path):
    path = write(tmp_path, "strategy.yaml", "cpu_checkpointing: true\n")
    run = run_cli("import", path, "--backend", "lightning")
    assert "# checkpoint.modules: the DeepSpeedStrategy keywords cannot say which modules" in run.out
    assert "ds_config" not in run.out
    assert f"{path}: warning placeholder: the DeepSpeedStrategy keywords cannot say" in run.err


def test_import_comments_keep_quotes_as_written(run_cli, tmp_path):
    path = write(tmp_path, "ds_config.json", '{"activation_checkpointing": {"cpu_checkpointing": "false"}}\n')
    run = run_cli("import", path, "--modules", "Block")
    assert '# `cpu_checkpointing` is "false", not a boolean' in run.out
    assert '\\"' not in run.out


def test_importing_an_actcfg_policy_says_what_the_file_is(run_cli):
    run = run_cli("import", SELECTIVE)
    assert (run.code, run.out) == (1, "")
    assert run.err == (
        f"{SELECTIVE}:4:1: error not-a-ds-config: this is an actcfg policy (it has `version` and only "
        "policy keys), not a DeepSpeed config: import reads a ds_config and writes a policy (check the "
        f"policy with `actcfg validate {SELECTIVE}`, or write its DeepSpeed section with `actcfg translate "
        f"{SELECTIVE} --backend deepspeed`)\n")


@pytest.mark.parametrize("text", [
    '{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2},\n'
    '  "activation_checkpointing": {"cpu_checkpointing": true}\n}\n',
    '{\n  // DeepSpeed reads comments (hjson)\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2},\n'
    '  "activation_checkpointing": {"cpu_checkpointing": true,},\n}\n',
], ids=["json", "hjson-with-comments"])
def test_validate_of_a_ds_config_is_one_error_pointing_at_import(run_cli, tmp_path, text):
    path = write(tmp_path, "ds_config.json", text)
    run = run_cli("validate", path)
    line = text.split("\n").index('  "train_batch_size": 8,') + 1
    assert (run.code, run.out) == (1, (
        f"{path}:{line}:3: error deepspeed-config: this is a DeepSpeed config (`train_batch_size`, "
        "`zero_optimization`, `activation_checkpointing`), not an actcfg policy (`actcfg import "
        f"{path}` writes the policy for what DeepSpeed runs from it; validate that policy)\n"))
    assert run_cli("import", path, "--modules", "Block").code == 0  # and import reads it


def test_a_broken_policy_keeps_its_own_findings(run_cli, tmp_path):
    path = write(tmp_path, "policy.yaml", "checkpoint: {mode: full, modules: [Block]}\ncheckpoint_in_cpu: true\n")
    run = run_cli("validate", path)
    assert [line.split(": ")[1] for line in run.out.splitlines()] == ["error missing-key", "error unknown-key"]


DISAGREES = '{\n  "train_batch_size": 8,\n  "activation_checkpointing": {"cpu_checkpointing": false, "checkpoint_in_cpu": true}\n}\n'


def test_merge_refuses_a_disagreeing_section_and_names_the_flag_that_replaces_it(run_cli, tmp_path):
    ds = write(tmp_path, "ds_config.json", DISAGREES)
    run = run_cli("translate", DS_CPU, "--merge", ds)
    assert (run.code, run.out) == (1, "")
    assert all(line.endswith("or pass --replace to take the policy's section)") for line in run.err.splitlines())
    assert len(run.err.splitlines()) == 2


def test_merge_replace_writes_the_policys_section_and_names_each_old_value(run_cli, tmp_path):
    ds = write(tmp_path, "ds_config.json", DISAGREES)
    run = run_cli("translate", DS_CPU, "--merge", ds, "--replace")
    assert run.code == 0
    merged = json.loads(run.out)
    assert merged["train_batch_size"] == 8
    from actcfg.translators import translate

    assert merged["activation_checkpointing"] == translate(actcfg.load(DS_CPU), "deepspeed")[
        "activation_checkpointing"]
    assert run.err.splitlines() == [
        f"{ds}:3:32: warning ds-config-replaced: replaced by the policy's section: `cpu_checkpointing`: "
        "the ds_config has false, the policy gives true",
        f"{ds}:3:60: warning ds-config-replaced: replaced by the policy's section: `checkpoint_in_cpu` was "
        "true: DeepSpeed reads only its six keys and ignores `checkpoint_in_cpu` (the configure() keyword "
        "argument name); the key is `cpu_checkpointing`",
    ]


def test_replace_without_merge_is_a_usage_error(run_cli):
    run = run_cli("translate", DS_CPU, "--replace")
    assert (run.code, run.err) == (2, "actcfg: error: --replace goes with --merge DS_CONFIG (it replaces "
                                      "that file's section)\n")


def test_translate_help_says_what_merge_does_with_a_disagreeing_section(run_cli):
    run = run_cli("translate", "--help")
    assert run.code == 0
    text = " ".join(run.out.split())
    assert "keys the file's section already has must agree with the policy, or it exits 1" in text
    assert "--replace with --merge: replace a section that disagrees, with a warning naming each old value" in text
    assert "FILE the policy YAML file to translate" in text


def test_validate_of_a_ds_config_stays_on_the_light_path(tmp_path):
    """Reading the ds_config as DeepSpeed does (hjson) imports neither torch nor DeepSpeed."""
    import subprocess
    import sys

    path = write(tmp_path, "ds_config.json", '{\n  // a comment\n  "train_batch_size": 8,\n}\n')
    code = ("import sys; from actcfg.cli import main; code = main(['validate', sys.argv[1]]); "
            "print(code, sorted(m for m in ('torch', 'deepspeed', 'transformers', 'lightning') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                          timeout=scaled(120))
    assert proc.stdout.splitlines()[-1] == "1 []", proc.stderr
    assert "error deepspeed-config" in proc.stdout
