"""`checkpoint.mode: auto` on a model sharded with FSDP2, profiled as it trains (actcfg.plan.sharded).

On the CPU, nothing mocked: FSDP2 on the session's one-rank gloo group (started once, by
DeepSpeed, as tests/runtime/test_composition.py does), and two gloo ranks in fresh processes. The
plan fits its budget as the CPU meter counts it (gathered parameters included), planning leaves
the sharded parameters, gradients, optimizer state and RNG state exactly as they were, and the
steps after it equal those of a run given the written plan. Two ranks apply one plan, and a rank
that fails makes the other fail with its sentence. Under the DeepSpeed engine (ZeRO-1, ZeRO-2
and the bf16 optimizer) `engine.module` plans without any DeepSpeed hook seeing the profile,
trains as the written plan (on one rank and on two), and the engine's own step fits the budget
with DeepSpeed's buckets counted. ZeRO-3 on the one rank plans through its own module hooks
(every gather a view of the whole partition), leaves its hooks' state and everything the engine
reads as it was, reads the engine's own plain and full steps (its gradient hooks followed) and
plans between them, its steps at the prediction; its leaf modules, DDP and the engine object are
refused.

The `cuda` tests are the one-rank NCCL cases (an H200), FSDP2 and ZeRO-3:

    python3 -m pytest -m cuda -q "tests/plan/test_plan_sharded.py::test_gpu_fsdp2_one_rank_nccl_plan_fits_its_budget_with_the_written_plans_gradients"
    python3 -m pytest -m cuda -q -s "tests/plan/test_plan_sharded.py::test_gpu_zero3_one_rank_nccl_plan_holds_its_prediction_and_trains_as_the_written_plan"
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import actcfg
from actcfg.errors import PlanError
from actcfg.plan.probe import LiveBytes
from actcfg.plan.profile import measure_steps

try:
    from tests._deepspeed_env import ds_env
    from tests._helpers import grads_of, offload_blocks
    from tests._multirank import WORLD, finish, gloo_or_skip, init_group, run_ranks, write_result
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env
    from _helpers import grads_of, offload_blocks
    from _multirank import WORLD, finish, gloo_or_skip, init_group, run_ranks, write_result

__all__ = ["ds_env"]

FULL = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
STEPS = 2


@contextlib.contextmanager
def grad_hooks_fired(params: Any) -> Iterator[list[Any]]:
    """The parameters whose post-accumulate-grad hooks fire inside (DeepSpeed registers its
    ZeRO gradient hooks the same way): a profile's backward must fire none."""
    fired: list[Any] = []
    watch = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in params]
    try:
        yield fired
    finally:
        for h in watch:
            h.remove()


def auto(budget: int) -> dict[str, Any]:
    return {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": budget}


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def halfway_budget(make: Any) -> int:
    """Halfway between the peaks of checkpointing every block and of the plain model, both
    sharded, as `measure_steps` reads them (the planner's own meter)."""
    model, x = make()
    _, plain = measure_steps(model, x, steps=1)
    handle = actcfg.apply(model, FULL)
    _, full = measure_steps(model, x, steps=1)
    handle.remove()
    assert full < plain
    return (full + plain) // 2


def full_tensors(tensors: Any) -> list[torch.Tensor]:
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for t in tensors]


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.full_tensor() if hasattr(v, "full_tensor") else torch.as_tensor(v)
            for state in optimizer.state.values() for v in state.values()]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    """`steps` optimizer steps of the mean of squares (dropout off: the RNG is still drawn from
    by the plan's recompute, which checks it); the gradients of the last."""
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
    return grads_of(model)


