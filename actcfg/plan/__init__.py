"""Plan activation memory: the fastest per-module policy whose peak fits a memory budget.

`profile` (torch) measures one training step per candidate block under each choice (keep,
selective, split into its parts, full, full + offload, offload), `solve` (pure) chooses per block with an exact
dynamic program over the profile, `write` turns the choice into an explicit
`checkpoint.mode: rules` policy, and `plan_model` does all three for `actcfg.apply` and
`actcfg plan`. Importing this package imports no torch: `profile` is loaded on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actcfg.plan.model import CHOICE_TABLE, CHOICES, OFFLOADS, BlockProfile, Choice, Option, Profile
from actcfg.plan.solve import Plan, predict, smallest_peak, solve
from actcfg.plan.trial import Apply
from actcfg.plan.write import exact_pattern, plan_policy, policy_text, policy_yaml

if TYPE_CHECKING:
    from actcfg.runtime.reports import PlanReport
    from actcfg.policy.schema import Policy

__all__ = [
    "CHOICES",
    "CHOICE_TABLE",
    "OFFLOADS",
    "Apply",
    "BlockProfile",
    "Choice",
    "Option",
    "Plan",
    "Planned",
    "Profile",
    "exact_pattern",
    "plan_model",
    "plan_policy",
    "policy_text",
    "policy_yaml",
    "predict",
    "smallest_peak",
    "solve",
]


@dataclass(frozen=True)
class Planned:
    """What `plan_model` produced: the rules policy to apply, the report of what was planned,
    and the profile and plan it came from."""

    policy: Policy
    report: PlanReport
    profile: Profile
    plan: Plan


def plan_model(model: Any, policy: Policy, inputs: Any, *, loss_fn: Any = None, apply: Apply,
               origin: str = "", outputs_held: bool = True, accumulating: bool = False,
               grads_through_forward: bool = False) -> Planned:
    """Profile `model` on `inputs`, solve for `policy.memory_budget`, and return the plan as a
    `checkpoint.mode: rules` policy with the report of what was planned. `apply` is
    the runtime's applier of a concrete policy (passed in by `actcfg.api`); `origin` names the
    policy file in the written plan's header. PlanError when no plan fits. Under a process group
    of several ranks, every rank plans from the ranks' profiles reduced to their worst case and
    gets the same plan (`actcfg.plan.consensus`): a collective, which every rank must call. The
    ranks agree on success before and after the profile (and, for a sharded model, at each
    step's loss): a rank that cannot plan makes every rank raise its sentence.

    A model sharded with FSDP2 is profiled as it trains, its parameters gathered per unit and
    its gradients reduce-scattered in each profiled step (`actcfg.plan.sharded`); the module of a
    DeepSpeed engine with ZeRO-1/2 (or none) is profiled with its backward apart from ZeRO's
    gradient hooks and a stand-in for its reduce buckets, and with ZeRO-3 on one rank through
    ZeRO-3's own module hooks (`zero3_profiling`); DDP, ZeRO-3 where a gather allocates
    (`zero3_refusal`) and the engine object itself are refused.

    What the training loop does around the model, as the profile cannot see it: `outputs_held`,
    whether it holds the model's outputs through backward (`Probe.step`); `accumulating`,
    whether it accumulates gradients over micro-batches, so that a later one starts with every
    parameter gradient (`Profile.accumulated_grads`); `grads_through_forward`, whether the
    previous step's gradients live through the forward and are set to None before backward, as
    Lightning's automatic optimization does (`Profile.forward_grads`; under `accumulating` they
    are counted everywhere already)."""
    from actcfg.errors import ActcfgError, PlanError
    from actcfg.plan.consensus import agree, group_of_ranks, one_profile, settle
    from actcfg.plan.profile import measure_steps
    from actcfg.plan.profile import profile as run_profile
    from actcfg.plan.sharded import (WHILE_PROFILING, Steps, is_sharded, is_zero3,
                                     refuse_compile_across_ranks, refuse_unplannable, zero3_profiling)
    from actcfg.runtime.step import default_loss, split_inputs

    group = group_of_ranks()
    across = group is not None and is_sharded(model)  # collectives inside every profiled step
    ready: ActcfgError | None = None
    try:
        refuse_unplannable(model)
        _refuse_frozen(model)
        if across:
            refuse_compile_across_ranks(policy.compile is not None)
        if policy.compile is not None and is_zero3(model):
            # ZeRO-3's module hooks are torch.compiler.disable'd and gather by the trace; a
            # compiled profile under them has not been built or measured.
            raise PlanError("`compile:` with a model trained by the DeepSpeed engine with ZeRO-3: "
                            "the profile runs ZeRO-3's module hooks, which compiled blocks break "
                            "at, and compiled planning is not built under them; remove "
                            "`compile`, or plan under ZeRO stage 1 or 2")
        elif group is not None and policy.compile is not None and policy.compile.scope == "model":
            # each rank would measure its own plan compiled whole and could refuse alone
            raise PlanError(
                "compile: {scope: model} on several ranks: its plan is measured compiled whole, a "
                "reading of each rank's own, and ranks must agree on one plan; plan on one process "
                "(`actcfg plan`, or a one-rank group) and pass the written plan on every rank, or "
                "use compile: {scope: blocks}")
        checked = _checked_loss(loss_fn if loss_fn is not None else default_loss, loss_fn is None)
        split_inputs(inputs)  # a rank's unreadable batch: said here, before any collective
    except ActcfgError as e:
        ready = e
    settle(ready, group, where=" (before profiling)")
    steps = Steps(model, group) if across else None
    try:
        with zero3_profiling(model):  # ZeRO-3 (one rank): its hooks' state put back after
            local = run_profile(model, policy.checkpoint.modules, inputs,
                                loss_fn=checked if steps is None else steps.loss(checked), apply=apply,
                                pin=policy.pin, pin_budget=policy.pin_budget, compile=policy.compile,
                                submodules=policy.checkpoint.submodules, strict=across,
                                outputs_held=outputs_held, budget=policy.memory_budget)
    except Exception as e:
        if steps is not None and steps.settled:
            raise  # the ranks agreed at a step's loss: every rank raises this now
        if steps is not None and steps.inside:
            # The other ranks wait inside FSDP2's next collective: no call of this rank can
            # match it now, so no agreement is possible (actcfg.plan.sharded).
            raise PlanError(
                f"planning failed on this rank inside a profiled forward or backward of the "
                f"sharded model ({type(e).__name__}: {e}); the other ranks wait inside FSDP2's "
                "collectives of that step and stop at the process group's timeout") from e
        settle(e, group, where=WHILE_PROFILING)
        raise  # settle raised already, with a group or without (it re-raises e alone)
    finally:
        if steps is not None:
            steps.remove()
    settle(None, group, where=WHILE_PROFILING)
    profiled = one_profile(local)  # the identity without a process group
    # How long this rank's profile took, and how it was compiled, are this rank's own readings.
    grads = _gradient_bytes(model) if accumulating or grads_through_forward else 0
    profiled = dataclasses.replace(profiled, compiled=local.compiled, profile_ms=local.profile_ms,
                                   compile_ms=local.compile_ms, parts_ms=local.parts_ms,
                                   parts_steps=local.parts_steps,
                                   accumulated_grads=grads if accumulating else 0,
                                   forward_grads=0 if accumulating else grads)
    if profiled.forward_grads:  # plain's peak as the plan's, with them (a uniform run: exact)
        profiled = dataclasses.replace(
            profiled, plain_peak=predict(profiled, ("keep",) * len(profiled.blocks))[1])
    plan = solve(profiled, policy.memory_budget)
    if policy.compile is not None and policy.compile.scope == "model" and profiled.device == "cuda":
        def measured(planned: Policy) -> tuple[float, int]:
            handle = apply(model, planned)
            try:
                return measure_steps(model, inputs, loss_fn=checked, steps=1, outputs_held=outputs_held)
            finally:
                handle.remove()
        plan, profiled = _measured_whole(model, policy, profiled, plan, measured)
    planned = plan_policy(plan, policy)
    text = policy_yaml(planned, plan, profiled, origin=origin)
    agree(text)
    _refuse_inexact(model, planned, plan)
    # `parts_steps` is set here, not in `Plan.report` (solve's), which reads the profile's times
    report = dataclasses.replace(plan.report(profiled, text), parts_steps=dict(profiled.parts_steps))
    return Planned(planned, report, profiled, plan)


WHOLE_TRIES = 3
"""How many plans `_measured_whole` measures compiled whole before it gives up."""


def _measured_whole(model: Any, policy: Policy, profiled: Profile, plan: Plan,
                    measured: Callable[[Policy], tuple[float, int]]) -> tuple[Plan, Profile]:
    """`compile: {scope: model}`: the plan measured as it will run, compiled whole
    (`measured(rules)`: one step's ms and its peak above the step's start, after a step that
    compiles), and solved again below the budget by what its prediction missed.

    The profile reads each block's bytes with hooks that break the compiled graph at the blocks;
    the whole graph of a mix of choices is partitioned differently by inductor (on an H200, the
    blocks stack at torch.compile's `activation_memory_budget` 0.1 point: 7 selective and 1 full
    measured 5.329 GiB whole against 5.007 predicted, over a 5.221 GiB budget). Solved again at
    the budget less that miss, the plan just measured no longer fits and the next is one the
    same miss would still leave within the budget. One compile and two steps per plan measured:
    the two steps' time is planning (`parts_ms` and `parts_steps` under `measured_whole`), the
    rest compiling (`compile_ms`); the plan's peak is then the measured one. In a
    trainer whose gradients live across the step (`forward_grads`, `accumulated_grads`) the
    measured step starts without them: they are added to what it measured, which bounds the
    step from above. On CUDA only, where a step's peak is the allocator's and the profile's own
    (on the CPU the profile's bytes are an estimate that a measured step does not read)."""
    import time

    from actcfg.errors import PlanError
    from actcfg.units import memory_size

    budget, spent, stepped, peak = policy.memory_budget, 0.0, 0.0, 0
    tries = 0
    for _ in range(WHOLE_TRIES):
        rules = plan_policy(plan, policy)
        _refuse_inexact(model, rules, plan)  # its sentence, before apply's about a rule never written
        started = time.perf_counter()
        tries += 1
        step_ms = 0.0
        try:
            step_ms, peak = measured(rules)
            peak += profiled.forward_grads + profiled.accumulated_grads
        finally:
            wall = (time.perf_counter() - started) * 1000.0
            # the warm-up step's run and the measured step, at the measured step's time
            ran = min(wall, 2 * step_ms)
            spent += wall - ran
            stepped += ran
        if peak <= policy.memory_budget:
            plan = dataclasses.replace(plan, peak=peak)
            break
        budget = min(budget, policy.memory_budget - (peak - plan.peak))
        try:
            plan = dataclasses.replace(solve(profiled, budget), budget=policy.memory_budget)
        except PlanError as e:
            raise PlanError(
                f"compile: {{scope: model}}: the plan measured {memory_size(peak)} compiled whole, over "
                f"memory_budget {memory_size(policy.memory_budget)} and {memory_size(peak - plan.peak)} "
                "above its prediction (its profile reads the blocks with the graph broken at them), "
                f"and no plan is predicted within {memory_size(budget)}, the budget less that; raise "
                "memory_budget, or use compile: {scope: blocks}, whose profile is what runs") from e
    else:
        raise PlanError(
            f"compile: {{scope: model}}: {WHOLE_TRIES} plans measured compiled whole all went over memory_budget "
            f"{memory_size(policy.memory_budget)} (the last {memory_size(peak)}); raise memory_budget, or use "
            "compile: {scope: blocks}, whose profile is what runs")
    parts = {k: v for k, v in profiled.parts_ms.items() if k != "rest"}
    parts["measured_whole"] = stepped
    parts["rest"] = profiled.parts_ms.get("rest", 0.0)
    return plan, dataclasses.replace(
        profiled, compile_ms=profiled.compile_ms + spent, profile_ms=profiled.profile_ms + stepped,
        parts_ms=parts, parts_steps={**profiled.parts_steps, "measured_whole": 2 * tries})


def _refuse_frozen(model: Any) -> None:
    from actcfg.errors import PlanError

    if not any(p.requires_grad for p in model.parameters()):
        raise PlanError(
            "no parameter of the model requires grad (a frozen model): a plan profiles a "
            "training step, and this model's would compute no gradient; make the parameters you "
            "train require grad (model.requires_grad_() or per module) before planning")


def _checked_loss(loss_fn: Any, default: bool) -> Any:
    """`loss_fn` as the profile calls it, each call checked: an error of the user's loss_fn (or
    a result backward cannot start from) is a PlanError naming loss_fn, not torch's words from
    deep inside the profile."""
    import torch

    from actcfg.errors import PlanError

    what = "the default loss (the output's `loss`, else the fp32 sum of squares of its first tensor)" \
        if default else "loss_fn"
    if not callable(loss_fn):
        raise PlanError(f"loss_fn= is a {type(loss_fn).__name__}, not a callable: pass "
                        "loss_fn=lambda output: <a scalar tensor>, or leave it out")

    def checked(output: Any) -> Any:
        try:
            loss = loss_fn(output)
        except (PlanError, torch.cuda.OutOfMemoryError):
            raise  # the profile's own handling: out of memory is a measurement
        except Exception as e:
            raise PlanError(f"{what} raised {type(e).__name__}: {e}; the profile calls it on the "
                            "model's output and needs a scalar tensor back") from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else f"a {type(loss).__name__}")
            raise PlanError(f"{what} returned {got}: the profile calls backward() on it and needs "
                            "a scalar tensor (reduce it, e.g. with .mean())")
        if not loss.requires_grad:
            raise PlanError(f"{what} returned a tensor that does not require grad: backward() "
                            "cannot start from it (is it computed from the output, under grad "
                            "mode, with a parameter that requires grad?)")
        return loss

    return checked


