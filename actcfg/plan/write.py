"""A plan as an explicit policy file: `checkpoint.mode: rules`, one rule per choice, every
candidate block named, with what the plan predicted. Pure: text out, nothing written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from actcfg.plan.model import OFFLOADS, RULE_OF, Profile
from actcfg.plan.solve import Plan
from actcfg.runtime.reports import memory_size
from actcfg.policy.schema import format_size

__all__ = ["exact_pattern", "policy_text"]

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


def _mib_up(n: int) -> str:
    return f"{math.ceil(n / 2**20)}MiB"


def policy_text(plan: Plan, profile: Profile, source: Any, *, origin: str = "") -> str:
    """The YAML text of `plan` as a `checkpoint.mode: rules` policy, keeping the settings of
    the `mode: auto` policy it was planned for (`source`: backend; pin and the pin budgets where a
    rule offloads).

    Blocks that keep everything get a `mode: none` rule too, so every candidate is named and
    the offload engine starts each reload one block ahead. `keep_last` and `max_inflight` are
    written when a rule offloads: the plan's choices are explicit, so `keep_last` is 0 (the
    blocks it keeps at the turn are `mode: none` rules of their own).
    """
    order: list[str] = []
    members: dict[str, list[str]] = {}
    for name, choice in zip(plan.blocks, plan.choices):
        if choice not in members:
            order.append(choice)
            members[choice] = []
        members[choice].append(name)
    lines = [
        f"# Written by actcfg plan{f' from {origin}' if origin else ''}: the fastest per-module "
        f"choices whose predicted peak fits memory_budget {format_size(plan.budget)}",
        f"# ({profile.device} profile; without a policy the step took {profile.plain_step_ms:.1f} ms "
        f"and peaked at {memory_size(profile.plain_peak)}). Check it with `actcfg verify`.",
        "version: 1",
        f"backend: {source.backend.value}",
        "checkpoint:",
        "  mode: rules",
        "  rules:",
    ]
    for choice in order:
        rule = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}"
                         for k, v in RULE_OF[choice].items())
        names = ", ".join(_scalar(exact_pattern(n)) for n in members[choice])
        lines.append(f"    - {{modules: [{names}], {rule}}}")
    offloads = any(c in OFFLOADS for c in plan.choices)
    if offloads:
        lines += ["  keep_last: 0", f"  max_inflight: {plan.max_inflight}"]
    lines.append(f"  predicted: {{step_time_ms: {max(plan.step_ms, 0.1):.1f}, peak: {_mib_up(plan.peak)}}}")
    # Host-memory settings only where something offloads (else they would do nothing: a warning).
    if offloads and not source.pin:
        lines.append("pin: false")
    if offloads and source.pin_budget is not None:
        lines.append(f"pin_budget: {format_size(source.pin_budget)}")
    if offloads and source.pin_budget_per_node is not None:
        lines.append(f"pin_budget_per_node: {format_size(source.pin_budget_per_node)}")
    return "\n".join(lines) + "\n"
