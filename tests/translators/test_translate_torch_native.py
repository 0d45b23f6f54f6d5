"""actcfg.translators.torch_native: the WrapPlan, bound against the real torch APIs."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json

import pytest

from actcfg.backends.table import Key, Meta, RoutedBy, Unsupported
from actcfg.backends.torch import TABLE
from actcfg.errors import TranslationError
from actcfg.policy.schema import DEFAULT_SAVE_OPS, Policy, policy_field_paths
from actcfg.translators import translate
from actcfg.translators.torch_native import (
    CHECKPOINT_API,
    OFFLOAD_ENGINE,
    CheckpointPlan,
    ExternalCheckpointPlan,
    OffloadPlan,
    PlanRequest,
    RulesPlan,
    WrapPlan,
    to_torch_native,
)

try:
    from tests._translate_cases import CASES, case_policies, check_golden, golden_names, orphan_goldens
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _translate_cases import CASES, case_policies, check_golden, golden_names, orphan_goldens


def _plans() -> dict[str, WrapPlan]:
    out = {}
    for name, policy in case_policies().items():
        try:
            out[name] = to_torch_native(policy)
        except TranslationError:
            continue
    return out


PLANS = _plans()


def _all_checkpoint_plans() -> dict[str, CheckpointPlan]:
    """Every checkpoint the cases and configs/ files run through: their torch plan's, and each
    checkpointing rule's (`<name>/rule-<i>`)."""
    out: dict[str, CheckpointPlan] = {}
    for name, policy in golden_names().items():
        try:
            plan = to_torch_native(policy)
        except TranslationError:
            continue
        if isinstance(plan.checkpoint, CheckpointPlan):
            out[name] = plan.checkpoint
        elif isinstance(plan.checkpoint, RulesPlan):
            for i, rule in enumerate(plan.checkpoint.rules):
                if rule.checkpoint_plan() is not None:
                    out[f"{name}/rule-{i}"] = rule.checkpoint_plan()
    return out


CKPT_PLANS = _all_checkpoint_plans()


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- the table --------------------------------------------------------------------------


def test_table_covers_every_schema_field() -> None:
    paths = policy_field_paths()
    assert [p for p in paths if p not in TABLE] == []
    assert [p for p in TABLE if p not in paths] == []
    assert all(isinstance(e, (Key, RoutedBy, Unsupported, Meta)) for e in TABLE.values())


def test_plan_is_plain_frozen_data() -> None:
    plan = PLANS["torch-full-offload"]
    assert plan == WrapPlan(
        checkpoint=CheckpointPlan(modules=("Block",), every=1, use_reentrant=False,
                                  preserve_rng_state=True, selective_save_ops=None,
                                  api=CHECKPOINT_API),
        offload=OffloadPlan(scope="checkpoint_inputs", pin=True, pin_budget=16 * 2**30),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.offload = None  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(CheckpointPlan)] == [
        "modules", "every", "use_reentrant", "preserve_rng_state", "selective_save_ops", "api"]


def test_to_json_order_and_roundtrip() -> None:
    out = PLANS["torch-selective-mm"].to_json()
    assert json.loads(json.dumps(out)) == out
    assert out == {
        "checkpoint": {"api": CHECKPOINT_API, "modules": ["*"], "every": 3,
                       "use_reentrant": False, "preserve_rng_state": True,
                       "selective_save_ops": ["aten.mm", "aten.addmm"]},
        "offload": None,
    }
    assert translate(case_policies()["torch-selective-mm"]) == out


@pytest.mark.parametrize(("name", "expected"), [
    ("empty-torch", (None, None)),
    ("torch-full", ((CHECKPOINT_API, False, None), None)),
    ("torch-reentrant", ((CHECKPOINT_API, True, None), None)),
    ("torch-reentrant-false", ((CHECKPOINT_API, False, None), None)),
    ("torch-selective", ((CHECKPOINT_API, False, DEFAULT_SAVE_OPS), None)),
    ("torch-offload-all", (None, ("all_saved", False, None))),
    ("torch-full-offload", ((CHECKPOINT_API, False, None), ("checkpoint_inputs", True, 2**34))),
    # pin_budget without cpu_checkpointing: the schema warns; nothing is offloaded.
    ("torch-pin-budget-unused", ((CHECKPOINT_API, False, None), None)),
    ("ds-cpu", ((CHECKPOINT_API, False, None), ("checkpoint_inputs", True, None))),
])
def test_plan_fields(name: str, expected) -> None:
    plan = PLANS[name]
    ck = plan.checkpoint and (plan.checkpoint.api, plan.checkpoint.use_reentrant,
                              plan.checkpoint.selective_save_ops)
    off = plan.offload and (plan.offload.scope, plan.offload.pin, plan.offload.pin_budget)
    assert (ck, off) == expected


# --- what torch cannot express --------------------------------------------------------------

_BLOCK = {"mode": "full", "modules": ["B"]}