def _refuse_inexact(model: Any, planned: Policy, plan: Plan) -> None:
    """PlanError unless the written rules take exactly the planned modules: patterns match
    class names too, so a module whose qualified name is also a class name of the model (a
    ModuleDict key `Linear`) cannot be named alone. Better said now than by apply's refusal of
    a rule the user never wrote."""
    from actcfg.runtime.wrap import select_by_rules
    from actcfg.errors import PlanError, PolicyApplyError

    rules = [r.modules for r in planned.checkpoint.rules]
    try:
        taken = {n for n, _, _ in select_by_rules(model, rules)}
    except PolicyApplyError as e:
        raise PlanError(f"the plan's rules cannot be applied to this model as written: {e}") from e
    planned_modules = set(plan.modules())
    if taken != planned_modules:
        extra = sorted(taken - planned_modules)
        missing = sorted(planned_modules - taken)
        raise PlanError(
            "the plan's rules would not take exactly the planned modules"
            + (f" (they would also take {', '.join(extra)})" if extra else "")
            + (f" (they would miss {', '.join(missing)})" if missing else "")
            + ": a rule's pattern matches class names as well as qualified names, so a module "
            "named like a class of the model cannot be named alone; rename that module, or "
            "plan over other modules (`checkpoint.modules`)")


def _gradient_bytes(model: Any) -> int:
    """Bytes of the gradients of `model`'s trainable parameters on this rank (a sharded
    parameter's local shard: FSDP2 keeps the reduced gradient sharded)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = getattr(p, "_local_tensor", p)  # a DTensor's shard on this rank
            total += local.numel() * local.element_size()
    return total
