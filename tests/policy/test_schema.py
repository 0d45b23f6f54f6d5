"""schema: strictness, sizes, each cross-field rule's exact finding, and the JSON Schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from actcfg.policy.loader import read_document
from actcfg.policy.schema import (
    Backend,
    Finding,
    FullCheckpoint,
    Policy,
    check_rules,
    format_size,
    parse_size,
    policy_json_schema,
    user_path,
)
from conftest import CONFIGS, DATA, ROOT

FULL = {"mode": "full", "modules": ["Block"]}


def _errors(data, **context):
    with pytest.raises(ValidationError) as info:
        Policy.model_validate(data, context=context or None)
    out = info.value.errors(include_url=False)
    for e in out:
        e.pop("input", None)
    return out


def test_quoted_false_is_not_a_boolean():
    assert _errors({"version": 1, "pin": "false"}) == [
        {"type": "bool_type", "loc": ("pin",), "msg": "Input should be a valid boolean"}
    ]


def test_unknown_keys_are_errors_at_every_level():
    assert _errors({"version": 1, "checkpoint_in_cpu": True,
                    "checkpoint": {**FULL, "evry": 2}}) == [
        {"type": "extra_forbidden", "loc": ("checkpoint", "full", "evry"),
         "msg": "Extra inputs are not permitted"},
        {"type": "extra_forbidden", "loc": ("checkpoint_in_cpu",),
         "msg": "Extra inputs are not permitted"},
    ]


def test_unknown_mode_is_one_union_tag_error():
    assert _errors({"version": 1, "checkpoint": {"mode": "fll"}}) == [
        {"type": "union_tag_invalid", "loc": ("checkpoint",),
         "msg": "Input tag 'fll' found using 'mode' does not match any of the expected tags: "
                "'none', 'full', 'selective', 'external', 'rules', 'auto'",
         "ctx": {"discriminator": "'mode'", "tag": "fll",
                 "expected_tags": "'none', 'full', 'selective', 'external', 'rules', 'auto'"}}
    ]


def test_user_path_strips_the_union_tag():
    data = {"checkpoint": {"mode": "full"}}
    assert user_path(("checkpoint", "full", "every"), data) == ("checkpoint", "every")
    assert user_path(("checkpoint", "full", "every"), {"checkpoint": {"mode": "selective"}}) == (
        "checkpoint", "full", "every")
    assert user_path(("pin",), data) == ("pin",)


def test_frozen():
    policy = Policy(version=1)
    with pytest.raises(ValidationError):
        policy.pin = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "n"),
    [("16GiB", 16 * 2**30), ("8 GB", 8 * 10**9), ("1.5GiB", 3 * 2**29), ("512", 512),
     ("0", 0), (1024, 1024), ("2kb", 2000), (" 3 MiB ", 3 * 2**20),
     ("1" * 400 + "TiB", int("1" * 400) * 2**40)],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    ("value", "kind"),
    [("16 gigs", "size_format"), ("1.5", "size_format"), ("1e9", "size_format"), (-1, "size_negative"),
     (True, "size_type"), (1.5, "size_type"), (None, "size_type")],
)
def test_parse_size_refusals(value, kind):
    with pytest.raises(Exception) as info:
        parse_size(value)
    assert info.value.type == kind


@pytest.mark.parametrize("text", ["0.0000000001KiB", "0.0004KB", "0.0000009MB"])
def test_a_size_under_one_byte_is_refused_not_rounded_to_0(text):
    with pytest.raises(Exception) as info:
        parse_size(text)
    assert info.value.type == "size_under_a_byte"
    assert str(info.value) == f"'{text}' is less than one byte, which would round to 0 (no pinned memory at all)"
    assert parse_size("0.0KiB") == 0 and parse_size("0.001KB") == 1


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_version_is_the_integer_1(value):
    # Literal[1] alone took `true` and `1.0`, both == 1 in Python.
    assert _errors({"version": value}) == [
        {"type": "literal_error", "loc": ("version",), "msg": "Input should be 1",
         **({"ctx": {"expected": "1"}})}
    ]


def test_format_size_round_trips():
    for n in (0, 1, 1023, 2**10, 3 * 2**20, 16 * 2**30, 5 * 2**40):
        assert parse_size(format_size(n)) == n
    assert format_size(16 * 2**30) == "16GiB"


def _finding(policy_data, backends=()):
    return check_rules(Policy.model_validate(policy_data), tuple(backends))


def _rule_error(data, **context) -> tuple[Finding, ...]:
    [error] = _errors(data, **context)
    assert error["type"] == "policy_rule" and error["loc"] == ()
    return error["ctx"]["findings"]


def test_contiguous_needs_partition():
    findings = _rule_error({"version": 1, "backend": "deepspeed", "checkpoint": FULL, "contiguous": True})
    assert findings == (
        Finding("contiguous-needs-partition", "error", ("contiguous",),
                "`contiguous` packs partitioned activations into one buffer; it needs `partition: true`",
                "set `partition: true`, or remove `contiguous`"),
    )


def test_contiguous_with_routed_modules_leaves_the_count_to_apply():
    """With `mode: full` apply routes the modules and knows how many: no num_checkpoints needed."""
    policy = Policy.model_validate({"version": 1, "backend": "deepspeed", "checkpoint": FULL,
                                    "partition": True, "contiguous": True})
    assert policy.num_checkpoints is None
    assert [f.code for f in check_rules(policy)] == ["partition-needs-model-parallel"]


def test_the_import_placeholder_is_refused_with_what_to_write_instead():
    [f] = _rule_error({"version": 1, "backend": "deepspeed",
                       "checkpoint": {"mode": "full", "modules": ["Block", "CHANGE_ME"]}})
    assert f == Finding(
        "placeholder", "error", ("checkpoint", "modules"),
        "`CHANGE_ME` is the placeholder `actcfg import` writes: a ds_config cannot say which "
        "modules the model checkpoints",
        "replace CHANGE_ME with the class names of the modules to checkpoint, or write "
        "`mode: external` if the model calls deepspeed.checkpointing.checkpoint itself")


def test_selective_is_torch_only():
    [f] = _rule_error({"version": 1, "backend": "deepspeed",
                       "checkpoint": {"mode": "selective", "modules": ["Block"]}})
    assert (f.code, f.path) == ("torch-only", ("checkpoint", "mode"))
    assert f.message == ("checkpoint.mode `selective` is torch-only: DeepSpeed recomputes whole "
                         "modules, but the backend is deepspeed")


def test_reentrant_is_torch_only_and_not_with_selective():
    [f] = _rule_error({"version": 1, "backend": "deepspeed", "checkpoint": {**FULL, "reentrant": False}})
    assert (f.code, f.path) == ("torch-only", ("checkpoint", "reentrant"))
    [f] = _rule_error({"version": 1, "checkpoint": {"mode": "selective", "modules": ["B"], "reentrant": True}})
    assert f.code == "selective-not-reentrant"


def test_partition_and_contiguous_are_deepspeed_only():
    findings = _rule_error({"version": 1, "backend": "torch", "checkpoint": FULL, "partition": True,
                            "contiguous": True, "num_checkpoints": 4})
    assert [(f.code, f.path) for f in findings] == [
        ("deepspeed-only", ("partition",)), ("deepspeed-only", ("contiguous",)),
        ("deepspeed-only", ("num_checkpoints",)),
    ]
    assert findings[0].message == (
        "`partition` is DeepSpeed-only (DeepSpeed's partition_activations; torch's analogue is "
        "tensor-parallel input_reshard), but the backend is torch"
    )


def test_cpu_checkpointing_without_checkpointing_is_torch_only():
    assert Policy.model_validate({"version": 1, "cpu_checkpointing": True}).cpu_checkpointing
    [f] = _rule_error({"version": 1, "backend": "deepspeed", "cpu_checkpointing": True})
    assert (f.code, f.path) == ("needs-checkpointing", ("cpu_checkpointing",))
    assert f.hint.endswith("(offloading every activation is torch-only)")


def test_backend_from_context_is_checked_too():
    [f] = _rule_error({"version": 1, "cpu_checkpointing": True}, backends=(Backend.DEEPSPEED,))
    assert f.message == ("`cpu_checkpointing` acts only inside deepspeed.checkpointing.checkpoint "
                         "(deepspeed backend, from --backend), but checkpoint.mode is none: it would do nothing")


def test_warnings_do_not_fail_validation():
    data = {"version": 1, "backend": "deepspeed", "checkpoint": FULL, "partition": True}
    assert [(f.code, f.severity) for f in _finding(data)] == [("partition-needs-model-parallel", "warning")]
    data = {"version": 1, "pin_budget": "1GiB"}
    [f] = _finding(data)
    assert (f.code, f.severity, f.path) == ("unused-setting", "warning", ("pin_budget",))
    data = {"version": 1, "num_checkpoints": 4, "backend": "deepspeed", "checkpoint": FULL}
    assert [(f.code, f.path) for f in _finding(data)] == [("unused-setting", ("num_checkpoints",))]


def test_defaults():
    policy = Policy(version=1)
    assert policy.backend is Backend.TORCH and policy.checkpoint.mode == "none"
    assert (policy.partition, policy.cpu_checkpointing, policy.pin, policy.pin_budget) == (False, False, True, None)
    assert FullCheckpoint(mode="full", modules=("Block",)).every == 1


# --- the JSON Schema -------------------------------------------------------------------------


def test_committed_schema_is_up_to_date():
    committed = json.loads((ROOT / "docs" / "actcfg.schema.json").read_text())
    assert committed == policy_json_schema()


def test_schema_is_draft7_with_descriptions_and_no_extra_properties():
    schema = policy_json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    models = [d for d in schema["definitions"].values() if "properties" in d]
    # none, full, selective, external, rules (with Rule and Prediction), auto, compile
    assert len(models) == 9 and all(d["additionalProperties"] is False for d in models)
    assert all("description" in p for p in schema["properties"].values())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_schema_accepts_every_config(path):
    jsonschema.Draft7Validator(policy_json_schema()).validate(read_document(path).data)


@pytest.mark.parametrize(
    "name", ["seed-checkpoint-in-cpu.yaml", "yaml11-boolean.yaml", "quoted-false.yaml", "bad-mode.yaml",
             "missing-version.yaml", "wrong-level.yaml", "bad-size.yaml", "version-true.yaml"],
)
def test_schema_rejects_invalid_files(name):
    data = read_document(DATA / "invalid" / name).data
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(policy_json_schema()).validate(data)


def test_readme_key_table_documents_every_key():
    import re

    from actcfg.policy.suggest import keys_at

    rows = re.findall(r"^\| `([a-z_.]+)` \|", (ROOT / "README.md").read_text(), re.M)
    expected = [*keys_at(()), *(f"checkpoint.{k}" for k in keys_at(("checkpoint",), "selective"))]
    assert sorted(rows) == sorted(expected)


# --- rules, auto and memory_budget --------------------------------------------------------------

AUTO = {"mode": "auto", "modules": ["Block"]}
RULES = {"mode": "rules", "rules": [{"modules": ["blocks.0"], "mode": "none", "cpu_checkpointing": True},
                                    {"modules": ["Block"]}]}


def test_rules_defaults_and_every_file_that_validated_before_means_the_same():
    policy = Policy.model_validate({"version": 1, "checkpoint": RULES})
    ckpt = policy.checkpoint
    assert [(r.mode, r.cpu_checkpointing, r.save_ops) for r in ckpt.rules] == [("none", True, None), ("full", False, None)]
    assert (ckpt.keep_last, ckpt.max_inflight, ckpt.predicted, policy.memory_budget) == (1, 1, None, None)
    old = Policy.model_validate({"version": 1, "checkpoint": FULL, "cpu_checkpointing": True})
    assert old.memory_budget is None and old.checkpoint == FullCheckpoint(mode="full", modules=("Block",))


def test_auto_needs_a_memory_budget():
    [f] = _rule_error({"version": 1, "checkpoint": AUTO})
    assert f == Finding(
        "budget-needed", "error", ("checkpoint", "mode"),
        "checkpoint.mode `auto` asks for the fastest plan within `memory_budget`, which is not set",
        "add `memory_budget: <size>` (the most GPU memory one training step may allocate, such as "
        "40GiB), or choose the mode yourself: none, full, selective or rules")
    assert Policy.model_validate({"version": 1, "checkpoint": AUTO, "memory_budget": "6GiB"}).memory_budget == 6 * 2**30


@pytest.mark.parametrize("checkpoint", [FULL, {"mode": "none"}, RULES, {"mode": "external"}])
def test_memory_budget_beside_a_hand_set_mode_names_both_and_the_fix(checkpoint):
    [f] = _rule_error({"version": 1, "checkpoint": checkpoint, "memory_budget": "6GiB"})
    assert f == Finding(
        "budget-without-plan", "error", ("memory_budget",),
        f"`memory_budget` asks for a plan, but checkpoint.mode is {checkpoint['mode']}, set by hand: "
        "the budget and the hand-set mode could disagree",
        "remove `memory_budget`, or write `checkpoint: {mode: auto, modules: [...]}` to let actcfg "
        "plan within it (`actcfg plan` writes the plan as `mode: rules`)")


def test_top_level_cpu_checkpointing_is_refused_with_rules_and_auto():
    [f] = _rule_error({"version": 1, "checkpoint": RULES, "cpu_checkpointing": True})
    assert (f.code, f.path, f.hint) == (
        "offload-per-rule", ("cpu_checkpointing",),
        "remove it, and set `cpu_checkpointing: true` in the rules whose modules should offload")
    [f] = _rule_error({"version": 1, "checkpoint": AUTO, "memory_budget": 1, "cpu_checkpointing": True})
    assert (f.code, f.message, f.hint) == (
        "offload-by-plan", "top-level `cpu_checkpointing` does not apply with checkpoint.mode auto: the "
        "plan decides which modules offload", "remove `cpu_checkpointing`")


def test_save_ops_belong_to_a_selective_rule_and_name_its_index():
    rules = {"mode": "rules", "rules": [{"modules": ["B"], "mode": "selective", "save_ops": ["aten.mm"]},
                                        {"modules": ["C"], "save_ops": ["aten.mm"]}]}
    [f] = _rule_error({"version": 1, "checkpoint": rules})
    assert (f.code, f.path, f.message) == (
        "save-ops-need-selective", ("checkpoint", "rules", 1, "save_ops"),
        "`save_ops` names the ops a selective rule saves, but checkpoint.rules.1 has mode full")


def test_engine_knobs_without_an_offloading_rule_warn_and_pin_budget_counts_rule_offload():
    data = {"version": 1, "checkpoint": {"mode": "rules", "rules": [{"modules": ["B"]}], "keep_last": 0,
                                         "max_inflight": 1}, "pin_budget": "1GiB"}
    assert [(f.code, f.path) for f in _finding(data)] == [
        ("unused-setting", ("checkpoint", "keep_last")), ("unused-setting", ("pin_budget",))]
    assert _finding({"version": 1, "checkpoint": {**RULES, "keep_last": 0}, "pin_budget": "1GiB"}) == []
    assert _finding({"version": 1, "checkpoint": AUTO, "memory_budget": 1, "pin_budget": "1GiB"}) == []


@pytest.mark.parametrize(("backend", "code"), [("deepspeed", "torch-only")])
@pytest.mark.parametrize("checkpoint", [RULES, AUTO])
def test_rules_and_auto_are_torch_only(backend, code, checkpoint):
    extra = {"memory_budget": 1} if checkpoint is AUTO else {}
    findings = _rule_error({"version": 1, "backend": backend, "checkpoint": checkpoint, **extra})
    assert findings[0].code == code and findings[0].path == ("checkpoint", "mode")
    assert findings[0].message.startswith(f"checkpoint.mode `{checkpoint['mode']}` is torch-only for now: ")
    assert findings[0].hint == "set `backend: torch`"
    if checkpoint is AUTO:
        assert [(f.code, f.path) for f in findings[1:]] == [("torch-only", ("memory_budget",))]


@pytest.mark.parametrize("checkpoint", [FULL, {"mode": "none"}, {"mode": "selective", "modules": ["Block"]},
                                        {"mode": "external"}])
def test_compile_beside_a_hand_set_mode_is_refused_with_the_fix(checkpoint):
    [f] = _rule_error({"version": 1, "checkpoint": checkpoint, "compile": {"scope": "blocks"}})
    assert f == Finding(
        "compile-without-plan", "error", ("compile",),
        f"`compile` says the plan is profiled and applied under torch.compile, but checkpoint.mode "
        f"is {checkpoint['mode']}: there is no plan to profile",
        "remove `compile` (and compile the model yourself), or write `checkpoint: {mode: auto, "
        "modules: [...]}` with `memory_budget` to plan under compile")


def test_compile_spells_both_scopes_defaults_to_inductor_and_is_torch_only():
    auto = {"version": 1, "checkpoint": AUTO, "memory_budget": 1}
    policy = Policy.model_validate({**auto, "compile": {"scope": "model"}})
    assert (policy.compile.scope, policy.compile.backend) == ("model", "inductor")
    assert Policy.model_validate({"version": 1, "checkpoint": RULES,
                                  "compile": {"scope": "blocks", "backend": "aot_eager"}}).compile.backend == "aot_eager"
    assert Policy.model_validate(auto).compile is None
    for bad in ({"scope": "layers"}, {"scope": True}, {"scope": "blocks", "backend": ""},
                {"scope": "blocks", "fullgraph": True}, True):
        with pytest.raises(ValidationError):
            Policy.model_validate({**auto, "compile": bad})
    findings = _rule_error({**auto, "backend": "deepspeed", "compile": {"scope": "blocks"}})
    assert [(f.code, f.path) for f in findings] == [
        ("torch-only", ("checkpoint", "mode")), ("torch-only", ("memory_budget",)),
        ("torch-only", ("compile", "scope"))]


def test_rules_and_auto_are_refused_for_hf_and_lightning_translation():
    from actcfg.errors import TranslationError
    from actcfg.translators import translate

    policy = Policy.model_validate({"version": 1, "checkpoint": RULES})
    with pytest.raises(TranslationError, match=r"^checkpoint\.mode: the hf backend cannot express this: "
                       r"checkpoint\.mode `rules` is torch-only for now: .*\(got 'rules'\); run the policy "
                       r"with actcfg\.integrations\.hf\.ActivationPolicyCallback, which applies it with torch$"):
        translate(policy, "hf")
    with pytest.raises(TranslationError, match=r"^checkpoint\.mode: the lightning backend cannot express "
                                               r"this: checkpoint\.mode `rules` is torch-only"):
        translate(policy, "lightning")


def test_a_prediction_is_a_positive_time_and_a_size():
    data = {"version": 1, "checkpoint": {**RULES, "predicted": {"step_time_ms": 0, "peak": "1GiB"}}}
    [e] = _errors(data)
    assert (e["type"], e["loc"]) == ("greater_than", ("checkpoint", "rules", "predicted", "step_time_ms"))
    data["checkpoint"]["predicted"] = {"step_time_ms": 12, "peak": "5.5GiB"}
    assert Policy.model_validate(data).checkpoint.predicted.peak == int(5.5 * 2**30)