# --- one rank: gloo on the CPU ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(ds_env):
    """A one-rank CPU DeviceMesh on the session's gloo group (started once, by DeepSpeed)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


@pytest.mark.slow
def test_the_cpu_meter_counts_a_gathered_parameter_while_fsdp2_holds_it(mesh):
    model, x = offload_blocks(2)
    shard(model, mesh)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    live = LiveBytes()
    live.start()
    with torch.no_grad():
        y = model(x)
    live.stop()
    live._sweep()
    # Each unit's parameters were gathered (counted) and freed after its forward (resized to 0 in
    # place, a storage that still exists): only the output is left.
    assert live.peak >= block_bytes + y.nbytes
    assert live.now == y.nbytes


@pytest.mark.slow
def test_fsdp2_plan_fits_its_budget_and_changes_nothing_the_run_sees(mesh):
    def make() -> tuple[nn.Module, torch.Tensor]:
        model, x = offload_blocks(4)
        return shard(model, mesh), x

    budget = halfway_budget(make)
    # A run trained a step before planning: gradients and Adam's state exist, and must stay.
    model, x = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, x, 1)
    before = (full_tensors(model.parameters()), full_tensors(p.grad for p in model.parameters()),
              optimizer_state(optimizer), torch.get_rng_state())
    handle = actcfg.apply(model, auto(budget), inputs=x)
    after = (full_tensors(model.parameters()), full_tensors(p.grad for p in model.parameters()),
             optimizer_state(optimizer), torch.get_rng_state())
    for was, now in zip(before[:3], after[:3]):
        assert len(was) == len(now) > 0
        for a, b in zip(was, now):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert torch.equal(before[3], after[3])
    assert handle.plan is not None and handle.plan.predicted_peak <= budget
    choices = dict(handle.plan.choices)
    assert set(choices) == {f"blocks.{i}" for i in range(4)}
    assert set(choices.values()) != {"keep"}  # the budget is below plain: something recomputes
    planned = train(model, optimizer, x, STEPS)

    # The same run given the written plan from the start.
    again, _ = make()
    optimizer_again = torch.optim.AdamW(again.parameters(), lr=1e-3)
    train(again, optimizer_again, x, 1)
    given = actcfg.apply(again, handle.plan.policy_yaml)
    written = train(again, optimizer_again, x, STEPS)
    assert planned.keys() == written.keys()
    for name in planned:
        torch.testing.assert_close(planned[name], written[name], rtol=0, atol=0, msg=name)
    for p, q in zip(full_tensors(model.parameters()), full_tensors(again.parameters())):
        torch.testing.assert_close(p, q, rtol=0, atol=0)

    # The plan holds its budget on the sharded model, as the planner's meter counts it.
    handle.remove()
    given.remove()
    fresh, x = make()
    applied = actcfg.apply(fresh, handle.plan.policy_yaml)
    _, peak = measure_steps(fresh, x, steps=1)
    applied.remove()
    assert 0 < peak <= budget


@pytest.mark.slow
def test_ddp_is_refused_naming_its_reducer(mesh):
    model, x = offload_blocks(1)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(PlanError, match=r"^`checkpoint.mode: auto` profiles training steps on the "
                       r"model as given, and the model is wrapped in DistributedDataParallel, "
                       r"whose reducer all-reduces"):
        actcfg.apply(ddp, auto(1 << 20), inputs=x)
    assert all(p.grad is None for p in model.parameters())


def engine_of(stage: int, extra: dict[str, Any] | None = None, **zero: Any) -> tuple[Any, torch.Tensor]:
    import deepspeed

    model, x = offload_blocks(2)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, **zero},
              **(extra or {})}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    dtype = next(engine.module.parameters()).dtype  # bf16 under `bf16: {enabled: true}`
    return engine, x.to(dtype)


def engine_losses(engine: Any, x: torch.Tensor, steps: int = 3) -> list[float]:
    out = []
    for _ in range(steps):
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def engine_state(engine: Any) -> list[torch.Tensor]:
    """Everything of the engine's a step reads or writes that a test can reach: the module's
    weights, the fp32 partitions ZeRO steps, Adam's state and the partitioned gradients."""
    optimizer = engine.optimizer
    out = [p.detach().clone() for p in engine.module.parameters()]
    # ZeRO-1/2's fp32 partitions, or the bf16 optimizer's, and its fp32 gradients
    out += [t.detach().clone() for t in getattr(optimizer, "single_partition_of_fp32_groups", [])]
    out += [t.detach().clone() for t in getattr(optimizer, "fp32_groups_flat_partition", [])]
    out += [t.detach().clone() for t in getattr(optimizer, "fp32_groups_gradients_flat", [])]
    out += [torch.as_tensor(v).clone() for state in optimizer.optimizer.state.values()
            for v in state.values()]
    for grads in getattr(optimizer, "averaged_gradients", {}).values():
        out += [g.detach().clone() for g in grads or []]
    return out


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_deepspeed_engine_object_is_refused_naming_engine_module(ds_env, monkeypatch, stage):
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)  # ZeRO-3's
    engine, x = engine_of(stage)
    with pytest.raises(PlanError, match=r"the model is the DeepSpeed engine itself, whose module "
                       r"names carry its `module.` prefix .*: pass engine.module, which plans "
                       r"under ZeRO stages 0, 1 and 2, and 3 on one rank$"):
        actcfg.apply(engine, auto(1 << 20), inputs=x)
    assert all(p.grad is None for p in engine.module.parameters())
    engine.destroy()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_without_zero_plans_engine_module_and_trains_as_the_written_plan(ds_env):
    engine, x = engine_of(0)
    engine_losses(engine, x)  # a step before planning: Adam's state and the engine's counters exist
    handle = actcfg.apply(engine.module, auto(halfway_budget(lambda: offload_blocks(2))), inputs=x)
    assert set(dict(handle.plan.choices).values()) != {"keep"}
    planned = engine_losses(engine, x)
    again, _ = engine_of(0)
    engine_losses(again, x)
    actcfg.apply(again.module, handle.plan.policy_yaml)
    assert planned == engine_losses(again, x)
    assert engine.global_steps == again.global_steps == 6


BUCKET = 50_000
"""A reduce bucket (elements) of 200 KB in fp32: DeepSpeed's default, 5e8, allocates 2 GB a
step, which would make every budget in these tests DeepSpeed's bucket."""


BF16_OPTIMIZER = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
"""ZeRO-1 with bf16 weights and fp32 gradient accumulation: DeepSpeed 0.19 trains it with its
bf16 optimizer (BF16_Optimizer) rather than ZeRO's."""

ENGINES = {
    "zero1": (1, None),
    "zero2": (2, None),
    # with immediate_grad_update its hooks add each gradient to its fp32 gradients as backward
    # produces it; without, it leaves them in .grad until engine.backward's epilogue
    "bf16_optimizer_immediate": (1, {**BF16_OPTIMIZER, "bf16": {"enabled": True, "immediate_grad_update": True}}),
    "bf16_optimizer": (1, BF16_OPTIMIZER),
}


