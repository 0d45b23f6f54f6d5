"""A written plan names exactly the modules it planned, and planning refuses what cannot be
profiled with a sentence (issue 20): module names that are fnmatch patterns (`b[12]`), a
module named like a class, a frozen model, a loss_fn that raises or returns no scalar.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
from torch import nn

import actcfg
from actcfg.errors import PlanError
from actcfg.plan import Plan, exact_pattern
from actcfg.plan import _refuse_inexact  # the check plan_model runs on what it wrote
from actcfg.api import apply

NAMES = ["b[12]", "b1", "b2", "x*", "xy", "x?", "q]", "r[!a]", "ra"]


@pytest.mark.parametrize("name", NAMES)
def test_an_exact_pattern_matches_its_name_and_no_other(name):
    assert fnmatch.fnmatchcase(name, exact_pattern(name))
    assert [n for n in NAMES if fnmatch.fnmatchcase(n, exact_pattern(name))] == [name]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Keyed(nn.Module):
    """Blocks in a ModuleDict under keys that are fnmatch patterns."""

    def __init__(self, keys: list[str], width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({k: Block(width) for k in keys})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


AUTO = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1GiB"}


def test_a_plan_takes_exactly_the_modules_it_names():
    # `b[12]` was written as a pattern: the plan's rule for it took b1 and b2 instead.
    torch.manual_seed(0)
    model = Keyed(NAMES)
    handle = apply(model, AUTO, inputs=torch.randn(8, 64))
    planned = dict(handle.plan.choices)
    assert set(planned) == {f"blocks.{k}" for k in NAMES}
    assert set(handle.ruled) == set(planned)
    for rule in handle.rules:  # each rule took the modules planned with its choice, and no other
        choice = {planned[m] for m in rule.modules}
        assert len(choice) == 1, (rule, planned)
        assert set(rule.modules) == {m for m, c in planned.items() if c in choice}
    written = actcfg.load(handle.plan.policy_yaml)
    assert [list(r.modules) for r in written.checkpoint.rules] == [
        [f"blocks.{exact_pattern(m.removeprefix('blocks.'))}" for m in rule.modules]
        for rule in handle.rules]
    handle.remove()


def test_a_module_named_like_a_class_cannot_be_planned_alone():
    # A rule's pattern matches class names too: `Block` takes every Block, not the one so named.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("Block", Block(8))
    model.add_module("other", Block(8))
    text = ("version: 1\ncheckpoint:\n  mode: rules\n  rules:\n    - {modules: [Block], mode: full}\n"
            "    - {modules: [other], mode: none}\n")
    plan = Plan(("Block", "other"), ("full", "keep"), 1, 1.0, 1, 2**30)
    with pytest.raises(PlanError, match=r"^the plan's rules cannot be applied to this model as written: "
                                        r"checkpoint\.rules\.1: every module its patterns match was "
                                        r"taken by an earlier rule"):
        _refuse_inexact(model, actcfg.load(text), plan)
    text = "version: 1\ncheckpoint:\n  mode: rules\n  rules:\n    - {modules: [Block], mode: full}\n"
    with pytest.raises(PlanError, match=r"^the plan's rules would not take exactly the planned "
                                        r"modules \(they would also take other\): a rule's pattern "
                                        r"matches class names"):
        _refuse_inexact(model, actcfg.load(text), Plan(("Block",), ("full",), 1, 1.0, 1, 2**30))


def test_a_frozen_model_is_a_plan_error():
    model = Keyed(["a", "b"]).requires_grad_(False)
    with pytest.raises(PlanError, match=r"^no parameter of the model requires grad \(a frozen model\)"):
        apply(model, AUTO, inputs=torch.randn(8, 64))
    assert all("forward" not in m.__dict__ for m in model.modules())


def _raises(output):
    raise KeyError("logits")


@pytest.mark.parametrize(("loss_fn", "message"), [
    (_raises, r"^loss_fn raised KeyError: 'logits'; the profile calls it on the model's output and "
              r"needs a scalar tensor back$"),
    (lambda output: output, r"^loss_fn returned a tensor of shape \[8, 64\]: the profile calls "
                            r"backward\(\) on it and needs a scalar tensor"),
    (lambda output: 3.0, r"^loss_fn returned a float: "),
    (lambda output: output.detach().sum(), r"^loss_fn returned a tensor that does not require grad"),
    ("mse", r"^loss_fn= is a str, not a callable"),
])
def test_a_bad_loss_fn_is_a_plan_error(loss_fn, message):
    model = Keyed(["a", "b"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError, match=message):
        apply(model, AUTO, inputs=torch.randn(8, 64), loss_fn=loss_fn)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())
