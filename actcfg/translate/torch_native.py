"""Policy -> the torch-native `WrapPlan` the runtime executes: which checkpoint API wraps
which modules with which kwargs, and how saved activations are offloaded.

Pure: no I/O and no torch import; the plan is plain data. Every field's destination lives
once, in `TABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from actcfg.schema import Policy
from actcfg.errors import TranslationError
from actcfg.translate._table import (
    MISSING,
    Entry,
    Key,
    Meta,
    Unsupported,
    check_expressible,
    get_field,
)

__all__ = [
    "COMPOSABLE_API",
    "REENTRANT_API",
    "TABLE",
    "CheckpointPlan",
    "OffloadPlan",
    "WrapPlan",
    "to_torch_native",
]

BACKEND = "torch"
# Composable checkpoint works through hooks, so module, parameter and state_dict names stay
# unchanged (checkpoint_wrapper inserts `_checkpoint_wrapped_module.`, pytorch#117399); it
# refuses use_reentrant=True, so reentrant policies go through the functional API.
COMPOSABLE_API = "torch.distributed._composable.checkpoint"
REENTRANT_API = "torch.utils.checkpoint.checkpoint"

_DS_ONLY = "`{key}` is DeepSpeed-only ({what}); torch has no such setting: remove it, or translate for deepspeed"

# actcfg field -> WrapPlan attribute (and the torch keyword argument it becomes).
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
    "partition": Unsupported(_DS_ONLY.format(
        what="partition_activations; torch's analogue is tensor-parallel input_reshard",
        key="partition")),
    "contiguous": Unsupported(_DS_ONLY.format(what="contiguous_memory_optimization",
                                              key="contiguous")),
    "num_checkpoints": Unsupported(_DS_ONLY.format(what="number_checkpoints",
                                                   key="num_checkpoints")),
    "synchronize": Unsupported(_DS_ONLY.format(what="synchronize_checkpoint_boundary",
                                               key="synchronize")),
    "profile": Unsupported(_DS_ONLY.format(what="checkpoint profiling", key="profile")),
}


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Which modules are checkpointed, and through which torch API with which kwargs."""

    modules: tuple[str, ...]
    """fnmatch patterns, matched against each module's class name and qualified name."""
    every: int
    """Wrap every n-th matched module, in module order."""
    use_reentrant: bool
    """torch's `use_reentrant` kwarg, always passed explicitly."""
    preserve_rng_state: bool = True
    """torch's `preserve_rng_state` kwarg: replay dropout identically in recomputation."""
    selective_save_ops: tuple[str, ...] | None = None
    """Ops whose outputs are saved (`aten.mm` = `torch.ops.aten.mm`, every overload), for
    `create_selective_checkpoint_contexts`; None = full recomputation."""
    api: str
    """Dotted name of the torch function that wraps each module."""

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments `api` takes (the runtime adds `context_fn` for selective)."""
        return {"use_reentrant": self.use_reentrant, "preserve_rng_state": self.preserve_rng_state}

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {
            "api": self.api,
            "modules": list(self.modules),
            "every": self.every,
            "use_reentrant": self.use_reentrant,
            "preserve_rng_state": self.preserve_rng_state,
            "selective_save_ops": (None if self.selective_save_ops is None
                                   else list(self.selective_save_ops)),
        }


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Saved activations kept in host memory until backward (saved-tensor hooks)."""

    scope: Literal["checkpoint_inputs", "all_saved"]
    """`checkpoint_inputs`: only what checkpointed modules save (their inputs), the same as
    DeepSpeed cpu_checkpointing; `all_saved`: every saved activation (no checkpointing)."""
    pin: bool
    """Page-locked host buffers."""
    pin_budget: int | None
    """Most pinned bytes held; past it, pageable memory. None = unbounded."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {"scope": self.scope, "pin": self.pin, "pin_budget": self.pin_budget}


@dataclass(frozen=True, kw_only=True)
class WrapPlan:
    """What the torch runtime does to a model: checkpoint wrapping and activation offload."""

    checkpoint: CheckpointPlan | None
    offload: OffloadPlan | None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
            "offload": None if self.offload is None else self.offload.to_json(),
        }


def _destinations(policy: Policy) -> dict[str, Any]:
    """WrapPlan attribute path -> value, for every `Key` entry the policy's variant has."""
    out: dict[str, Any] = {}
    for path, entry in TABLE.items():
        if isinstance(entry, Key):
            value = get_field(policy, path)[0]
            if value is not MISSING:
                out[entry.key] = value
    return out


def to_torch_native(policy: Policy) -> WrapPlan:
    """The torch-native plan for `policy`; TranslationError for DeepSpeed-only settings."""
    check_expressible(TABLE, policy, BACKEND)
    dest = _destinations(policy)
    checkpoint = None
    mode = dest["checkpoint"]
    if mode != "none":
        reentrant = dest["checkpoint.use_reentrant"]
        if mode == "selective" and reentrant:
            raise TranslationError(
                "checkpoint.reentrant", BACKEND,
                "selective checkpointing runs only on torch's non-reentrant checkpoint; "
                "remove `reentrant: true`, or use `mode: full`",
            )
        checkpoint = CheckpointPlan(
            modules=tuple(dest["checkpoint.modules"]),
            every=dest["checkpoint.every"],
            use_reentrant=reentrant,
            selective_save_ops=(tuple(dest["checkpoint.selective_save_ops"])
                                if mode == "selective" else None),
            api=REENTRANT_API if reentrant else COMPOSABLE_API,
        )
    offload = None
    if dest["offload.scope"]:
        offload = OffloadPlan(
            scope="all_saved" if mode == "none" else "checkpoint_inputs",
            pin=dest["offload.pin"],
            pin_budget=dest["offload.pin_budget"],
        )
    return WrapPlan(checkpoint=checkpoint, offload=offload)
