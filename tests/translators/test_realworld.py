"""Real configs from public repositories (tests/data/realworld, SOURCES.md): each one imports,
and the imported policy translates back to exactly what DeepSpeed reads from the original.

DeepSpeed's reading is DeepSpeed's own code: the file is loaded as `DeepSpeedConfig` loads a
path (hjson, duplicate keys refused) and handed to `DeepSpeedActivationCheckpointingConfig`; the
translation goes through the same class. For gpt-neox configs, whose flags gpt-neox passes to
`deepspeed.checkpointing.configure` itself, both sets of keyword arguments go through the real
`configure` and DeepSpeed's globals are compared.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import DATA

try:
    from tests._deepspeed_env import ds_env, ds_globals
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env, ds_globals

__all__ = ["ds_env"]

pytestmark = pytest.mark.deepspeed

CORPUS_DIR = DATA / "realworld"
CORPUS = sorted(p for p in CORPUS_DIR.iterdir() if p.name != "SOURCES.md")
NEOX = [p for p in CORPUS if p.suffix == ".yml"]
DEEPSPEED = [p for p in CORPUS if p.suffix == ".json"]
ROW = re.compile(r"^\| `([^`]+)` \| ([\w.-]+/[\w.-]+) \| `([^`]+)` \| `([0-9a-f]{40})` \| (.+) \|$")

# What `actcfg import` reports for each file, and why (the README's corpus paragraph counts
# these): partition on one GPU shards nothing (partition-needs-model-parallel), and contiguous
# buffers without number_checkpoints leave the count to whoever calls configure()
# (num-checkpoints-unset). Every other file imports with no finding at all.
_P = "partition-needs-model-parallel"
_C = "num-checkpoints-unset"
EXPECTED_FINDINGS: dict[str, list[str]] = {
    "dsexamples-megatron-ds_zero2_config.json": [_P],
    "dsexamples-megatron-ds_zero3_config.json": [_P],
    "dsexamples-megatron-ds_zero2_cpu_offload_config.json": [_P],
    "dsexamples-megatron-ds_zero-offload_config.json": [_P, _C],
    "dsexamples-megatron-ds_zero-offload_10B_config.json": [_P, _C],
    "dsexamples-megatron-ds_zerodual_config.json": [_P, _C],
    "dsexamples-megatron-model_size_test-ds_zero-offload_1B_config.json": [_P, _C],
    "deepspeed-tests-megatron_gpt2-ds_config_func_bs8_zero2.json": [_P, _C],
    "deepspeed-tests-megatron_gpt2-ds_config_func_bs8_zero2_offload.json": [_P, _C],
    "flagai-glm_superglue-deepspeed.json": [_P],
    "flagai-aquila-deepspeed.json": [_P],
    "flagai-altclip-deepspeed.json": [_P],
    "flagai-glm_pretrain-deepspeed.json": [_P],
    "openrlhf-ddpo_ds_config.json": [_P, _C],
    "llama-factory-ds_z3_e11_act_ckpt.json": [_P, _C],
    "gpt-neox-125M.yml": [_P],
    "gpt-neox-1-3B.yml": [_P],
}


def _sources() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in (CORPUS_DIR / "SOURCES.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3), match.group(4))
    return rows


def test_the_corpus_is_real_and_every_file_has_its_source():
    sources = _sources()
    assert sorted(sources) == [p.name for p in CORPUS]
    assert len(CORPUS) >= 25
    repos = {repo for repo, _, _ in sources.values()}
    assert repos >= {"microsoft/DeepSpeedExamples", "microsoft/DeepSpeed", "microsoft/Megatron-DeepSpeed",
                     "THUDM/GLM", "FlagAI-Open/FlagAI", "OpenRLHF/OpenRLHF", "hiyouga/LLaMA-Factory",
                     "huggingface/transformers", "EleutherAI/gpt-neox"}
    with_section = [p for p in DEEPSPEED if "activation_checkpointing" in p.read_text()]
    assert (len(with_section), len(DEEPSPEED) - len(with_section), len(NEOX)) == (19, 11, 3)


def _import(run_cli, path: Path, tmp_path: Path, *flags: str) -> tuple[Path, list[str]]:
    policy = tmp_path / "policy.yaml"
    result = run_cli("import", path, *flags, "-o", policy)
    assert result.code == 0, result.err
    codes = [line.split(": ")[1].split()[1] for line in result.err.splitlines()]
    return policy, codes


def _translated(run_cli, policy: Path) -> dict:
    result = run_cli("translate", policy, "--backend", "deepspeed")
    assert result.code == 0, result.err
    return json.loads(result.out)


def _deepspeed_reads(path: Path) -> dict:
    """The config dict as DeepSpeedConfig reads a config path (deepspeed/runtime/config.py)."""
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    with open(path) as handle:
        return hjson.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.name)
def test_each_config_round_trips_to_what_deepspeed_reads(run_cli, tmp_path, path):
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    policy, codes = _import(run_cli, path, tmp_path, "--modules", "Block")
    assert codes == EXPECTED_FINDINGS.get(path.name, [])
    assert run_cli("validate", policy).code == 0
    section = _translated(run_cli, policy)["activation_checkpointing"]
    original = DeepSpeedActivationCheckpointingConfig(_deepspeed_reads(path))
    translated = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    assert vars(translated) == vars(original)
    assert [type(v) for v in vars(translated).values()] == [type(v) for v in vars(original).values()]


def _neox_configure_kwargs(path: Path) -> dict:
    """What gpt-neox passes to deepspeed.checkpointing.configure for this config
    (megatron/initialize.py, `_configure_deepspeed_activation_checkpointing`; defaults from
    megatron/neox_arguments/neox_args.py): flags read with yaml, `-` folded to `_`."""
    with open(path) as handle:
        args = {k.replace("-", "_"): v for k, v in yaml.safe_load(handle).items()}
    chunk = args.get("checkpoint_num_layers", 1)
    return {
        "partition_activations": args.get("partition_activations", False),
        "contiguous_checkpointing": args.get("contiguous_checkpointing", False),
        "num_checkpoints": -(-args["num_layers"] // chunk),
        "checkpoint_in_cpu": args.get("checkpoint_in_cpu", False),
        "synchronize": args.get("synchronize_each_layer", False),
        "profile": args.get("profile_backward", False),
    }


@pytest.mark.parametrize("path", NEOX, ids=lambda p: p.name)
def test_each_gpt_neox_config_configures_deepspeed_as_gpt_neox_does(run_cli, tmp_path, path, ds_env):
    policy, codes = _import(run_cli, path, tmp_path)  # gpt-neox checkpoints itself: external
    assert codes == EXPECTED_FINDINGS.get(path.name, [])
    assert "  mode: external\n" in policy.read_text()
    translated = _translated(run_cli, policy)
    assert translated["route"] == {"function": "deepspeed.checkpointing.checkpoint", "called_by": "the model"}
    kwargs = translated["configure_kwargs"]
    neox = _neox_configure_kwargs(path)
    states = []
    for passed in (neox, kwargs):
        ds_env.configure(None, **passed)
        states.append(ds_globals(ds_env))
    ds_env._configure_defaults()
    neox_state, actcfg_state = states
    if not neox_state["contiguous_checkpointing"]:
        # DeepSpeed reads the count only to size contiguous buffers: gpt-neox passes its layer
        # count regardless, the policy leaves it unset.
        neox_state.pop("num_checkpoints")
        assert actcfg_state.pop("num_checkpoints") is None
    assert actcfg_state == neox_state


def test_the_numbers(run_cli, tmp_path):
    """How many import with no finding at all, and how many warn (and why: EXPECTED_FINDINGS)."""
    clean = [p for p in CORPUS if p.name not in EXPECTED_FINDINGS]
    assert (len(CORPUS), len(clean), len(EXPECTED_FINDINGS)) == (33, 16, 17)
    assert sum(_C in codes for codes in EXPECTED_FINDINGS.values()) == 8


@pytest.mark.parametrize("name", ["dsexamples-megatron-ds_zero-offload_10B_config.json",
                                  "deepspeed-tests-megatron_gpt2-ds_config_func_bs8_zero2.json"])
def test_a_megatron_config_imports_as_external_with_the_count_megatron_passes(run_cli, tmp_path, name):
    """Megatron calls deepspeed.checkpointing.checkpoint itself and passes num_checkpoints =
    its layer count to configure(): with `--external` that count must come from the user."""
    path = CORPUS_DIR / name
    refused = run_cli("import", path, "--external")
    assert (refused.code, refused.out) == (1, "")
    assert " error contiguous-needs-num-checkpoints: " in refused.err
    assert "(run import with --num-checkpoints N, N the number of checkpointed calls per step " \
           "(Megatron passes its --num-layers), or with --modules to let actcfg.apply count them)" in refused.err
    policy, _ = _import(run_cli, path, tmp_path, "--external", "--num-checkpoints", "24")
    translated = _translated(run_cli, policy)
    assert translated["configure_kwargs"]["num_checkpoints"] == 24
    assert "modules" not in translated["route"]
