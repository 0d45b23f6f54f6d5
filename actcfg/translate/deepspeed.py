"""Policy -> DeepSpeed: the ds_config `activation_checkpointing` section, the keyword
arguments of `deepspeed.checkpointing.configure`, and the route the runtime applies.

Pure: no I/O, no torch, no deepspeed import. Every key name lives once, in `TABLE`.
"""

from __future__ import annotations

from typing import Any

from actcfg.schema import Policy
from actcfg.translate._table import (
    Entry,
    Key,
    Meta,
    RoutedBy,
    Unsupported,
    check_expressible,
    get_field,
)

__all__ = ["CHECKPOINT_FUNCTION", "SECTION", "TABLE", "to_deepspeed"]

BACKEND = "deepspeed"
SECTION = "activation_checkpointing"
CHECKPOINT_FUNCTION = "deepspeed.checkpointing.checkpoint"

# actcfg field -> (ds_config JSON key, configure() kwarg). The JSON names and the kwarg
# names differ for four of the six; a trainer that read the kwarg name from the JSON
# (`checkpoint_in_cpu`) silently ran without CPU checkpointing (Lightning-AI/pytorch-lightning#10874).
TABLE: dict[str, Entry] = {
    "version": Meta("schema version of the policy file"),
    "backend": Meta("chooses the translator"),
    "checkpoint.mode": RoutedBy(
        "runtime", "route",
        rejects=(("selective", "op-level (selective) checkpointing is torch-only: DeepSpeed "
                  "recomputes whole modules; use `mode: full`, or translate for torch"),),
    ),
    "checkpoint.modules": RoutedBy("runtime", "route.modules"),
    "checkpoint.every": RoutedBy("runtime", "route.every"),
    "checkpoint.reentrant": Unsupported(
        "DeepSpeed always routes through deepspeed.checkpointing.checkpoint, which has no "
        "reentrant switch; remove `checkpoint.reentrant`, or translate for torch",
        explicit=True,
    ),
    "checkpoint.save_ops": Unsupported(
        "op-level saving is torch-only (create_selective_checkpoint_contexts)"
    ),
    "partition": Key("partition_activations", "partition_activations", needs_checkpoint=True),
    "contiguous": Key("contiguous_memory_optimization", "contiguous_checkpointing",
                      needs_checkpoint=True),
    "num_checkpoints": Key("number_checkpoints", "num_checkpoints", needs_checkpoint=True),
    "cpu_checkpointing": Key("cpu_checkpointing", "checkpoint_in_cpu", needs_checkpoint=True),
    "synchronize": Key("synchronize_checkpoint_boundary", "synchronize", needs_checkpoint=True),
    "profile": Key("profile", "profile", needs_checkpoint=True),
    "pin": Unsupported(
        "DeepSpeed always offloads into pinned host memory; remove `pin: false`, or translate "
        "for torch"
    ),
    "pin_budget": Unsupported(
        "DeepSpeed cannot bound its pinned host memory; remove `pin_budget`, or translate for torch"
    ),
}


def to_deepspeed(policy: Policy) -> dict[str, Any]:
    """DeepSpeed's names for `policy`: ds_config section, configure() kwargs and the route.

    Every JSON key and every kwarg is explicit: `configure` resets all six settings and then
    applies only the kwargs that are not None, so an omitted kwarg is a silent default.
    """
    check_expressible(TABLE, policy, BACKEND)
    section: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for path, entry in TABLE.items():
        if isinstance(entry, Key):
            value = get_field(policy, path)[0]
            section[entry.key] = value
            if entry.kwarg is not None:
                kwargs[entry.kwarg] = value
    ckpt = policy.checkpoint
    route = None
    if ckpt.mode != "none":
        route = {"function": CHECKPOINT_FUNCTION, "modules": list(ckpt.modules), "every": ckpt.every}
    return {SECTION: section, "configure_kwargs": kwargs, "route": route}
