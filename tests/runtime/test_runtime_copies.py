"""Copies of an applied model, and the offload step around the root (issue 20).

A deep copy carries the policy and has no handle; `strip_policy` takes it off (before, the
copy's apply() and torch.save asked for a remove() on a handle that had already run). A rule
that offloads the root opens one offload step per forward, and warns with the right reason.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from actcfg.errors import ActcfgError, PolicyApplyError
from actcfg.runtime.offload import OffloadWarning, host_loopback
from actcfg import apply, strip_policy
from _helpers import offload_blocks, train_step


@pytest.fixture
def loopback():
    with host_loopback():
        yield


def carried(model: nn.Module) -> list[str]:
    """What actcfg left on the model's modules: instance forwards, markers, hooks."""
    out = []
    for name, module in model.named_modules():
        out += [f"{name}:{k}" for k in module.__dict__ if k == "forward" or k.startswith("_actcfg")]
        out += [f"{name}:hook" for _ in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]]
    return out


POLICIES = {
    "full": {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}},
    "offload": {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True},
    "rules": {"version": 1, "checkpoint": {"mode": "rules", "rules": [
        {"modules": ["blocks.0"], "mode": "none", "cpu_checkpointing": True},
        {"modules": ["Block"], "mode": "selective"}]}},
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_copy_whose_original_was_removed_can_be_stripped(loopback, name):
    model, x = offload_blocks()
    plain = copy.deepcopy(model)
    handle = apply(model, POLICIES[name])
    twin = copy.deepcopy(model)
    assert carried(twin)  # a copy carries the policy, as copies of checkpoint_wrapper do
    handle.remove()
    assert carried(model) == []
    with pytest.raises(PolicyApplyError, match=r"strip_policy\(copy\) takes it off\)$"):
        apply(twin, POLICIES["full"])
    with pytest.raises(ActcfgError, match=r"actcfg\.strip_policy\(copy\)\)$"):
        torch.save(twin, io.BytesIO())
    assert strip_policy(twin) > 0
    assert carried(twin) == [] and strip_policy(twin) == 0
    torch.save(twin, io.BytesIO())  # plain again: saved whole, applied again
    want = train_step(plain, x)
    for n, g in train_step(twin, x).items():
        assert torch.equal(g, want[n]), n
    with apply(twin, POLICIES["full"]) as again:
        train_step(twin, x)
        assert again.counters.recomputes == 3


def test_a_model_whose_handle_is_live_is_not_stripped():
    model, _ = offload_blocks()
    handle = apply(model, POLICIES["full"])
    before = carried(model)
    for target in (model, model.blocks[1]):
        with pytest.raises(PolicyApplyError, match=r"^this model's actcfg policy is held by a live "
                                                   r"handle \(the one apply\(\) returned\): call remove\(\) on it"):
            strip_policy(target)
    assert carried(model) == before
    twin = copy.deepcopy(model)
    assert strip_policy(twin) > 0 and carried(model) == before  # the copy's edits only
    handle.remove()


def test_stripping_a_copy_leaves_the_live_original_offloading(loopback):
    model, x = offload_blocks()
    handle = apply(model, POLICIES["offload"])
    handle.engine.min_offload_bytes = 1 << 14
    strip_policy(copy.deepcopy(model))
    train_step(model, x)
    # block 1's input; block 0's is x, the caller's batch (its owner holds it), and block 2's is
    # the last group, kept on the device
    assert handle.engine.stats.steps == 1 and handle.engine.stats.offloaded_bytes == x.nbytes
    handle.remove()


@pytest.mark.parametrize(("ckpt", "why"), [
    ({"mode": "rules", "rules": [{"modules": ["BlockStack"], "mode": "none", "cpu_checkpointing": True}]},
     "were saved in the last group, which stays on the GPU for backward"),
    # checkpointed, the root saves only its input: x, the caller's batch, which stays by rule
    ({"mode": "rules", "rules": [{"modules": ["BlockStack"], "mode": "full", "cpu_checkpointing": True}]},
     "every large saved tensor stays in place by rule (65.5 kB as input)"),
])
def test_an_offload_rule_on_the_root_opens_one_step_and_says_why_nothing_moved(loopback, ckpt, why):
    # The root's pre-hook opened a step, its forward closed it (empty: "no saved activation
    # reached the offload hooks") and opened a second one.
    model, x = offload_blocks()
    plain = copy.deepcopy(model)
    handle = apply(model, {"version": 1, "checkpoint": ckpt})
    handle.engine.min_offload_bytes = 1 << 14
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_step(model, x)
    assert handle.engine.stats.steps == 1
    assert [g["module"] for g in handle.offload_groups()] == [""]
    messages = [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]
    assert len(messages) == 1
    assert why in messages[0]
    want = train_step(plain, x)
    for n, g in got.items():
        assert torch.equal(g, want[n]), n
    handle.remove()
