"""actcfg.translate.ds_config: merging into and importing from existing DeepSpeed configs."""

from __future__ import annotations

import copy

import pytest
import yaml

from actcfg.errors import TranslationError
from actcfg.schema import Policy
from actcfg.translate import ImportResult, import_ds_config, merge_ds_config, to_deepspeed
from actcfg.translate.ds_config import MODULES_PLACEHOLDER

try:
    from tests._deepspeed_env import ds_env
    from tests._translate_cases import case_policies
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env
    from _translate_cases import case_policies

__all__ = ["ds_env"]

POLICY = Policy.model_validate({"version": 1, "backend": "deepspeed",
                                "checkpoint": {"mode": "full", "modules": ["Block"]},
                                "cpu_checkpointing": True})
SECTION = to_deepspeed(POLICY)["activation_checkpointing"]
BASE = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}


def _ds_sections() -> dict[str, dict]:
    out = {}
    for name, policy in case_policies().items():
        try:
            out[name] = to_deepspeed(policy)["activation_checkpointing"]
        except TranslationError:
            continue
    return out


DS_SECTIONS = _ds_sections()


# --- merge -------------------------------------------------------------------------------


def test_merge_into_config_without_section_keeps_everything_else() -> None:
    original = copy.deepcopy(BASE)
    merged = merge_ds_config(BASE, SECTION)
    assert merged == {**BASE, "activation_checkpointing": SECTION}
    assert list(merged) == ["train_batch_size", "zero_optimization", "activation_checkpointing"]
    assert BASE == original
    merged["zero_optimization"]["stage"] = 3
    assert BASE["zero_optimization"]["stage"] == 2  # a copy, not a view


def test_merge_over_agreeing_partial_section_fills_every_key() -> None:
    merged = merge_ds_config({**BASE, "activation_checkpointing": {"cpu_checkpointing": True}},
                             SECTION)
    assert merged["activation_checkpointing"] == SECTION
    assert len(merged["activation_checkpointing"]) == 6


def test_merge_refuses_conflicting_value() -> None:
    ds = {**BASE, "activation_checkpointing": {"partition_activations": False,
                                               "cpu_checkpointing": False}}
    with pytest.raises(TranslationError) as info:
        merge_ds_config(ds, SECTION)
    assert info.value.field == "activation_checkpointing.cpu_checkpointing"
    assert str(info.value) == (
        "activation_checkpointing.cpu_checkpointing: the deepspeed backend cannot express this: "
        "the ds_config has false, the policy gives true; remove `cpu_checkpointing` from the "
        "ds_config, or set `cpu_checkpointing` in the policy to false")


def test_merge_refuses_look_alike_values() -> None:
    """`1` and `"true"` are not `true`: DeepSpeed would run them differently from the policy
    only by luck, so they are conflicts."""
    for old in (1, "true"):
        with pytest.raises(TranslationError, match=r"the ds_config has (1|\"true\"), the policy gives true"):
            merge_ds_config({"activation_checkpointing": {"cpu_checkpointing": old}}, SECTION)


@pytest.mark.parametrize(("key", "hint"), [
    ("checkpoint_in_cpu", "(the configure() keyword argument name); the key is `cpu_checkpointing`"),
    ("partitioned_activations", "the key is `partition_activations`"),
    ("profle", "did you mean `profile`?"),
])
def test_merge_refuses_keys_deepspeed_ignores(key: str, hint: str) -> None:
    with pytest.raises(TranslationError) as info:
        merge_ds_config({"activation_checkpointing": {key: True}}, SECTION)
    assert info.value.field == f"activation_checkpointing.{key}"
    assert hint in str(info.value)
    assert str(info.value).endswith("; remove it from the ds_config")


def test_merge_refuses_misspelt_section() -> None:
    with pytest.raises(TranslationError, match=r"^activation_checkpoint: .*misspelt "
                                               r"`activation_checkpointing`"):
        merge_ds_config({"activation_checkpoint": {"cpu_checkpointing": True}}, SECTION)


def test_merge_refuses_non_object_section() -> None:
    with pytest.raises(TranslationError, match=r"^activation_checkpointing: .*must be a JSON "
                                               r"object, got list$"):
        merge_ds_config({"activation_checkpointing": []}, SECTION)


# --- import ------------------------------------------------------------------------------


def _load(result: ImportResult) -> Policy:
    return Policy.model_validate(yaml.safe_load(result.yaml))


@pytest.mark.parametrize("name", sorted(DS_SECTIONS))
def test_import_round_trips_every_translated_section(name: str) -> None:
    section = DS_SECTIONS[name]
    result = import_ds_config({**BASE, "activation_checkpointing": section})
    assert result.ignored == []
    policy = _load(result)
    assert policy.backend == "deepspeed"
    assert to_deepspeed(policy)["activation_checkpointing"] == section


