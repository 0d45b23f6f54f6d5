"""actcfg.translators.ds_config: merging into and importing from existing DeepSpeed (and
gpt-neox) configs, against what DeepSpeed's own parser reads."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from actcfg.translators.ds_loader import parse_config
from actcfg.errors import TranslationError
from actcfg.policy.schema import Finding, Policy
from actcfg.translators import ImportResult, import_ds_config, merge_ds_config, to_deepspeed
from actcfg.translators.ds_config import MODULES_PLACEHOLDER, merge_conflicts, splice_section

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
AC = "activation_checkpointing"
_CONTIGUOUS = "contiguous_memory_optimization"


def _ds_sections() -> dict[str, dict]:
    out = {}
    for name, policy in case_policies().items():
        try:
            out[name] = to_deepspeed(policy)["activation_checkpointing"]
        except TranslationError:
            continue
    return out


DS_SECTIONS = _ds_sections()


def _codes(result: ImportResult) -> list[tuple[str, str, tuple]]:
    return [(f.severity, f.code, f.path) for f in result.findings]


def _load(result: ImportResult) -> Policy:
    assert result.yaml is not None, result.findings
    return Policy.model_validate(yaml.safe_load(result.yaml))


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
    merged = merge_ds_config({**BASE, AC: {"cpu_checkpointing": True}}, SECTION)
    assert merged[AC] == SECTION
    assert len(merged[AC]) == 6


def test_merge_refuses_conflicting_value() -> None:
    ds = {**BASE, AC: {"partition_activations": False, "cpu_checkpointing": False}}
    with pytest.raises(TranslationError) as info:
        merge_ds_config(ds, SECTION)
    assert info.value.field == "activation_checkpointing.cpu_checkpointing"
    assert str(info.value) == (
        "activation_checkpointing.cpu_checkpointing: the deepspeed backend cannot express this: "
        "`cpu_checkpointing`: the ds_config has false, the policy gives true; remove "
        "`cpu_checkpointing` from the ds_config, or set `cpu_checkpointing: false` in the policy")


@pytest.mark.parametrize(("old", "message", "hint"), [
    ("true", '`cpu_checkpointing`: the ds_config has "true", the policy gives true; "true" is not '
             "a JSON boolean, DeepSpeed tests it for truth and runs it ON",
     "write true in the ds_config, or remove `cpu_checkpointing` there"),
    ("false", '`cpu_checkpointing`: the ds_config has "false", the policy gives true; "false" is '
              "not a JSON boolean, DeepSpeed tests it for truth and runs it ON",
     "write true in the ds_config, or remove `cpu_checkpointing` there"),
    (0, "`cpu_checkpointing`: the ds_config has 0, the policy gives true; 0 is not a JSON "
        "boolean, DeepSpeed tests it for truth and runs it OFF",
     "write true in the ds_config, or remove `cpu_checkpointing` there, or set "
     "`cpu_checkpointing: false` in the policy to keep what DeepSpeed ran"),
])
def test_merge_conflicts_never_advise_a_value_the_schema_refuses(old, message, hint) -> None:
    """`"true"` and `1` are not `true`, and the policy cannot hold them: the advice is a
    boolean, the one DeepSpeed ran."""
    [finding] = merge_conflicts({AC: {"cpu_checkpointing": old}}, SECTION)
    assert finding == Finding("ds-config-conflict", "error", (AC, "cpu_checkpointing"), message, hint)
    policy = Policy.model_validate({"version": 1, "backend": "deepspeed",
                                    "checkpoint": {"mode": "full", "modules": ["B"]},
                                    "cpu_checkpointing": bool(old)})
    assert policy.cpu_checkpointing is bool(old)  # the advised policy value validates


@pytest.mark.parametrize("old", ["12", 0, 2.5, False])
def test_merge_conflict_on_a_bad_count_advises_only_removing_it(old) -> None:
    section = to_deepspeed(Policy.model_validate({
        "version": 1, "backend": "deepspeed", "checkpoint": {"mode": "full", "modules": ["B"]},
        "partition": True, "contiguous": True, "num_checkpoints": 12}))["activation_checkpointing"]
    [finding] = merge_conflicts({AC: {"number_checkpoints": old}}, section)
    assert finding.hint == (f"remove `number_checkpoints` from the ds_config ({json.dumps(old)} "
                            "is not a count of checkpoints)")


@pytest.mark.parametrize(("key", "hint"), [
    ("checkpoint_in_cpu", "(the configure() keyword argument name); the key is `cpu_checkpointing`"),
    ("partitioned_activations", "the key is `partition_activations`"),
    ("profle", "did you mean `profile`?"),
])
def test_merge_refuses_keys_deepspeed_ignores(key: str, hint: str) -> None:
    with pytest.raises(TranslationError) as info:
        merge_ds_config({AC: {key: True}}, SECTION)
    assert info.value.field == f"activation_checkpointing.{key}"
    assert hint in str(info.value)
    assert str(info.value).endswith("; remove it from the ds_config")


def test_merge_reports_every_conflict_not_the_first() -> None:
    found = merge_conflicts({AC: {"checkpoint_in_cpu": True, "profile": True,
                                  "cpu_checkpointing": False}}, SECTION)
    assert [f.path[1] for f in found] == ["checkpoint_in_cpu", "profile", "cpu_checkpointing"]


def test_merge_refuses_misspelt_section() -> None:
    with pytest.raises(TranslationError, match=r"^activation_checkpoint: .*misspelt "
                                               r"`activation_checkpointing`"):
        merge_ds_config({"activation_checkpoint": {"cpu_checkpointing": True}}, SECTION)


def test_merge_refuses_non_object_section() -> None:
    with pytest.raises(TranslationError, match=r"^activation_checkpointing: .*must be a JSON "
                                               r"object, got \[\]"):
        merge_ds_config({AC: []}, SECTION)


def test_merge_warns_when_the_count_is_left_to_apply() -> None:
    section = to_deepspeed(Policy.model_validate({
        "version": 1, "backend": "deepspeed", "checkpoint": {"mode": "full", "modules": ["B"]},
        "partition": True, "contiguous": True}))["activation_checkpointing"]
    [finding] = merge_conflicts(BASE, section)
    assert (finding.severity, finding.code) == ("warning", "num-checkpoints-unset")
    assert "Lightning assert on null" in finding.message


# --- splice: every byte outside the section stays ----------------------------------------


def _splice(text: str) -> str:
    doc = parse_config(text, "ds.json")
    out = splice_section(doc.text, doc.spans, SECTION)
    assert parse_config(out, "ds.json").data == {**doc.data, AC: SECTION}
    return out


def test_splice_replaces_the_section_and_keeps_numbers_text_and_comments() -> None:
    before = ('{\n  // lr as the paper wrote it\n  "lr": 1e-5, "huge": 1e400,\n'
              '  "pi": 3.14159265358979323846264338327950288,\n  "name": "café",\n')
    old = '{\n    "cpu_checkpointing": true,\n  }'
    after = ',\n  "tail": [1, 2,],  # end\n}\n'
    text = before + f'  "{AC}": ' + old + after
    out = _splice(text.replace("1e400", "1e300"))
    new = json.dumps(SECTION, indent=2).replace("\n", "\n  ")
    assert out == (before + f'  "{AC}": ' + new + after).replace("1e400", "1e300")


def test_splice_adds_a_missing_section_after_the_last_member() -> None:
    text = '{\n    "train_batch_size": 8,\n    "fp16": {"enabled": true}\n}\n'
    out = _splice(text)
    body = json.dumps(SECTION, indent=4).replace("\n", "\n    ")
    assert out == ('{\n    "train_batch_size": 8,\n    "fp16": {"enabled": true},\n'
                   f'    "{AC}": {body}\n}}\n')


@pytest.mark.parametrize(("text", "expected"), [
    ("{}", '{"activation_checkpointing": ' + json.dumps(SECTION) + "}"),
    ('{"a": 1e400}', '{"a": 1e400, "activation_checkpointing": ' + json.dumps(SECTION) + "}"),
    ("{\r\n  \"a\": 1\r\n}\r\n", "{\r\n  \"a\": 1,\r\n  \"activation_checkpointing\": "
     + json.dumps(SECTION, indent=2).replace("\n", "\r\n  ") + "\r\n}\r\n"),
])
def test_splice_keeps_one_line_files_on_one_line_and_crlf_files_crlf(text, expected) -> None:
    assert _splice(text) == expected


def test_splice_refuses_an_hjson_top_level_without_braces() -> None:
    doc = parse_config("a: 1\nb: 2\n", "ds.json")
    with pytest.raises(TranslationError, match="has no braces"):
        splice_section(doc.text, doc.spans, SECTION)


# --- import ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DS_SECTIONS))
def test_import_round_trips_every_translated_section(name: str) -> None:
    section = DS_SECTIONS[name]
    result = import_ds_config({**BASE, "activation_checkpointing": section}, modules=["Block"])
    assert [f.code for f in result.findings if f.code != "partition-needs-model-parallel"] == []
    policy = _load(result)
    assert policy.backend == "deepspeed"
    assert to_deepspeed(policy)["activation_checkpointing"] == section


def test_import_output_is_pinned() -> None:
    result = import_ds_config({AC: {"cpu_checkpointing": True}}, modules=["GPT2Block"])
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
        "profile: false\n"), findings=[])
    assert _load(result).checkpoint.modules == ("GPT2Block",)


def test_import_without_modules_writes_a_placeholder_that_validate_refuses() -> None:
    from actcfg.policy.checker import check_text

    result = import_ds_config({AC: {}})
    assert _codes(result) == [("warning", "placeholder", (AC,))]
    assert result.findings[0].hint == (
        "run import with --modules CLASSNAME... (the checkpointed modules' class names), or "
        "--external if the model calls deepspeed.checkpointing.checkpoint itself")
    assert f'modules: ["{MODULES_PLACEHOLDER}"]' in result.yaml
    policy, [d] = check_text(result.yaml)
    assert policy is None and (d.code, d.severity) == ("placeholder", "error")


def test_import_without_section_is_a_bare_policy() -> None:
    result = import_ds_config(BASE)
    assert result.findings == []
    assert _load(result) == Policy.model_validate({"version": 1, "backend": "deepspeed"})
    assert "# no activation_checkpointing section" in result.yaml


def test_import_reports_every_finding_and_keeps_what_deepspeed_did() -> None:
    """`checkpoint_in_cpu` is ignored by DeepSpeed, so CPU checkpointing stays off; the other
    findings come in the same run."""
    result = import_ds_config({AC: {"checkpoint_in_cpu": True, "partitioned_activations": True,
                                    "profile": "yes", "number_checkpoints": False}},
                              modules=["B"])
    assert _codes(result) == [
        ("warning", "ignored-key", (AC, "checkpoint_in_cpu")),
        ("warning", "ignored-key", (AC, "partitioned_activations")),
        ("warning", "truthy-value", (AC, "profile")),
        ("warning", "ignored-key", (AC, "number_checkpoints")),
    ]
    assert result.findings[0].message == (
        "DeepSpeed reads only its six keys and ignores `checkpoint_in_cpu` (the configure() "
        "keyword argument name); the key is `cpu_checkpointing`")
    policy = _load(result)
    assert (policy.cpu_checkpointing, policy.partition, policy.profile) == (False, False, True)
    assert "# DeepSpeed reads only its six keys and ignores `checkpoint_in_cpu`" in result.yaml


@pytest.mark.parametrize(("value", "runs"), [("false", True), ("auto", True), (1, True),
                                             ([0], True), (0, False), (None, False), ("", False)])
def test_import_takes_what_deepspeed_runs_for_non_boolean_values(value, runs: bool) -> None:
    result = import_ds_config({AC: {"partition_activations": value}}, modules=["B"])
    [finding] = [f for f in result.findings if f.code == "truthy-value"]
    on = "ON" if runs else "OFF"
    assert finding.message == (
        f"`partition_activations` is {json.dumps(value)}, not a boolean: DeepSpeed tests it for "
        f"truth and runs it {on}; imported as `partition: {json.dumps(runs)}`")
    assert _load(result).partition is runs


@pytest.mark.parametrize("value", ["4", 0, True, 2.5, False])
def test_a_count_deepspeed_never_reads_is_dropped_without_a_failure_story(value) -> None:
    """Without contiguous buffers DeepSpeed never reads number_checkpoints: nothing can fail."""
    result = import_ds_config({AC: {"number_checkpoints": value}}, modules=["B"])
    [finding] = result.findings
    assert finding.code == "ignored-key" and "never read" in finding.message
    assert "IndexError" not in finding.message and "fails" not in finding.message
    assert _load(result).num_checkpoints is None


def test_a_count_deepspeed_never_reads_is_still_kept_when_it_is_a_count() -> None:
    result = import_ds_config({AC: {"number_checkpoints": 4}}, modules=["B"])
    assert [f.code for f in result.findings] == ["unused-setting"]
    assert _load(result).num_checkpoints == 4


@pytest.mark.parametrize(("section", "wrote"), [
    ({}, "no count"), ({"number_checkpoints": None}, "number_checkpoints null"),
    ({"number_checkpoints": False}, "number_checkpoints false"),
])
def test_contiguous_without_a_count_is_imported_and_says_where_the_count_comes_from(section, wrote):
    """Megatron-DeepSpeed, DeepSpeedExamples, LLaMA-Factory and OpenRLHF configs do this:
    Megatron passes num_checkpoints itself, and apply passes the number of routed modules."""
    result = import_ds_config({AC: {"partition_activations": True,
                                    "contiguous_memory_optimization": True, **section}},
                              modules=["Block"])
    [unset] = [f for f in result.findings if f.code == "num-checkpoints-unset"]
    assert unset.severity == "warning"
    assert unset.message.startswith(f"contiguous_memory_optimization is on with {wrote}: DeepSpeed ")
    assert "actcfg.apply passes the number of modules it routes" in unset.message
    policy = _load(result)
    assert (policy.partition, policy.contiguous, policy.num_checkpoints) == (True, True, None)
    assert to_deepspeed(policy)["fill_in"] == {"num_checkpoints": (
        "the number of modules the route selects: actcfg.apply passes it to configure(); "
        "passed as null, deepspeed.checkpointing.configure asserts")}


def test_contiguous_without_partition_is_the_schemas_error_and_writes_nothing() -> None:
    result = import_ds_config({AC: {"contiguous_memory_optimization": True,
                                    "number_checkpoints": 4, "checkpoint_in_cpu": True}},
                              modules=["B"])
    assert result.yaml is None
    assert _codes(result) == [
        ("warning", "ignored-key", (AC, "checkpoint_in_cpu")),
        ("error", "contiguous-needs-partition", (AC, "contiguous_memory_optimization")),
    ]


@pytest.mark.parametrize(("section", "what"), [
    (None, "null: DeepSpeed fails when it builds its config (AttributeError: 'NoneType' object "
           "has no attribute 'get'), it does not take null for 'no section'"),
    ([], "[], not a JSON object: DeepSpeed fails when it builds its config"),
])
def test_a_section_that_is_not_an_object_is_an_error_not_an_empty_policy(section, what) -> None:
    result = import_ds_config({AC: section})
    assert result.yaml is None
    assert result.findings == [Finding(
        "bad-value", "error", (AC,), f"`activation_checkpointing` is {what}",
        'write `"activation_checkpointing": {}` for DeepSpeed\'s defaults, or remove it')]


def test_a_setting_at_the_top_level_is_reported_not_imported() -> None:
    result = import_ds_config({"cpu_checkpointing": True, AC: {}}, modules=["B"])
    assert _codes(result) == [("warning", "ignored-key", ("cpu_checkpointing",))]
    assert _load(result).cpu_checkpointing is False


def test_import_key_cannot_inject_yaml() -> None:
    result = import_ds_config({AC: {"x\npin: false\u2028pin_budget: 1\x85profile: true": True}},
                              modules=["B"])
    body = [line for line in result.yaml.splitlines() if not line.startswith("#")]
    assert [line.split(":")[0] for line in body] == [
        "version", "backend", "checkpoint", "  mode", "  modules", "partition", "contiguous",
        "num_checkpoints", "cpu_checkpointing", "synchronize", "profile"]
    assert _load(result).profile is False
    assert [f.code for f in result.findings] == ["ignored-key"]


def test_import_reports_misspelt_section() -> None:
    result = import_ds_config({"activation_checkpointing_": {"cpu_checkpointing": True}})
    assert _codes(result) == [("warning", "ignored-key", ("activation_checkpointing_",))]
    assert _load(result).cpu_checkpointing is False


def test_import_refuses_what_is_not_an_object() -> None:
    result = import_ds_config([1, 2])
    assert result.yaml is None and [f.code for f in result.findings] == ["bad-value"]


def test_import_external_writes_mode_external_and_no_placeholder() -> None:
    result = import_ds_config({AC: {"cpu_checkpointing": True}}, external=True)
    assert result.findings == []
    assert "checkpoint:\n  mode: external\n" in result.yaml and MODULES_PLACEHOLDER not in result.yaml
    policy = _load(result)
    assert policy.checkpoint.mode == "external"
    assert to_deepspeed(policy)["route"] == {"function": "deepspeed.checkpointing.checkpoint",
                                             "called_by": "the model"}


def test_external_contiguous_needs_the_count_the_program_passes() -> None:
    section = {AC: {"partition_activations": True, "contiguous_memory_optimization": True}}
    refused = import_ds_config(section, external=True)
    assert refused.yaml is None
    [error] = [f for f in refused.findings if f.severity == "error"]
    assert (error.code, error.path) == ("contiguous-needs-num-checkpoints", (AC, _CONTIGUOUS))
    assert error.hint.startswith("run import with --num-checkpoints N")
    assert "num-checkpoints-unset" not in [f.code for f in refused.findings]  # said once, as the error
    result = import_ds_config(section, external=True, num_checkpoints=24)
    assert _load(result).num_checkpoints == 24


def test_a_count_given_to_import_overrides_the_files_and_says_so() -> None:
    result = import_ds_config({AC: {"partition_activations": True, "contiguous_memory_optimization": True,
                                    "number_checkpoints": 12}}, modules=["B"], num_checkpoints=24)
    assert [f.code for f in result.findings][:1] == ["ignored-key"]
    assert result.findings[0].message.startswith("`number_checkpoints` is 12, but --num-checkpoints gives 24")
    assert _load(result).num_checkpoints == 24


# --- gpt-neox ----------------------------------------------------------------------------


@pytest.mark.parametrize("spell", [lambda k: k.replace("_", "-"), lambda k: k])
def test_gpt_neox_flags_are_imported_in_either_spelling(spell) -> None:
    config = {spell(k): v for k, v in {
        "checkpoint_activations": True, "checkpoint_num_layers": 2, "partition_activations": True,
        "contiguous_checkpointing": True, "checkpoint_in_cpu": True,
        "synchronize_each_layer": True, "profile_backward": False, "num_layers": 11}.items()}
    result = import_ds_config(config, modules=["ParallelTransformerLayerPipe"])
    assert result.source == "gpt-neox"
    policy = _load(result)
    assert (policy.partition, policy.contiguous, policy.cpu_checkpointing, policy.synchronize,
            policy.profile) == (True, True, True, True, False)
    assert policy.num_checkpoints == 6  # ceil(11 / 2), as gpt-neox passes it to configure()
    assert "# num_checkpoints: ceil(" in result.yaml


def test_gpt_neox_models_checkpoint_themselves_so_import_writes_external() -> None:
    result = import_ds_config({"num-layers": 44, "checkpoint-activations": True,
                               "contiguous-checkpointing": True, "partition-activations": True,
                               "checkpoint-num-layers": 4})
    policy = _load(result)
    assert (policy.checkpoint.mode, policy.contiguous, policy.num_checkpoints) == ("external", True, 11)
    refused = import_ds_config({"checkpoint-activations": True, "contiguous-checkpointing": True,
                                "partition-activations": True})  # no num-layers to count with
    assert refused.yaml is None
    assert [f.code for f in refused.findings if f.severity == "error"] == ["contiguous-needs-num-checkpoints"]
    assert _load(import_ds_config({"checkpoint-activations": True, "contiguous-checkpointing": True,
                                   "partition-activations": True}, num_checkpoints=8)).num_checkpoints == 8


def test_gpt_neox_flags_without_checkpoint_activations_do_nothing() -> None:
    result = import_ds_config({"partition-activations": True, "checkpoint-activations": False})
    assert _codes(result) == [("warning", "ignored-key", ("partition-activations",))]
    assert _load(result) == Policy.model_validate({"version": 1, "backend": "deepspeed"})


def test_gpt_neox_flag_spelled_twice_reads_the_last() -> None:
    result = import_ds_config({"checkpoint-activations": True, "partition-activations": False,
                               "partition_activations": True}, modules=["B"])
    assert _codes(result)[0] == ("warning", "neox-spelled-twice", ("partition_activations",))
    assert _load(result).partition is True


# --- against DeepSpeed itself --------------------------------------------------------------


@pytest.mark.deepspeed
@pytest.mark.parametrize("section", [
    {"partition_activations": True, "cpu_checkpointing": True, "checkpoint_in_cpu": False,
     "synchronize_checkpoint_boundary": True},
    {"partition_activations": "false", "profile": 1, "cpu_checkpointing": []},
    {"number_checkpoints": 7},
])
def test_imported_policy_matches_what_deepspeed_parses(ds_env, section) -> None:
    """Whatever import keeps, DeepSpeed's own parser reads the same way (by truth, as its
    `if` tests do)."""
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    parsed = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    policy = _load(import_ds_config({"activation_checkpointing": section}, modules=["B"]))
    assert (bool(parsed.partition_activations), bool(parsed.cpu_checkpointing),
            bool(parsed.synchronize_checkpoint_boundary), bool(parsed.contiguous_memory_optimization),
            parsed.number_checkpoints, bool(parsed.profile)) == (
        policy.partition, policy.cpu_checkpointing, policy.synchronize, policy.contiguous,
        policy.num_checkpoints, policy.profile)
