"""Plan activation memory: the fastest per-module policy whose peak fits a memory budget.

`profile` (torch) measures one training step per candidate block under each choice (keep,
selective, full, full + offload, offload), `solve` (pure) chooses per block with an exact
dynamic program over the profile, `write` turns the choice into an explicit
`checkpoint.mode: rules` policy, and `plan_model` does all three for `actcfg.apply` and
`actcfg plan`. Importing this package imports no torch: `profile` is loaded on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actcfg.plan.model import CHOICES, OFFLOADS, BlockProfile, Option, Profile
from actcfg.plan.solve import Plan, predict, smallest_peak, solve
from actcfg.plan.write import policy_text

if TYPE_CHECKING:
    from actcfg.reports import PlanReport
    from actcfg.schema import Policy

__all__ = [
    "CHOICES",
    "OFFLOADS",
    "BlockProfile",
    "Option",
    "Plan",
    "Planned",
    "Profile",
    "plan_model",
    "policy_text",
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


def plan_model(model: Any, policy: Policy, inputs: Any, *, loss_fn: Any = None, apply: Any,
               origin: str = "") -> Planned:
    """Profile `model` on `inputs`, solve for `policy.memory_budget`, and return the plan as a
    `checkpoint.mode: rules` policy with the report of what was planned. `apply` is
    `actcfg.runtime.apply` (passed in: the runtime sits above this package); `origin` names the
    policy file in the written plan's header. PlanError when no plan fits. Under a process group
    of several ranks, every rank plans from the ranks' profiles reduced to their worst case and
    gets the same plan (`actcfg.plan.consensus`): a collective, which every rank must call."""
    from actcfg.checker import load
    from actcfg.plan.consensus import agree, one_profile
    from actcfg.plan.profile import profile as run_profile
    from actcfg.reports import PlanReport

    profiled = run_profile(model, policy.checkpoint.modules, inputs, loss_fn=loss_fn, apply=apply,
                           pin=policy.pin, pin_budget=policy.pin_budget)
    profiled = one_profile(profiled)  # the identity without a process group
    plan = solve(profiled, policy.memory_budget)
    text = policy_text(plan, profiled, policy, origin=origin)
    agree(text)
    report = PlanReport(
        memory_budget=plan.budget,
        choices=tuple(zip(plan.blocks, plan.choices)),
        predicted_step_time_ms=plan.step_ms,
        predicted_peak=plan.peak,
        plain_step_time_ms=profiled.plain_step_ms,
        plain_peak=profiled.plain_peak,
        max_inflight=plan.max_inflight,
        kept_at_turn=plan.kept_at_turn,
        policy_yaml=text,
        device=profiled.device,
    )
    return Planned(load(text), report, profiled, plan)
