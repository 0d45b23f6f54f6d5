"""DeepSpeed: the ds_config `activation_checkpointing` section and `deepspeed.checkpointing.configure`.

The JSON names and the configure() keywords differ for four of the six settings; a trainer that
read the keyword's name from the JSON (`checkpoint_in_cpu`) silently ran without CPU
checkpointing (Lightning-AI/pytorch-lightning#10874). Every name lives here, once.
"""

from __future__ import annotations

from actcfg.backends._torch_only import per_module_rejections, plan_fields
from actcfg.backends.table import Advice, Entry, Key, Meta, Rejection, RoutedBy, Unsupported

__all__ = ["CHECKPOINT_FUNCTION", "SECTION", "TABLE"]

SECTION = "activation_checkpointing"
"""The ds_config section DeepSpeed reads these settings from."""
CHECKPOINT_FUNCTION = "deepspeed.checkpointing.checkpoint"
"""What the checkpointed modules must be called through for any of the settings to act."""

_SET_TORCH = "or set `backend: torch`"

TABLE: dict[str, Entry] = {
    "version": Meta("schema version of the policy file"),
    "backend": Meta("chooses the translator"),
    "checkpoint.mode": RoutedBy(
        "runtime", "route",
        rejects=(
            Rejection(
                "selective", "torch-only",
                "checkpoint.mode `selective` is torch-only: DeepSpeed recomputes whole modules",
                f"use `mode: full`, {_SET_TORCH}"),
            *per_module_rejections("set `backend: torch`"),
        ),
    ),
    "checkpoint.modules": RoutedBy("runtime", "route.modules"),
    "checkpoint.every": RoutedBy("runtime", "route.every"),
    "checkpoint.reentrant": Unsupported(
        "torch-only",
        "`checkpoint.reentrant` is torch-only: DeepSpeed always routes through "
        f"{CHECKPOINT_FUNCTION}, which has no reentrant switch",
        f"remove `reentrant`, {_SET_TORCH}",
        explicit=True,
    ),
    "checkpoint.save_ops": Unsupported(
        "torch-only", "`checkpoint.save_ops` is torch-only (op-level saving)",
        f"remove `save_ops`, {_SET_TORCH}"),
    "partition": Key(
        "partition_activations", "partition_activations", needs_checkpoint=True,
        advice=Advice(
            True, "partition-needs-model-parallel",
            "`partition` shards checkpointed activations across the model-parallel group; it "
            "shards nothing without a group of size > 1, and apply() refuses it then",
            "pass `mpu=` (model-parallel size > 1) to actcfg.apply, or remove `partition`"),
    ),
    "contiguous": Key("contiguous_memory_optimization", "contiguous_checkpointing",
                      needs_checkpoint=True),
    "num_checkpoints": Key("number_checkpoints", "num_checkpoints", needs_checkpoint=True),
    "cpu_checkpointing": Key("cpu_checkpointing", "checkpoint_in_cpu", needs_checkpoint=True,
                             hint_without_checkpoint="offloading every activation is torch-only"),
    "synchronize": Key("synchronize_checkpoint_boundary", "synchronize", needs_checkpoint=True),
    "profile": Key("profile", "profile", needs_checkpoint=True),
    "pin": Unsupported(
        "torch-only", "`pin: false` is torch-only: DeepSpeed always offloads into pinned host memory",
        f"remove `pin`, {_SET_TORCH}"),
    "pin_budget": Unsupported(
        "torch-only", "`pin_budget` is torch-only: DeepSpeed cannot bound its pinned host memory",
        f"remove `pin_budget`, {_SET_TORCH}"),
    "pin_budget_per_node": Unsupported(
        "torch-only", "`pin_budget_per_node` is torch-only: DeepSpeed cannot bound the pinned host "
        "memory of a node's ranks", f"remove `pin_budget_per_node`, {_SET_TORCH}"),
    **plan_fields("torch-only", "set `backend: torch`"),
}
"""Policy field -> where DeepSpeed takes it (`Key.key`: ds_config JSON, `Key.kwarg`: configure())."""
