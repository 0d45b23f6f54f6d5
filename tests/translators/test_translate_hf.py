"""`actcfg translate --backend hf` and `actcfg import --backend hf` against the real
`transformers.TrainingArguments` and `Trainer` (CPU, a tiny randomly initialised Llama)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import actcfg
from actcfg.translators import to_hf
from actcfg.translators.trainer_import import import_training_arguments

FULL = "version: 1\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- translate: pure ---------------------------------------------------------------------


def test_a_full_policy_maps_to_activation_checkpointing_and_its_kwargs():
    out = to_hf(actcfg.load(FULL + "cpu_checkpointing: true\n"))
    assert out == {
        "training_arguments": {"activation_checkpointing": True,
                               "activation_checkpointing_kwargs": {"use_reentrant": False, "offload": True}},
        "training_arguments_before_5_24": None,
        "layers": ["LlamaDecoderLayer"],
        "warnings": ["cpu_checkpointing: transformers before 5.24 cannot offload (no `offload` "
                     "keyword); use 5.24 or later, or actcfg.integrations.hf.ActivationPolicyCallback"],
    }


def test_earlier_transformers_get_the_old_names():
    out = to_hf(actcfg.load(FULL))
    assert out["training_arguments_before_5_24"] == {
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}


def test_no_checkpointing_maps_to_switch_off():
    assert to_hf(actcfg.load("version: 1\n"))["training_arguments"] == {"activation_checkpointing": False}


def test_translate_cli_names_every_field_hf_cannot_express(run_cli, tmp_path):
    path = write(tmp_path, "p.yaml", "version: 1\ncheckpoint: {mode: selective, modules: ['layers.*', '*Layer'], every: 2}\n"
                                     "pin: false\npin_budget: 1GiB\n")
    run = run_cli("translate", path, "--backend", "hf")
    assert run.code == 1
    assert run.out == ""
    found = re.findall(r"^\S+:(\d+):\d+: error not-in-hf: (`?[\w.]+`?)", run.err, re.M)
    assert [f[1].strip("`") for f in found] == [
        "checkpoint.mode", "checkpoint.modules", "checkpoint.modules", "checkpoint.every", "pin", "pin_budget"]
    assert "uses a wildcard" in run.err and "names qualified module names" in run.err


def test_translate_cli_refuses_deepspeed_only_fields_for_hf(run_cli, tmp_path):
    path = write(tmp_path, "p.yaml", "version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\n"
                                     "synchronize: true\n")
    run = run_cli("translate", path, "--backend", "hf")
    assert run.code == 1
    assert "error deepspeed-only: `synchronize` is DeepSpeed-only" in run.err


# --- translate: accepted by the real TrainingArguments and Trainer -------------------------

@pytest.fixture
def transformers() -> Any:
    """The real transformers package (the pure tests above run without it)."""
    return pytest.importorskip("transformers")


def arguments(transformers: Any, tmp_path: Path, **translated: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
        **translated)


@pytest.mark.parametrize("policy, kwargs", [
    (FULL, {"use_reentrant": False, "offload": False}),
    (FULL.replace("}", ", reentrant: true}"), {"use_reentrant": True, "offload": False}),
    (FULL + "cpu_checkpointing: true\n", {"use_reentrant": False, "offload": True}),
])
def test_translate_output_is_accepted_by_training_arguments(transformers, tmp_path, policy, kwargs):
    args = arguments(transformers, tmp_path, **to_hf(actcfg.load(policy))["training_arguments"])
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == kwargs


@pytest.mark.parametrize("reentrant", [False, True])
def test_translate_output_turns_on_hfs_recompute_in_trainer(transformers, tmp_path, reentrant):
    import torch
    from _helpers import tiny_llama  # torch: only the tests that train import it

    policy = actcfg.load(FULL.replace("}", f", reentrant: {json.dumps(reentrant)}}}"))
    model = tiny_llama()
    calls = [0, 0]
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    trainer = transformers.Trainer(model=model, args=arguments(transformers, tmp_path, **to_hf(policy)["training_arguments"]),
                                   train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    assert model.is_activation_checkpointing
    assert calls == [4, 4]  # 2 steps, each layer run in forward and again in the recompute


# --- import ----------------------------------------------------------------------------------


def test_import_round_trips_what_translate_wrote():
    for text in (FULL, FULL + "cpu_checkpointing: true\n", FULL.replace("}", ", reentrant: true}")):
        policy = actcfg.load(text)
        imported = import_training_arguments(to_hf(policy)["training_arguments"])
        assert imported.ignored == [] and imported.dropped == []
        back = actcfg.load(imported.yaml.replace("CHANGE_ME", "LlamaDecoderLayer"))
        assert back.checkpoint == policy.checkpoint
        assert back.cpu_checkpointing == policy.cpu_checkpointing


def test_import_reads_a_real_training_arguments_dump_with_the_old_names(transformers, tmp_path):
    with warnings.catch_warnings():  # deprecated in 5.24, the only names in 5.17
        warnings.filterwarnings("ignore", "`gradient_checkpointing", FutureWarning)
        args = arguments(transformers, tmp_path, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": True})
    imported = import_training_arguments(json.loads(args.to_json_string()))
    policy = actcfg.load(imported.yaml.replace("CHANGE_ME", "LlamaDecoderLayer"))
    assert policy.checkpoint.mode == "full" and policy.checkpoint.reentrant is True
    assert imported.ignored == []


def test_import_cli_reports_what_transformers_would_ignore_with_lines(run_cli, tmp_path):
    path = write(tmp_path, "args.yaml", "output_dir: out\ngradient_checkpointing: true\n"
                                        "gradient_checkpointing_kwargs: {offload: true, ofload: true, every_n_layers: 2}\n"
                                        "gradient_checkpoint: true\n")
    run = run_cli("import", path, "--backend", "hf")
    assert run.code == 0
    assert run.err.splitlines() == [
        f"{path}:4:1: warning ignored-key: `gradient_checkpoint`: not a TrainingArguments keyword "
        "(TrainingArguments(...) raises TypeError); did you mean `gradient_checkpointing`? (not imported)",
        f"{path}:3:48: warning ignored-key: `gradient_checkpointing_kwargs.ofload`: not a keyword of "
        "torch.utils.checkpoint, whose non-reentrant form passes it on to the layer's forward, which "
        "swallows it: it did nothing; did you mean `offload`? (not imported)",
        f"{path}:3:62: warning ignored-key: `gradient_checkpointing_kwargs.every_n_layers`: transformers "
        "checkpoints layers 0, 2, 4, ... (every_n_layers: 2), actcfg's `every: 2` layers 1, 3, ...: not "
        "imported; set `checkpoint.every: 2` if that shift is what you want",
        f"{path}: warning placeholder: the TrainingArguments keywords cannot say which modules the model "
        "checkpoints: the policy holds `modules: [CHANGE_ME]`, which validate refuses until it is replaced "
        "(run import with --modules CLASSNAME... (the checkpointed modules' class names), or --external "
        "to keep transformers' own checkpointing (`mode: external`))",
    ]
    policy = actcfg.load(run.out.replace("CHANGE_ME", "LlamaDecoderLayer"))
    assert policy.cpu_checkpointing is True and policy.checkpoint.every == 1


def test_import_cli_kwargs_with_checkpointing_off_are_reported(run_cli, tmp_path):
    path = write(tmp_path, "args.json", json.dumps({"activation_checkpointing": False,
                                                    "activation_checkpointing_kwargs": {"offload": True}}))
    run = run_cli("import", path, "--backend", "hf")
    assert run.code == 0
    assert "`activation_checkpointing_kwargs.offload`: activation_checkpointing is off, so " \
           "transformers never reads it" in run.err
    assert actcfg.load(run.out).checkpoint.mode == "none"


def test_import_cli_refuses_a_file_that_is_not_a_mapping(run_cli, tmp_path):
    run = run_cli("import", write(tmp_path, "args.json", "[1, 2]"), "--backend", "hf")
    assert run.code == 1
    assert run.err.endswith("error yaml-not-mapping: TrainingArguments keywords are a mapping of "
                            "`name: value` lines (write the TrainingArguments keywords as a YAML or "
                            "JSON mapping)\n")
    assert run_cli("import", tmp_path / "missing.yaml", "--backend", "hf").code == 2
