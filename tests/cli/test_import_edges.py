"""actcfg import at its edges (issue 20): a TrainingArguments file read as transformers reads
it, duplicate keys refused in every import, an empty ds_config refused, and `--modules` kept
when the ds_config has no activation_checkpointing section.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import actcfg


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("word", ["yes", "Yes", "on", "ON", "no", "off"])
def test_hf_import_reads_yaml_11_booleans_as_transformers_does(run_cli, tmp_path, word):
    # `gradient_checkpointing: yes` was imported as off, exit 0 (issue 20).
    transformers = pytest.importorskip("transformers")
    path = write(tmp_path, "args.yaml", f"output_dir: {tmp_path / 'out'}\nreport_to: []\n"
                                        f"gradient_checkpointing: {word}\n")
    with warnings.catch_warnings():  # `gradient_checkpointing` is deprecated in newer transformers
        warnings.simplefilter("ignore", FutureWarning)
        (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_yaml_file(path)
    hf_checkpoints = bool(getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing)
    run = run_cli("import", path, "--backend", "hf")
    assert run.code == 0
    # Without --modules, the one thing said is the placeholder the policy then holds.
    assert ("warning placeholder" in run.err) is hf_checkpoints
    assert [line for line in run.err.splitlines() if "warning placeholder" not in line] == []
    policy = actcfg.load(run.out.replace("CHANGE_ME", "LlamaDecoderLayer"))
    assert (policy.checkpoint.mode == "full") is hf_checkpoints
    assert hf_checkpoints is (word.lower() in ("yes", "on"))


@pytest.mark.parametrize(("backend", "text"), [
    ("hf", "gradient_checkpointing: true\ngradient_checkpointing: false\n"),
    ("hf", '{"gradient_checkpointing": false, "gradient_checkpointing": true}'),
    ("lightning", "cpu_checkpointing: true\ncpu_checkpointing: false\n"),
])
def test_duplicate_keys_in_a_trainer_import_are_errors(run_cli, tmp_path, backend, text):
    # They passed silently (the last one won) while the ds_config import refused them.
    path = write(tmp_path, "args.json" if text.startswith("{") else "args.yaml", text)
    run = run_cli("import", path, "--backend", backend)
    key = "gradient_checkpointing" if backend == "hf" else "cpu_checkpointing"
    assert (run.code, run.out) == (1, "")
    assert run.err.startswith(f"{path}:")
    assert f"error yaml-duplicate-key: key `{key}` appears twice under the top level (first on line 1)" in run.err


def test_an_empty_ds_config_is_refused(run_cli, tmp_path):
    path = write(tmp_path, "ds_config.json", "{}\n")
    run = run_cli("import", path, "--modules", "Block")
    assert (run.code, run.out) == (1, "")
    assert run.err == (
        f"{path}:1:1: error bad-value: the ds_config is an empty object: DeepSpeed refuses it "
        "(`Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided`), and "
        "it says nothing about activation checkpointing (pass the ds_config your training runs "
        "with)\n")


@pytest.mark.parametrize(("flags", "checkpoint"), [
    (["--modules", "Block"], {"mode": "full", "modules": ("Block",)}),
    (["--external"], {"mode": "external"}),
])
def test_modules_are_kept_without_a_section(run_cli, tmp_path, flags, checkpoint):
    # `--modules` was dropped: the policy said "nothing checkpointed" and exit 0.
    path = write(tmp_path, "ds_config.json", '{"train_batch_size": 8}\n')
    run = run_cli("import", path, *flags)
    assert (run.code, run.err) == (0, "")
    policy = actcfg.load(run.out)
    assert policy.checkpoint.model_dump(include=set(checkpoint)) == checkpoint
    assert (policy.partition, policy.cpu_checkpointing, policy.contiguous) == (False, False, False)
    assert "# no activation_checkpointing section: DeepSpeed's defaults\n" in run.out


def test_a_ds_config_without_a_section_or_flags_still_imports_nothing_checkpointed(run_cli, tmp_path):
    path = write(tmp_path, "ds_config.json", '{"train_batch_size": 8}\n')
    run = run_cli("import", path)
    assert run.code == 0 and actcfg.load(run.out).checkpoint.mode == "none"
