"""Per-module rules and plans (`checkpoint.mode: rules | auto`, `memory_budget`): torch only for now.

They run on torch's checkpoint and actcfg's offload engine, module by module; the DeepSpeed
route and the trainers' own switches checkpoint every selected module alike. Every backend that
is not torch refuses them with the same sentences, from here.
"""

from __future__ import annotations

from actcfg.backends.table import Entry, Meta, Rejection, Unsupported

__all__ = ["per_module_rejections", "plan_fields"]

_RULES = ("checkpoint.mode `rules` is torch-only for now: it chooses per module between keeping, "
          "checkpointing and offloading, which runs on torch's checkpoint and actcfg's offload engine")
_AUTO = ("checkpoint.mode `auto` is torch-only for now: the plan it asks for is written as "
         "`mode: rules`, which runs on torch's checkpoint and actcfg's offload engine")


def per_module_rejections(hint: str, code: str = "torch-only") -> tuple[Rejection, ...]:
    """The refusals of `mode: rules` and `mode: auto`, with the backend's way out (`hint`)."""
    return (Rejection("rules", code, _RULES, hint), Rejection("auto", code, _AUTO, hint))


def plan_fields(code: str, hint: str) -> dict[str, Entry]:
    """Entries for the fields of the rules and of a plan request (the mode is refused above)."""
    rule = Unsupported(code, "per-module rules are torch-only for now", hint)
    return {
        "checkpoint.rules.modules": rule,
        "checkpoint.rules.mode": rule,
        "checkpoint.rules.cpu_checkpointing": rule,
        "checkpoint.rules.save_ops": rule,
        "checkpoint.keep_last": rule,
        "checkpoint.max_inflight": rule,
        "checkpoint.predicted.step_time_ms": Meta("what actcfg plan predicted"),
        "checkpoint.predicted.peak": Meta("what actcfg plan predicted"),
        "memory_budget": Unsupported(
            code, "`memory_budget` is torch-only for now: actcfg plans with torch's checkpoint "
            "and its own offload engine", hint),
        "compile.scope": Unsupported(
            code, "`compile` is torch-only for now: it says how a plan is profiled and applied",
            hint),
        "compile.backend": Unsupported(
            code, "`compile` is torch-only for now: it says how a plan is profiled and applied",
            hint),
        "checkpoint.submodules": Unsupported(
            code, "`checkpoint.submodules` is torch-only for now: the parts of a block a plan "
            "checkpoints one by one are wrapped with torch's checkpoint", hint),
    }