@pytest.mark.deepspeed
def test_a_gradient_hook_holding_deepspeeds_optimizer_but_not_its_own_is_refused(ds_env):
    """The bf16 optimizer without immediate_grad_update hooks nothing, so the profile's backward
    is a plain one, which fires every hook on the parameters. A user's hook is harmless there;
    one that holds DeepSpeed's optimizer (its hook wrapped elsewhere, or a DeepSpeed that
    registers it otherwise) might reduce the profile's gradients into the run: refused before
    any step, the parameters' gradients untouched."""
    engine, x = engine_of(1, BF16_OPTIMIZER)
    module, optimizer = engine.module, engine.optimizer
    assert type(optimizer).__name__ == "BF16_Optimizer"
    param = next(module.parameters())

    def wrapped(p):  # as a wrapper of DeepSpeed's hook would: it holds the optimizer
        return optimizer

    harmless = param.register_post_accumulate_grad_hook(lambda p: None)
    handle = param.register_post_accumulate_grad_hook(wrapped)
    try:
        with pytest.raises(PlanError, match=r"holds a DeepSpeed object .* not DeepSpeed 0\.19's own"):
            actcfg.apply(module, auto(1 << 20), inputs=x)
    finally:
        handle.remove()
    assert all(p.grad is None for p in module.parameters())
    from actcfg.plan.sharded import deepspeed_backward

    assert deepspeed_backward(module).apart == ()  # the user's hook alone: a plain backward
    harmless.remove()


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_zero_plans_engine_module_changes_nothing_the_run_sees_and_trains_as_the_written_plan(ds_env, engine_kind):
    from actcfg.plan.sharded import deepspeed_backward

    stage, extra = ENGINES[engine_kind]
    engine, x = engine_of(stage, extra, reduce_bucket_size=BUCKET)
    wanted = {"zero1": "DeepSpeedZeroOptimizer", "zero2": "DeepSpeedZeroOptimizer"}.get(engine_kind, "BF16_Optimizer")
    assert type(engine.optimizer).__name__ == wanted
    module = engine.module
    # The budget as the planner's meter reads engine.module under this engine: halfway between
    # checkpointing every block and plain, each with DeepSpeed's step buffers stood in for.
    budget = halfway_budget(lambda: (module, x))
    engine_losses(engine, x, 1)  # a step before planning: Adam's state, partitions, counters
    optimizer = engine.optimizer
    counters = lambda: (engine.global_steps, engine.micro_steps, getattr(optimizer, "micro_step_id", None),
                        getattr(optimizer, "ready_for_gradients", None),
                        optimizer._backward_hook_state.backward_active_depth)
    before, counted, rng = engine_state(engine), counters(), torch.get_rng_state()
    with grad_hooks_fired(module.parameters()) as fired:
        handle = actcfg.apply(module, auto(budget), inputs=x)
    taken = deepspeed_backward(module)
    # No gradient hook saw the profile's backward passes (DeepSpeed's are registered the same
    # way as `watch`), and nothing the engine's next step reads moved. The bf16 optimizer
    # without immediate_grad_update hooks nothing: a plain backward, which `watch` sees.
    assert (fired == []) == bool(taken.apart) == (engine_kind != "bf16_optimizer")
    assert counters() == counted
    assert torch.equal(torch.get_rng_state(), rng)
    after = engine_state(engine)
    # the weights, the fp32 partition, Adam's step, exp_avg and exp_avg_sq of it
    assert len(after) == len(before) >= len(list(module.parameters())) + 4
    for was, now in zip(before, after):
        torch.testing.assert_close(now, was, rtol=0, atol=0)
    assert all(p.grad is None for p in module.parameters())
    if engine_kind.startswith("zero"):
        assert taken.buffers >= BUCKET * 4  # the stand-in for ZeRO's bucket was there
    else:  # the bf16 optimizer's fp32 gradients exist before any step: nothing stands in
        assert taken.buffers == 0
        assert bool(taken.apart) == (engine_kind == "bf16_optimizer_immediate")
    assert handle.plan.predicted_peak <= budget
    assert set(dict(handle.plan.choices).values()) != {"keep"}
    planned = engine_losses(engine, x)
    planned_state = engine_state(engine)

    # The same run given the written plan from the start.
    again, _ = engine_of(stage, extra, reduce_bucket_size=BUCKET)
    engine_losses(again, x, 1)
    given = actcfg.apply(again.module, handle.plan.policy_yaml)
    assert planned == engine_losses(again, x)
    for p, q in zip(planned_state, engine_state(again)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert engine.global_steps == again.global_steps == 4
    handle.remove()
    given.remove()
    engine.destroy()
    again.destroy()


class Reentrant(nn.Module):
    """A block checkpointed reentrantly by the model itself."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero_refuses_a_model_that_checkpoints_reentrantly_and_leaves_no_gradient(ds_env):
    import deepspeed

    stack, x = offload_blocks(2)
    # A parameter before the blocks: its gradient is reached only through the reentrant
    # checkpoints' backward (whose own inputs are their tensor arguments, not the weights).
    model = nn.Sequential(nn.Linear(64, 64), *(Reentrant(b) for b in stack.blocks))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
    with grad_hooks_fired(model.parameters()) as fired:
        with pytest.raises(PlanError, match=r"^the model checkpoints reentrantly \(torch.utils.checkpoint "
                           r"with use_reentrant=True, .*\), and under the DeepSpeed engine the profile's "
                           r"backward takes the gradients with torch.autograd.grad, which a reentrant "
                           r"checkpoint refuses; turn that checkpointing off \(the plan "
                           r"checkpoints what it needs\) or make it non-reentrant$"):
            actcfg.apply(engine.module, auto(1 << 30), inputs=x)
    assert fired == []  # the reentrant block's inner backward never ran
    assert all(p.grad is None for p in model.parameters())
    assert engine_losses(engine, x, 1)  # the engine still trains
    engine.destroy()


ZERO3 = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": BUCKET}
"""ZeRO-3 with every parameter partitioned (by default one under 1e5 elements, every one of
these blocks', stays gathered for good) and the reduce bucket of the ZeRO-1/2 tests."""


def zero3_state(engine: Any) -> list[torch.Tensor]:
    """What a ZeRO-3 step reads or writes: each parameter's partition (its weights: outside a
    module's forward `param.data` is empty), the fp32 partitions it steps, the flat buffer of
    gradient partitions and Adam's state."""
    optimizer = engine.optimizer
    out = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
    out += [t.detach().clone() for t in optimizer.fp32_partitioned_groups_flat]
    out.append(optimizer.grad_partitions_flat_buffer.detach().clone())
    out += [torch.as_tensor(v).clone() for state in optimizer.optimizer.state.values()
            for v in state.values()]
    return out


def mean_of_squares(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()  # `measured_steps`' loss


def measured_steps(engine: Any, x: torch.Tensor, steps: int) -> tuple[list[float], list[int]]:
    """The engine's own steps (engine(x), engine.backward, engine.step): losses, and each
    step's peak above its start as the planner's CPU meter counts it."""
    losses, peaks = [], []
    for _ in range(steps):
        live = LiveBytes()
        live.start()
        loss = engine(x).square().mean()
        engine.backward(loss)
        live.stop()
        engine.step()
        losses.append(loss.item())
        peaks.append(live.peak)
    return losses, peaks


ZERO3_PERSISTENT = {"reduce_bucket_size": BUCKET}
"""ZeRO-3 at its default persistence threshold: every parameter of these blocks (each under 1e5
elements) stays gathered once a trace completed (its second step)."""


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("zero, steps_before", [(ZERO3, 1), (ZERO3_PERSISTENT, 2)],
                         ids=["partitioned", "persistent"])
def test_zero3_on_one_rank_plans_engine_module_changes_nothing_and_trains_as_the_written_plan(
        ds_env, monkeypatch, zero, steps_before):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from actcfg.plan.sharded import Zero3Gradients, deepspeed_backward, zero3_profiling

    # ZeRO-3 replaces torch.nn.functional.linear process-wide and never puts it back.
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    engine, x = engine_of(3, **zero)
    module = engine.module
    optimizer = engine.optimizer
    assert type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
    with zero3_profiling(module):  # the planner's meter on engine.module, as the profile runs it
        budget = halfway_budget(lambda: (module, x))
    # steps before planning: Adam's state, partitions, counters (and a complete trace)
    engine_losses(engine, x, steps_before)
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    counters = lambda: (engine.global_steps, engine.micro_steps, optimizer.micro_step_id,
                        optimizer._epilogue_ran_this_backward,
                        optimizer._backward_hook_state.backward_active_depth)
    before, counted, rng = zero3_state(engine), counters(), torch.get_rng_state()
    statuses = [p.ds_status for p in module.parameters()]
    # between steps: all partitioned, or all persistent ones gathered for good
    assert set(statuses) == {ZeroParamStatus.NOT_AVAILABLE if zero is ZERO3 else ZeroParamStatus.AVAILABLE}
    waiting = [m.__dict__.get("applied_pre_backward_ref_cnt") for m in module.modules()]
    with grad_hooks_fired(module.parameters()) as fired:
        # planned with the loss of the engine's steps measured below
        handle = actcfg.apply(module, auto(budget), inputs=x, loss_fn=mean_of_squares)
    # No gradient hook saw the profile's backward passes (ZeRO-3's are registered as `watch`),
    # and nothing the engine's next step reads moved.
    assert fired == []
    assert counters() == counted
    assert torch.equal(torch.get_rng_state(), rng)
    after = zero3_state(engine)
    assert len(after) == len(before) >= len(list(module.parameters())) + 5
    for was, now in zip(before, after):
        torch.testing.assert_close(now, was, rtol=0, atol=0)
    assert all(p.grad is None for p in module.parameters())
    # ZeRO-3's hooks left as a run's step leaves them: every parameter partitioned (or gathered)
    # as it was, no forward awaiting a backward, the trace to be recorded again (as before a
    # run's first step).
    assert [p.ds_status for p in module.parameters()] == statuses
    assert [m.__dict__.get("applied_pre_backward_ref_cnt") for m in module.modules()] == waiting
    assert coordinator.is_invalid_trace()
    assert not any(m._parameters._in_forward for m in module.modules())
    taken = deepspeed_backward(module)
    assert len(taken.apart) == len(list(module.parameters())) and taken.after is not None
    # no stand-in held through backward: each gradient is followed into its bucket
    assert taken.buffers == 0 and isinstance(taken.taking, Zero3Gradients)
    assert handle.plan.predicted_peak <= budget
    assert set(dict(handle.plan.choices).values()) != {"keep"}
    # The engine's own steps, the first recording ZeRO-3's trace, the next ones prefetching by
    # it: none above the plan's prediction.
    planned, peaks = measured_steps(engine, x, 3)
    print(f"zero-3: steps {peaks}, predicted {handle.plan.predicted_peak}, budget {budget}")
    assert max(peaks) <= handle.plan.predicted_peak
    planned_state = zero3_state(engine)

    # The same run given the written plan from the start.
    again, _ = engine_of(3, **zero)
    engine_losses(again, x, steps_before)
    given = actcfg.apply(again.module, handle.plan.policy_yaml)
    assert planned == measured_steps(again, x, 3)[0]
    for p, q in zip(planned_state, zero3_state(again)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert engine.global_steps == again.global_steps == steps_before + 3
    # Without any policy: the plan's recompute gathers each checkpointed block's parameters
    # again through ZeRO-3's hooks, and trains as no checkpointing does.
    plain, _ = engine_of(3, **zero)
    engine_losses(plain, x, steps_before)
    torch.testing.assert_close(measured_steps(plain, x, 3)[0], planned, rtol=1e-5, atol=0)
    handle.remove()
    given.remove()
    for e in (engine, again, plain):
        e.destroy()


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("extra, zero", [
    (None, ZERO3),
    # a bucket larger than every gradient together, as Lightning's 2e8 elements on the H200's
    # blocks stack (50M): reduced once, in the epilogue
    (None, {**ZERO3, "reduce_bucket_size": 40 * BUCKET}),
    # every gradient stays whole in `.grad` until its bucket is reduced
    (None, {**ZERO3, "contiguous_gradients": False}),
    # bf16 gradients reduced, then converted to fp32 partitions (one more copy per reduction)
    (BF16_OPTIMIZER, ZERO3),
], ids=["bucket", "bucket_over_every_gradient", "not_contiguous", "bf16_fp32_partitions"])
def test_zero3_profile_reads_the_engines_steps_and_plans_between_its_full_and_plain_steps(
        ds_env, monkeypatch, extra, zero):
    """ZeRO-3's hooks move each gradient into its reduce bucket and free it as backward makes
    it, reducing a bucket when it fills: the profile's plain and full steps read what the
    engine's own steps read (the planner's CPU meter, the same loss, the outputs let go), and a
    budget halfway between the engine's full and plain steps is planned, the engine's planned
    steps within it. Holding every gradient whole to the step's end with a bucket-sized stand-in
    through backward (before) read plain 10.8% above the engine's step with the 5e4-element
    bucket and 5.3 times it with the 2e6 one (full 8.9 times: that budget refused)."""
    from actcfg.plan.sharded import zero3_profiling

    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    engine, x = engine_of(3, extra, **zero)
    module = engine.module

    def profiled() -> int:
        with zero3_profiling(module):
            return measure_steps(module, x, steps=1, loss_fn=mean_of_squares, outputs_held=False)[1]

    profiled_plain, plain = profiled(), max(measured_steps(engine, x, 2)[1])
    full_policy = actcfg.apply(module, FULL)
    profiled_full, full = profiled(), max(measured_steps(engine, x, 2)[1])
    full_policy.remove()
    print(f"zero-3 {extra} {zero}: plain profiled {profiled_plain}, engine {plain}; full profiled "
          f"{profiled_full}, engine {full}")
    assert profiled_plain == pytest.approx(plain, rel=0.01)
    assert profiled_full == pytest.approx(full, rel=0.01)

    budget = (full + plain) // 2
    handle = actcfg.apply(module, auto(budget), inputs=x, loss_fn=mean_of_squares)
    assert set(dict(handle.plan.choices).values()) - {"keep"}  # something checkpointed
    assert handle.plan.predicted_peak <= budget
    _, peaks = measured_steps(engine, x, 2)
    print(f"planned: predicted {handle.plan.predicted_peak}, engine {peaks}, budget {budget}")
    assert max(peaks) <= handle.plan.predicted_peak
    # the profile holds the model's outputs through backward, the engine's steps here do not
    # (and a few scalars differ: the stand-in gradients' zero, the loss's copies' dtype)
    assert max(peaks) >= handle.plan.predicted_peak - x.numel() * x.element_size() - 64
    handle.remove()
    engine.destroy()


class Tied(nn.Module):
    """The blocks, then a projection by a weight its own module never runs for (as a language
    model's head uses its embedding's): ZeRO-3 gathers it only through the engine's
    external-parameter discovery, which the engine's hooks on its module turn on in a forward."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.stack = stack
        self.unused = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.stack(x), self.unused.weight)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero3_gathers_a_parameter_used_outside_its_module_in_the_profile_as_in_the_run(ds_env, monkeypatch):
    import deepspeed

    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)

    def tied() -> tuple[Any, torch.Tensor]:
        stack, x = offload_blocks(2)
        model = Tied(stack)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, **ZERO3}})
        return engine, x

    engine, x = tied()
    # Before any step: the engine registers the weight with the module that uses it (so that
    # module's hooks gather it) in its first forward, by that discovery.
    handle = actcfg.apply(engine.module, auto(1 << 30), inputs=x)  # every block kept
    assert engine.module.unused.weight.ds_status.name == "NOT_AVAILABLE"
    planned = engine_losses(engine, x, 2)
    again, _ = tied()
    given = actcfg.apply(again.module, handle.plan.policy_yaml)
    assert planned == engine_losses(again, x, 2)
    handle.remove()
    given.remove()
    engine.destroy()
    again.destroy()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero3_leaf_modules_are_refused_naming_their_backward_hook(ds_env, monkeypatch):
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    model, x = offload_blocks(2)
    set_z3_leaf_modules(model, [type(model.blocks[0])])
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, **ZERO3}})
    with grad_hooks_fired(model.parameters()) as fired:
        with pytest.raises(PlanError, match=r"^`checkpoint.mode: auto` profiles training steps on the "
                           r"model as given, and the model is trained by the DeepSpeed engine with "
                           r"ZeRO-3, with a ZeRO-3 leaf module \(Block: set_z3_leaf_modules .*\), "
                           r"whose gradients ZeRO-3 reduces in a full backward hook on the module, "
                           r"which the profile's backward would fire; plan the same model and "
                           r"micro-batch on one rank under ZeRO-3 without offload_param"):
            actcfg.apply(engine.module, auto(1 << 20), inputs=x)
    assert fired == []
    engine.destroy()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero3_refuses_compile_before_any_step(ds_env, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    engine, x = engine_of(3, **ZERO3)
    compiled = {**auto(1 << 20), "compile": {"scope": "blocks", "backend": "aot_eager"}}
    with pytest.raises(PlanError, match=r"^`compile:` with a model trained by the DeepSpeed engine "
                       r"with ZeRO-3: the profile runs ZeRO-3's module hooks, .*; remove `compile`, "
                       r"or plan under ZeRO stage 1 or 2$"):
        actcfg.apply(engine.module, compiled, inputs=x)
    assert all(p.grad is None for p in engine.module.parameters())
    engine.destroy()


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap_comm", [False, True])  # True: two buckets (Lightning's default)
def test_a_zero_step_holds_the_plans_budget_with_its_buckets(ds_env, stage, overlap_comm):
    """What the engine's own step allocates (engine(x), engine.backward), as the planner's meter
    counts it, fits the plan's budget; without the stand-in for DeepSpeed's buffers it would not."""
    from actcfg.plan.sharded import deepspeed_backward

    engine, x = engine_of(stage, reduce_bucket_size=4 * BUCKET, overlap_comm=overlap_comm)
    module = engine.module
    budget = halfway_budget(lambda: (module, x))
    handle = actcfg.apply(module, auto(budget), inputs=x)
    engine_losses(engine, x, 1)  # the first step (Adam's state is made in it, after backward)
    live = LiveBytes()
    live.start()
    loss = engine(x).square().mean()
    engine.backward(loss)
    live.stop()
    engine.step()
    buffers = deepspeed_backward(module).buffers
    print(f"zero-{stage}: step {live.peak}, predicted {handle.plan.predicted_peak}, budget {budget}, "
          f"stand-in {buffers}")
    assert live.peak <= budget
    assert live.peak <= handle.plan.predicted_peak
    assert live.peak > handle.plan.predicted_peak - buffers
    handle.remove()
    engine.destroy()


def test_steps_knows_whether_a_failure_left_this_rank_inside_a_step():
    """What decides between agreeing on a failure and raising at once (collectives in flight)."""
    from actcfg.plan.sharded import Steps

    model, x = offload_blocks(2)
    steps = Steps(model, None)
    loss = steps.loss(lambda out: out.square().mean())
    with torch.no_grad():
        model(x)
    assert not steps.inside  # a forward with no backward after it ends at the forward's end
    value = loss(model(x))
    assert steps.inside  # between the loss and the end of its backward
    value.backward()
    assert not steps.inside

    def fail(module: nn.Module, args: Any) -> None:
        raise RuntimeError("out of memory in blocks.1")

    hook = model.blocks[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="out of memory in blocks.1"):
        model(x)
    assert steps.inside  # the forward's collectives were in flight when it failed
    hook.remove()
    steps.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


# --- two ranks: gloo, fresh processes ---------------------------------------------------------------


def _two_rank_worker(rank: int, out_dir: str, port: int, budget: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_group(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    result: dict[str, Any] = {}
    model, x = offload_blocks(4)
    shard(model, mesh)
    local = x.chunk(WORLD)[rank]
    handle = actcfg.apply(model, auto(budget), inputs=local)
    result["plan"] = handle.plan.policy_yaml
    result["choices"] = [list(c) for c in handle.plan.choices]
    handle.remove()

    # Rank 1's loss fails in the profile's first step; rank 0's would not.
    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            raise ValueError("rank 1 has no labels")
        return output.square().mean()

    model, _ = offload_blocks(4)
    shard(model, mesh)
    try:
        actcfg.apply(model, auto(budget), inputs=local, loss_fn=loss_fn)
    except PlanError as e:
        result["error"] = str(e)
    result["grads_untouched"] = all(p.grad is None for p in model.parameters())
    # The group still works after the failure: the ranks' collectives are matched.
    result["after"] = train_one_more(model, local)

    # Rank 1 cannot plan at all (its model is frozen): both stop before the first step.
    model, _ = offload_blocks(4)
    shard(model, mesh)
    if rank == 1:
        model.requires_grad_(False)
    try:
        actcfg.apply(model, auto(budget), inputs=local)
    except PlanError as e:
        result["frozen"] = str(e)
    write_result(out_dir, rank, result)
    finish()


def train_one_more(model: nn.Module, x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return float(sum(p.grad.full_tensor().abs().sum() for p in model.parameters()))


@pytest.mark.slow
def test_two_ranks_apply_one_plan_and_a_rank_that_fails_makes_the_other_fail_with_its_sentence(tmp_path):
    gloo_or_skip()
    # The budget between checkpointing every block and plain for one rank's half batch, read on a
    # copy of the model unsharded (the ranks' sharded peaks lie close to it; the test asserts
    # agreement, not fit).
    model, x = offload_blocks(4)
    local = x.chunk(WORLD)[0]
    _, plain = measure_steps(copy.deepcopy(model), local, steps=1)
    handle = actcfg.apply(model, FULL)
    _, full = measure_steps(model, local, steps=1)
    handle.remove()
    # Below the collectives' own 300 s limit (tests/_multirank.py): a rank left waiting for the
    # failed one would be stopped here, failing the test, rather than end on that limit.
    ranks = run_ranks(_two_rank_worker, tmp_path, (full + plain) // 2, timeout=240)
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["choices"] == ranks[1]["choices"]
    assert len(ranks[0]["choices"]) == 4
    for r in ranks:
        assert r["error"] == (
            "planning failed on rank 1 of 2 (while profiling): loss_fn raised ValueError: "
            "rank 1 has no labels; the profile calls it on the model's output and needs a scalar "
            "tensor back; every rank stops here, since the ranks apply one plan made from all "
            "their profiles")
        assert r["grads_untouched"]
        assert r["frozen"].startswith(
            "planning failed on rank 1 of 2 (before profiling): no parameter of the model requires "
            "grad (a frozen model)")
    assert ranks[0]["after"] == pytest.approx(ranks[1]["after"])  # one reduce-scattered gradient


def _zero2_two_rank_worker(rank: int, out_dir: str, port: int, budget: int) -> None:
    init_group(rank, port, deepspeed=True)
    result: dict[str, Any] = {}

    def run(plan: str | None) -> tuple[Any, list[float], list[float]]:
        engine, x = engine_of(2, reduce_bucket_size=BUCKET)
        local = x.chunk(WORLD)[rank]
        engine_losses(engine, local, 1)
        handle = actcfg.apply(engine.module, plan if plan is not None else auto(budget),
                              **({} if plan is not None else {"inputs": local}))
        losses = engine_losses(engine, local, 2)
        weights = [float(p.detach().abs().sum()) for p in engine.module.parameters()]
        handle.remove()
        engine.destroy()
        return handle, losses, weights

    planned, result["planned"], result["weights"] = run(None)
    result["plan"] = planned.plan.policy_yaml
    result["choices"] = [list(c) for c in planned.plan.choices]
    _, result["given"], result["given_weights"] = run(planned.plan.policy_yaml)
    write_result(out_dir, rank, result)
    finish()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero2_on_two_ranks_plans_one_plan_and_trains_as_the_written_plan(tmp_path, ds_env):
    """Under ZeRO-1/2 a profiled step has no collective (its reductions are in the hooks the
    profile keeps out): the ranks profile apart, agree on one plan, and the engine's reductions
    after planning pair up as in a run given that plan."""
    gloo_or_skip()
    from actcfg.plan.profile import measure_steps

    # The budget for one rank's half batch under the engine, read in this process's one-rank
    # engine (the ranks' profiles lie close to it; the test asserts agreement and equality).
    engine, x = engine_of(2, reduce_bucket_size=BUCKET)
    local = x.chunk(WORLD)[0]
    _, plain = measure_steps(engine.module, local, steps=1)
    with actcfg.apply(engine.module, FULL):
        _, full = measure_steps(engine.module, local, steps=1)
    # ...less the half of ZeRO-2's gradient partition (fp32) each of two ranks does not hold.
    half = sum(p.numel() * 4 for p in engine.module.parameters()) // WORLD
    engine.destroy()
    ranks = run_ranks(_zero2_two_rank_worker, tmp_path, (full + plain) // 2 - half, timeout=300)
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert {c for _, c in ranks[0]["choices"]} != {"keep"}
    for r in ranks:
        assert r["planned"] == r["given"]
        assert r["weights"] == r["given_weights"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one all-reduced update on both


def _zero3_two_rank_worker(rank: int, out_dir: str, port: int) -> None:
    from actcfg.errors import PlanError as Refused  # this process's class

    init_group(rank, port, deepspeed=True)
    engine, x = engine_of(3, **ZERO3)
    local = x.chunk(WORLD)[rank]
    with grad_hooks_fired(engine.module.parameters()) as fired:
        try:
            actcfg.apply(engine.module, auto(1 << 30), inputs=local)
            refused = None
        except Refused as e:
            refused = str(e)
    # Refused before any profiled step: no gather or reduction of one rank waits for the other.
    losses = engine_losses(engine, local, 1)
    write_result(out_dir, rank, {"refused": refused, "fired": len(fired), "losses": losses,
                                 "steps": engine.global_steps})
    engine.destroy()
    finish()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zero3_on_two_ranks_is_refused_before_any_step_naming_its_gathers_and_what_to_do(tmp_path, ds_env):
    gloo_or_skip()
    ranks = run_ranks(_zero3_two_rank_worker, tmp_path, timeout=300)
    for r in ranks:
        assert r["refused"] is not None and (
            "the model is trained by the DeepSpeed engine with ZeRO-3, whose parameters are "
            "partitioned over 2 ranks: ZeRO-3 all-gathers each module's parameters on the device "
            "with hooks whose timing follows the module order it recorded") in r["refused"]
        assert ("each gather is a collective the ranks' profiles would have to match one for "
                "one; plan the same model and micro-batch on one rank under ZeRO-3 without "
                "offload_param") in r["refused"]
        assert r["fired"] == 0 and r["steps"] == 1


# --- one rank: NCCL on an H200 ----------------------------------------------------------------------


def _nccl_worker(rank: int, out_dir: str, port: int) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from actcfg.probes import blocks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=300),
                            device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,))

    def make() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model, x = blocks(n=6, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024,
                          dtype=torch.bfloat16, device="cuda")
        return shard(model, mesh), x

    budget = halfway_budget(make)
    model, x = make()
    handle = actcfg.apply(model, auto(budget), inputs=x)
    planned = [train_one_more(model, x) for _ in range(STEPS)]
    _, peak = measure_steps(model, x, steps=2)
    again, _ = make()
    given = actcfg.apply(again, handle.plan.policy_yaml)
    written = [train_one_more(again, x) for _ in range(STEPS)]
    write_result(out_dir, rank, {
        "budget": budget, "peak": peak, "predicted": handle.plan.predicted_peak,
        "choices": [list(c) for c in handle.plan.choices], "planned": planned, "written": written,
    })
    handle.remove()
    given.remove()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fsdp2_one_rank_nccl_plan_fits_its_budget_with_the_written_plans_gradients(tmp_path):
    (result,) = run_ranks(_nccl_worker, tmp_path, world=1, timeout=900)
    print("fsdp2 nccl plan:", result)
    assert 0 < result["peak"] <= result["budget"]
    assert result["predicted"] <= result["budget"]
    assert {c for _, c in result["choices"]} != {"keep"}
    # the same kernels on the same batch; rel 1e-6 leaves room for an atomic-add reduction
    assert result["planned"] == pytest.approx(result["written"], rel=1e-6)


def _zero3_nccl_worker(rank: int, out_dir: str, port: int) -> None:
    """ZeRO-3 on one GPU (NCCL, one rank: every gather a view of the partition) with bf16
    weights: the plan within its budget, the engine's own forward and backward (CUDA allocator
    peak above its start, over the first steps after planning: the trace recorded, then
    prefetching) against the prediction, and the run given the written plan."""
    import os
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    from actcfg.plan.sharded import zero3_profiling
    from actcfg.probes import blocks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=300),
                            device_id=torch.device("cuda", 0))
    deepspeed.init_distributed(dist_backend="nccl")  # takes the group up already

    def make() -> tuple[Any, torch.Tensor]:
        torch.manual_seed(0)
        model, x = blocks(n=6, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024,
                          dtype=torch.bfloat16, device="cuda")
        config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "reduce_bucket_size": 5e7}}
        engine, *_ = deepspeed.initialize(  # a torch optimizer, not a DeepSpeed optimizer type
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
        return engine, x

    def steps(engine: Any, x: torch.Tensor, n: int) -> tuple[list[float], list[int]]:
        losses, peaks = [], []
        for _ in range(n):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - start)
            engine.step()
            losses.append(loss.item())
        return losses, peaks

    engine, x = make()
    with zero3_profiling(engine.module):
        budget = halfway_budget(lambda: (engine.module, x))
    steps(engine, x, 1)
    # planned with the loss of the engine's steps (a mean's backward allocates, a sum's does not)
    handle = actcfg.apply(engine.module, auto(budget), inputs=x,
                          loss_fn=lambda out: out.float().square().mean())
    planned, peaks = steps(engine, x, 3)
    again, _ = make()
    steps(again, x, 1)
    given = actcfg.apply(again.module, handle.plan.policy_yaml)
    written, _ = steps(again, x, 3)
    write_result(out_dir, rank, {
        "budget": budget, "peaks": peaks, "predicted": handle.plan.predicted_peak,
        "choices": [list(c) for c in handle.plan.choices], "planned": planned, "written": written,
    })
    handle.remove()
    given.remove()
    engine.destroy()
    again.destroy()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.deepspeed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_zero3_one_rank_nccl_plan_holds_its_prediction_and_trains_as_the_written_plan(tmp_path):
    (result,) = run_ranks(_zero3_nccl_worker, tmp_path, world=1, timeout=900)
    print("zero-3 nccl plan:", {k: v for k, v in result.items() if k not in ("planned", "written")})
    assert result["predicted"] <= result["budget"]
    assert {c for _, c in result["choices"]} != {"keep"}
    assert max(result["peaks"]) <= result["predicted"]
    # The profile follows ZeRO-3's gradient hooks (each gradient into its bucket as it is made):
    # the prediction is the engine's step within a few percent, not the whole gradients above it.
    # Its steps let the model's output go once the loss is taken; the profile holds it (bf16:
    # 8 MiB here).
    assert max(result["peaks"]) >= 0.95 * result["predicted"]
    # the same kernels on the same batches; rel 1e-6 leaves room for an atomic-add reduction
    assert result["planned"] == pytest.approx(result["written"], rel=1e-6)
