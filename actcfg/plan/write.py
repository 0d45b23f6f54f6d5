"""A plan as an explicit policy: `checkpoint.mode: rules`, one rule per choice, every candidate
block named, with what the plan predicted. `plan_policy` builds the `Policy` that is applied;
`policy_yaml` writes it as text for a person or a file (`-o`, a trainer's plan file). Pure:
nothing is written to disk here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from actcfg.plan.model import CHOICE_OF, Profile
from actcfg.plan.solve import Plan
from actcfg.units import memory_size
from actcfg.policy.schema import Policy, Prediction, RulesCheckpoint, format_size

__all__ = ["exact_pattern", "plan_policy", "policy_text", "policy_yaml"]

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
# Plain scalars some YAML reader takes for a boolean or null (YAML 1.1 included): quoted.
_NOT_STRINGS = frozenset({"true", "false", "null", "yes", "no", "on", "off", "y", "n"})


def _scalar(text: str) -> str:
    # A pattern as YAML reads it back: plain when it is a dotted identifier, else quoted.
    if _PLAIN.match(text) and text.lower() not in _NOT_STRINGS:
        return text
    return json.dumps(text, ensure_ascii=False)


def exact_pattern(name: str) -> str:
    """The fnmatch pattern that matches the qualified name `name` and no other: `[`, `*` and
    `?` in it (a ModuleDict key such as `b[12]`) each written as a one-character set (`[[]`).
    A plan names modules, and `b[12]` as a pattern would take `b1` and `b2` instead."""
    return "".join(f"[{c}]" if c in "[*?" else c for c in name)


def plan_policy(plan: Plan, source: Any) -> Policy:
    """`plan` as the `checkpoint.mode: rules` policy it is applied as, built directly, keeping
    the settings of the `mode: auto` policy it was planned for (`source`: backend; pin and the
    pin budgets where a rule offloads).

    One rule per choice, in the order the choices first appear; a block planned `split` is
    named by its parts (each checkpointed on its own), and so is one planned `split_offload` (its
    rule with `cpu_checkpointing`: each part's input offloaded). Blocks that keep everything get
    a `mode: none` rule too, so every candidate is named and the offload engine starts each
    reload one block ahead. `keep_last` and `max_inflight` are set when a rule offloads: the
    plan's choices are explicit, so `keep_last` is 0 (the blocks it keeps at the turn are
    `mode: none` rules of their own). Only the fields `policy_yaml` writes are set, so the
    written file loads back to this policy, explicitly set fields included.
    """
    members: dict[str, list[str]] = {}
    taken = plan.taken or tuple((b,) for b in plan.blocks)
    for named, choice in zip(taken, plan.choices):
        members.setdefault(choice, []).extend(exact_pattern(n) for n in named)
    rules = tuple(CHOICE_OF[c].rule(tuple(names)) for c, names in members.items())
    offloads = any(CHOICE_OF[c].offload for c in plan.choices)
    schedule: dict[str, Any] = {"keep_last": 0, "max_inflight": plan.max_inflight} if offloads else {}
    # What the YAML writes, as it reads back: a tenth of a millisecond, whole MiB rounded up.
    predicted = Prediction(step_time_ms=float(f"{max(plan.step_ms, 0.1):.1f}"),
                           peak=math.ceil(plan.peak / 2**20) * 2**20)
    # Host-memory settings only where something offloads (else they would do nothing: a warning).
    host: dict[str, Any] = {}
    if offloads and not source.pin:
        host["pin"] = False
    if offloads and source.pin_budget is not None:
        host["pin_budget"] = source.pin_budget
    if offloads and source.pin_budget_per_node is not None:
        host["pin_budget_per_node"] = source.pin_budget_per_node
    checkpoint = RulesCheckpoint(mode="rules", rules=rules, **schedule, predicted=predicted)
    # Profiled compiled, applied compiled: the rules file carries `compile` and apply compiles.
    compiled = {"compile": source.compile} if source.compile is not None else {}
    return Policy(version=1, backend=source.backend, checkpoint=checkpoint, **host, **compiled)


def policy_yaml(policy: Policy, plan: Plan, profile: Profile, *, origin: str = "") -> str:
    """The YAML text of the plan's `policy` (from `plan_policy`), with a header saying what it
    was planned for; it loads back to `policy`. Text only where a person or a file reads it."""
    ckpt = policy.checkpoint
    lines = [
        f"# Written by actcfg plan{f' from {origin}' if origin else ''}: the fastest per-module "
        f"choices whose predicted peak fits memory_budget {format_size(plan.budget)}",
        f"# ({profile.device} profile{f', compiled ({profile.compiled})' if profile.compiled else ''}; "
        f"without a policy the step took {profile.plain_step_ms:.1f} ms "
        f"and peaked at {memory_size(profile.plain_peak)}). Check it with `actcfg verify`.",
        "version: 1",
        f"backend: {policy.backend.value}",
        "checkpoint:",
        "  mode: rules",
        "  rules:",
    ]
    for rule in ckpt.rules:
        names = ", ".join(_scalar(n) for n in rule.modules)
        offload = ", cpu_checkpointing: true" if rule.cpu_checkpointing else ""
        lines.append(f"    - {{modules: [{names}], mode: {rule.mode}{offload}}}")
    if "keep_last" in ckpt.model_fields_set:
        lines += [f"  keep_last: {ckpt.keep_last}", f"  max_inflight: {ckpt.max_inflight}"]
    lines.append(f"  predicted: {{step_time_ms: {ckpt.predicted.step_time_ms:.1f}, "
                 f"peak: {ckpt.predicted.peak // 2**20}MiB}}")
    if "pin" in policy.model_fields_set:
        lines.append(f"pin: {str(policy.pin).lower()}")
    if policy.pin_budget is not None:
        lines.append(f"pin_budget: {format_size(policy.pin_budget)}")
    if policy.pin_budget_per_node is not None:
        lines.append(f"pin_budget_per_node: {format_size(policy.pin_budget_per_node)}")
    if policy.compile is not None:
        spec = policy.compile
        backend = "" if "backend" not in spec.model_fields_set else f", backend: {_scalar(spec.backend)}"
        lines.append(f"compile: {{scope: {spec.scope}{backend}}}")
    return "\n".join(lines) + "\n"


def policy_text(plan: Plan, profile: Profile, source: Any, *, origin: str = "") -> str:
    """The YAML text of `plan` as a `checkpoint.mode: rules` policy (`plan_policy`, written by
    `policy_yaml`)."""
    return policy_yaml(plan_policy(plan, source), plan, profile, origin=origin)