@pytest.mark.parametrize(("data", "field", "reason"), [
    ({"partition": True}, "partition",
     "`partition` is DeepSpeed-only (DeepSpeed's partition_activations; torch's analogue is "
     "tensor-parallel input_reshard) (got True); set `backend: deepspeed`, or remove `partition`"),
    ({"partition": True, "contiguous": True, "num_checkpoints": 2}, "partition", None),
    ({"num_checkpoints": 4}, "num_checkpoints",
     "`num_checkpoints` is DeepSpeed-only (DeepSpeed's number_checkpoints) (got 4); set "
     "`backend: deepspeed`, or remove `num_checkpoints`"),
    ({"synchronize": True}, "synchronize", None),
    ({"profile": True}, "profile",
     "`profile` is DeepSpeed-only (DeepSpeed's checkpoint profiling) (got True); set "
     "`backend: deepspeed`, or remove `profile`"),
])
def test_refuses_deepspeed_only_settings(data, field, reason) -> None:
    policy = Policy.model_validate({"version": 1, "backend": "deepspeed", "checkpoint": _BLOCK,
                                    **data})
    with pytest.raises(TranslationError) as info:
        to_torch_native(policy)
    assert (info.value.field, info.value.backend) == (field, "torch")
    if reason is not None:
        assert str(info.value) == f"{field}: the torch backend cannot express this: {reason}"


def test_contiguous_alone_is_named() -> None:
    """Bypassing validation: each DeepSpeed-only field is checked on its own."""
    base = Policy.model_validate({"version": 1, "checkpoint": _BLOCK})
    policy = Policy.model_construct(**{**base.__dict__, "contiguous": True})
    with pytest.raises(TranslationError, match=r"^contiguous: the torch backend cannot express"):
        to_torch_native(policy)


def test_external_checkpointing_wraps_nothing_and_offloads_what_the_model_keeps() -> None:
    policy = Policy.model_validate({"version": 1, "checkpoint": {"mode": "external"},
                                    "cpu_checkpointing": True})
    plan = to_torch_native(policy)
    assert plan == WrapPlan(checkpoint=ExternalCheckpointPlan(),
                            offload=OffloadPlan(scope="all_saved", pin=True, pin_budget=None))
    assert plan.to_json() == {
        "checkpoint": {"api": None, "by": "the model"},
        "offload": {"engine": OFFLOAD_ENGINE, "scope": "all_saved", "pin": True, "pin_budget": None,
                    "pin_budget_per_node": None,
                    "keep_last": 1, "max_inflight": 1},
    }


def test_rules_become_one_plan_per_rule_in_order() -> None:
    plan = PLANS["torch-rules-offload"]
    assert isinstance(plan.checkpoint, RulesPlan)
    assert [(r.modules, r.checkpoint, r.offload, r.api, r.selective_save_ops)
            for r in plan.checkpoint.rules] == [
        (("blocks.0",), "none", False, None, None),
        (("blocks.1", "blocks.2"), "none", True, None, None),
        (("blocks.3",), "full", True, CHECKPOINT_API, None),
        (("Block",), "selective", False, CHECKPOINT_API, ("aten.mm",)),
    ]
    assert (plan.checkpoint.predicted_step_time_ms, plan.checkpoint.predicted_peak) == (91.5, 5632 * 2**20)
    assert plan.offload == OffloadPlan(scope="rules", pin=False, pin_budget=None, keep_last=0,
                                       max_inflight=2)
    assert plan.checkpoint.rules[3].checkpoint_plan() == CheckpointPlan(
        modules=("Block",), every=1, use_reentrant=False, selective_save_ops=("aten.mm",))
    # selective without save_ops: the schema's default list, as `checkpoint.save_ops`
    [rule] = to_torch_native(Policy.model_validate(
        {"version": 1, "checkpoint": {"mode": "rules", "rules": [{"modules": ["B"], "mode": "selective"}]}}
    )).checkpoint.rules
    assert rule.selective_save_ops == DEFAULT_SAVE_OPS


def test_rules_that_never_offload_need_no_engine_and_auto_is_a_plan_request() -> None:
    assert PLANS["torch-rules-no-offload"].offload is None
    plan = PLANS["torch-auto"]
    assert plan == WrapPlan(checkpoint=PlanRequest(modules=("Block",), memory_budget=6 * 2**30), offload=None)
    assert plan.to_json() == {"checkpoint": {"planner": "actcfg.plan", "modules": ["Block"],
                                             "memory_budget": 6 * 2**30, "submodules": "none"},
                              "offload": None}
    parts = to_torch_native(Policy.model_validate(
        {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"], "submodules": ["mlp", "attn"]},
         "memory_budget": "1GiB"})).checkpoint
    assert parts.submodules == ("mlp", "attn") and parts.to_json()["submodules"] == ["mlp", "attn"]


