"""torch: the `WrapPlan` that `actcfg.apply` executes (torch.utils.checkpoint and actcfg's offload engine)."""

from __future__ import annotations

from actcfg.backends._deepspeed_only import deepspeed_only
from actcfg.backends.table import Entry, Key, Meta

__all__ = ["CHECKPOINT_API", "COMPILE_API", "OFFLOAD_ENGINE", "PLANNER", "TABLE"]

CHECKPOINT_API = "torch.utils.checkpoint.checkpoint"
"""The function that checkpoints each selected module, in every mode: it keeps module,
parameter and state_dict names, composes with FSDP2 and torch.compile (dynamo traces it as a
higher-order op), and takes `use_reentrant` and `context_fn`."""
COMPILE_API = "torch.compile"
"""What compiles a policy's `compile:` scope (each block's forward, or the model's)."""
OFFLOAD_ENGINE = "actcfg.runtime.offload.OffloadEngine"
"""What offloads saved activations: saved-tensor hooks with grouped side-stream copies."""
PLANNER = "actcfg.plan"
"""What turns `checkpoint.mode: auto` into per-module rules: a profile of one training step,
then the fastest choices whose predicted peak fits `memory_budget`."""

TABLE: dict[str, Entry] = {
    "version": Meta("schema version of the policy file"),
    "backend": Meta("chooses the translator"),
    "checkpoint.mode": Key("checkpoint"),
    "checkpoint.modules": Key("checkpoint.modules"),
    "checkpoint.every": Key("checkpoint.every"),
    "checkpoint.reentrant": Key("checkpoint.use_reentrant", "use_reentrant"),
    "checkpoint.save_ops": Key("checkpoint.selective_save_ops", "context_fn"),
    "cpu_checkpointing": Key("offload.scope"),
    "pin": Key("offload.pin"),
    "pin_budget": Key("offload.pin_budget"),
    "pin_budget_per_node": Key("offload.pin_budget_per_node"),
    # Read by the translator rule by rule (field_value does not look inside lists).
    "checkpoint.rules.modules": Key("checkpoint.rules[].modules"),
    "checkpoint.rules.mode": Key("checkpoint.rules[].checkpoint"),
    "checkpoint.rules.cpu_checkpointing": Key("checkpoint.rules[].offload"),
    "checkpoint.rules.save_ops": Key("checkpoint.rules[].selective_save_ops", "context_fn"),
    "checkpoint.keep_last": Key("offload.keep_last"),
    "checkpoint.max_inflight": Key("offload.max_inflight"),
    "checkpoint.predicted.step_time_ms": Meta("what actcfg plan predicted; verify compares"),
    "checkpoint.predicted.peak": Meta("what actcfg plan predicted; verify compares"),
    "memory_budget": Key("checkpoint.memory_budget"),
    "checkpoint.submodules": Key("checkpoint.submodules"),
    # compiled after the checkpoint and offload plans (actcfg.runtime.compiling)
    "compile.scope": Key("compile.scope"),
    "compile.backend": Key("compile.backend", "backend"),
    **deepspeed_only(),
}
"""Policy field -> WrapPlan attribute (and the torch keyword argument it becomes)."""