def test_import_output_is_pinned() -> None:
    result = import_ds_config({"activation_checkpointing": {"cpu_checkpointing": True}},
                              modules=["GPT2Block"])
    assert result == ImportResult(yaml=(
        "# actcfg policy imported from a DeepSpeed config (actcfg import)\n"
        "version: 1\n"
        "backend: deepspeed\n"
        "checkpoint:\n"
        "  mode: full\n"
        '  modules: ["GPT2Block"]\n'
        "partition: false\n"
        "contiguous: false\n"
        "num_checkpoints: null\n"
        "cpu_checkpointing: true\n"
        "synchronize: false\n"
        "profile: false\n"), ignored=[])
    assert _load(result).checkpoint.modules == ("GPT2Block",)


def test_import_without_modules_leaves_a_placeholder_that_matches_nothing() -> None:
    result = import_ds_config({"activation_checkpointing": {}})
    assert _load(result).checkpoint.modules == (MODULES_PLACEHOLDER,)
    assert "# checkpoint.modules: the ds_config cannot say" in result.yaml


def test_import_without_section_is_a_bare_policy() -> None:
    result = import_ds_config(BASE)
    assert result.ignored == []
    assert _load(result) == Policy.model_validate({"version": 1, "backend": "deepspeed"})


def test_import_reports_typos_and_keeps_what_deepspeed_did() -> None:
    """`checkpoint_in_cpu` is ignored by DeepSpeed, so CPU checkpointing stays off."""
    result = import_ds_config({"activation_checkpointing": {
        "checkpoint_in_cpu": True, "partitioned_activations": True, "profile": True}})
    assert [k for k, _ in result.ignored] == ["checkpoint_in_cpu", "partitioned_activations"]
    assert result.ignored[0][1] == (
        "DeepSpeed reads only its six keys and ignores `checkpoint_in_cpu` (the configure() "
        "keyword argument name); the key is `cpu_checkpointing`")
    policy = _load(result)
    assert (policy.cpu_checkpointing, policy.partition, policy.profile) == (False, False, True)
    assert "# ignored checkpoint_in_cpu: DeepSpeed reads only" in result.yaml


@pytest.mark.parametrize(("value", "effect"), [("false", "ON"), ("auto", "ON"), (1, "ON"),
                                               (0, "OFF"), (None, "OFF")])
def test_import_does_not_guess_non_boolean_values(value, effect: str) -> None:
    result = import_ds_config({"activation_checkpointing": {"cpu_checkpointing": value}})
    assert len(result.ignored) == 1
    key, why = result.ignored[0]
    assert key == "cpu_checkpointing"
    assert f"treats it as {effect} (Python truthiness)" in why
    assert "`cpu_checkpointing` was left at its default" in why
    assert _load(result).cpu_checkpointing is False


@pytest.mark.parametrize("value", ["4", 0, True, 2.5])
def test_import_refuses_bad_number_checkpoints(value) -> None:
    result = import_ds_config({"activation_checkpointing": {"number_checkpoints": value}})
    assert [k for k, _ in result.ignored] == ["number_checkpoints"]
    assert "is not a positive whole number" in result.ignored[0][1]
    assert _load(result).num_checkpoints is None


def test_import_refuses_settings_deepspeed_would_assert_on() -> None:
    with pytest.raises(TranslationError, match=r"^activation_checkpointing: .*do not form a "
                                               r"valid policy .*needs `partition: true`"):
        import_ds_config({"activation_checkpointing": {"contiguous_memory_optimization": True,
                                                       "number_checkpoints": 4}})


def test_import_key_cannot_inject_yaml() -> None:
    result = import_ds_config({"activation_checkpointing": {
        "x\npin: false\u2028pin_budget: 1\x85profile: true": True}})
    body = [line for line in result.yaml.splitlines() if not line.startswith("#")]
    assert [line.split(":")[0] for line in body] == [
        "version", "backend", "checkpoint", "  mode", "  modules", "partition", "contiguous",
        "num_checkpoints", "cpu_checkpointing", "synchronize", "profile"]
    assert _load(result).profile is False
    assert len(result.ignored) == 1


def test_import_reports_misspelt_section() -> None:
    result = import_ds_config({"activation_checkpointing_": {"cpu_checkpointing": True}})
    assert [k for k, _ in result.ignored] == ["activation_checkpointing_"]
    assert _load(result).cpu_checkpointing is False


@pytest.mark.deepspeed
def test_imported_policy_matches_what_deepspeed_parses(ds_env) -> None:
    """Whatever import keeps, DeepSpeed's own parser reads the same way."""
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    section = {"partition_activations": True, "cpu_checkpointing": True, "checkpoint_in_cpu": False,
               "synchronize_checkpoint_boundary": True}
    parsed = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    policy = _load(import_ds_config({"activation_checkpointing": section}))
    assert (parsed.partition_activations, parsed.cpu_checkpointing,
            parsed.synchronize_checkpoint_boundary, parsed.contiguous_memory_optimization,
            parsed.number_checkpoints, parsed.profile) == (
        policy.partition, policy.cpu_checkpointing, policy.synchronize, policy.contiguous,
        policy.num_checkpoints, policy.profile)