# --- goldens -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(golden_names()))
def test_golden(name: str) -> None:
    check_golden(name, golden_names()[name], "torch")


def test_no_orphan_goldens() -> None:
    assert orphan_goldens("torch") == []


# --- bound against the real torch -----------------------------------------------------------

torch = pytest.importorskip("torch")


def test_api_names_resolve() -> None:
    from actcfg.runtime.offload import OffloadEngine

    assert _resolve(CHECKPOINT_API) is torch.utils.checkpoint.checkpoint
    assert _resolve(OFFLOAD_ENGINE) is OffloadEngine


def _toy() -> torch.nn.Module:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.w) @ self.w

    torch.manual_seed(0)
    return Block()


def _grads(fn, block, x0) -> list[torch.Tensor]:
    block.zero_grad()
    x0.grad = None
    fn(x0 * 1.0).sum().backward()
    return [block.w.grad.clone(), x0.grad.clone()]


def _sac_context(ops: tuple[str, ...]):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    overloads = []
    for name in ops:
        ns, op = name.split(".", 1)
        packet = getattr(getattr(torch.ops, ns), op)
        assert isinstance(packet, torch._ops.OpOverloadPacket), name
        overloads += [getattr(packet, o) for o in packet.overloads()]
    return functools.partial(create_selective_checkpoint_contexts, overloads)


@pytest.mark.parametrize("name", sorted(CKPT_PLANS))
def test_plan_runs_through_its_torch_api(name: str) -> None:
    """Call the named API with exactly the plan's kwargs on a toy block: it accepts them and
    the gradients equal the plain run's."""
    plan = CKPT_PLANS[name]
    api = _resolve(plan.api)
    kwargs = plan.kwargs()
    if plan.selective_save_ops is not None:
        kwargs["context_fn"] = _sac_context(plan.selective_save_ops)
    block = _toy()
    x0 = torch.randn(4, 16, requires_grad=True)
    plain = _grads(block, block, x0)
    inspect.signature(api).bind(block, x0, **kwargs)
    got = _grads(lambda x: api(block, x, **kwargs), block, x0)
    for g, want in zip(got, plain):
        torch.testing.assert_close(g, want)


@pytest.mark.parametrize("name", sorted(DEFAULT_SAVE_OPS))
def test_default_save_ops_are_real_ops(name: str) -> None:
    ns, op = name.split(".", 1)
    assert isinstance(getattr(getattr(torch.ops, ns), op), torch._ops.OpOverloadPacket)


def _mm_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_flop_counts()["Global"][torch.ops.aten.mm]


def test_selective_plan_saves_mm_full_plan_recomputes_it() -> None:
    """The SAC context built from `selective_save_ops` keeps matmuls out of recomputation:
    mm FLOPs equal the plain run's, while full checkpointing recomputes one."""
    x0 = torch.randn(4, 16, requires_grad=True)

    def run(plan: CheckpointPlan | None) -> int:
        block = _toy()
        if plan is not None:
            kwargs = plan.kwargs()
            if plan.selective_save_ops is not None:
                kwargs["context_fn"] = _sac_context(plan.selective_save_ops)
            api = _resolve(plan.api)
            return _mm_flops(lambda: api(block, x0 * 1.0, **kwargs).sum().backward())
        return _mm_flops(lambda: block(x0 * 1.0).sum().backward())

    plain = run(None)
    full = run(PLANS["torch-full"].checkpoint)
    selective = run(PLANS["torch-selective"].checkpoint)
    # Full recomputes the first matmul; early_stop skips the last, whose output backward
    # does not need.
    assert full == plain + 2 * 4 * 16 * 16
    assert selective == plain


def test_offload_plan_binds_the_engine() -> None:
    from actcfg.runtime.offload import OffloadEngine

    plan = PLANS["torch-offload-all"].offload
    bound = inspect.signature(OffloadEngine).bind(pin=plan.pin, pin_budget=plan.pin_budget)
    assert bound.arguments == {"pin": False, "pin_budget": None}


def test_compile_is_in_the_plan_translate_prints_and_absent_without_it():
    """`compile:` travels in the WrapPlan (what apply's compile step reads), printed only where
    the policy compiles, so the goldens of every other policy stay as they were."""
    rules = {"mode": "rules", "rules": [{"modules": ["Block"]}]}
    plan = to_torch_native(Policy.model_validate(
        {"version": 1, "checkpoint": rules, "compile": {"scope": "model", "backend": "aot_eager"}}))
    assert plan.to_json()["compile"] == {"api": "torch.compile", "scope": "model", "backend": "aot_eager"}
    auto = to_torch_native(Policy.model_validate(
        {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": 1,
         "compile": {"scope": "blocks"}}))
    assert auto.to_json()["compile"] == {"api": "torch.compile", "scope": "blocks", "backend": "inductor"}
    assert "compile" not in to_torch_native(Policy.model_validate({"version": 1, "checkpoint": rules})).to_json()
