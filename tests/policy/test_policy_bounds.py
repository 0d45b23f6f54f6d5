"""Values a policy must refuse, and where it says so (issue 20): a prediction that is not a
finite number, a budget of 0 bytes, an unknown op in a rule located at that rule.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import ROOT

RULES = "version: 1\ncheckpoint:\n  mode: rules\n  rules: [{modules: [Block]}]\n"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN"])
def test_a_prediction_must_be_a_finite_number(run_cli, tmp_path, value):
    path = tmp_path / "plan.yaml"
    path.write_text(RULES + f"  predicted: {{step_time_ms: {value}, peak: 1GiB}}\n")
    result = run_cli("validate", path)
    assert result.code == 1
    shown = {".inf": "inf", "-.inf": "-inf"}.get(value, "nan")
    assert result.out == (
        f"{path}:5:29: error bad-value: `checkpoint.predicted.step_time_ms` is {shown}: it must be "
        "a finite number (write a number of milliseconds, such as 12.5)\n")


@pytest.mark.parametrize("budget", ["0", "0GiB", "0.0 MiB", "00KiB"])
def test_a_budget_of_zero_bytes_is_refused(run_cli, tmp_path, budget):
    path = tmp_path / "auto.yaml"
    path.write_text(f"version: 1\ncheckpoint: {{mode: auto, modules: [Block]}}\nmemory_budget: {budget}\n")
    result = run_cli("validate", path)
    shown = budget if budget == "0" else repr(budget)
    assert (result.code, result.out) == (1, (
        f"{path}:3:16: error bad-value: `memory_budget` is {shown}: a budget of 0 bytes leaves no "
        "room for a training step (give the most GPU memory one training step may allocate, "
        "such as 40GiB)\n"))


@pytest.mark.parametrize(("budget", "valid"), [
    (0, False), ("0", False), ("0GiB", False), ("0.0 MiB", False), (1, True), ("1KiB", True),
    ("0.5GiB", True), ("10", True),
])
def test_the_json_schema_refuses_a_zero_budget_too(budget, valid):
    schema = json.loads((ROOT / "docs" / "actcfg.schema.json").read_text())
    doc = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": budget}
    assert jsonschema.Draft7Validator(schema).is_valid(doc) is valid


def test_pin_budget_may_still_be_zero():
    import actcfg

    policy = actcfg.load({"version": 1, "cpu_checkpointing": True, "pin_budget": 0})
    assert policy.pin_budget == 0  # no pinned memory at all: a meaningful setting, unlike a budget of 0


def test_an_unknown_op_in_a_rule_is_located_at_that_rule():
    # It was reported at `checkpoint.save_ops`, a key the file does not have.
    torch = pytest.importorskip("torch")
    import actcfg
    from actcfg.errors import PolicyApplyError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = {"version": 1, "checkpoint": {"mode": "rules", "rules": [
        {"modules": ["0"], "mode": "full"},
        {"modules": ["1"], "mode": "selective", "save_ops": ["aten.not_an_op"]}]}}
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.rules\.1\.save_ops: 'aten\.not_an_op' "
                                               r"is not an op torch \S+ knows; "):
        actcfg.apply(model, cfg)
    assert "forward" not in model[0].__dict__  # undone
