"""torch: the `WrapPlan` that `actcfg.apply` executes (torch.utils.checkpoint and actcfg's offload engine)."""

from __future__ import annotations

from actcfg.backends._deepspeed_only import deepspeed_only
from actcfg.backends.table import Entry, Key, Meta

__all__ = ["CHECKPOINT_API", "OFFLOAD_ENGINE", "TABLE"]

CHECKPOINT_API = "torch.utils.checkpoint.checkpoint"
"""The function that checkpoints each selected module, in every mode: it keeps module,
parameter and state_dict names, composes with FSDP2 and torch.compile (dynamo traces it as a
higher-order op), and takes `use_reentrant` and `context_fn`."""
OFFLOAD_ENGINE = "actcfg.offload.OffloadEngine"
"""What offloads saved activations: saved-tensor hooks with grouped side-stream copies."""

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
    **deepspeed_only(),
}
"""Policy field -> WrapPlan attribute (and the torch keyword argument it becomes)."""
