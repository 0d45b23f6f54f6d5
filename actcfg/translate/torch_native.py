"""Policy -> the torch-native `WrapPlan` that `actcfg.apply` executes: which modules are
checkpointed through which torch function with which keyword arguments, and how saved
activations are offloaded.

Pure: no I/O and no torch import; the plan is plain data, and the runtime dispatches on it, so
what `actcfg translate --backend torch` prints is what runs. Every field's destination lives
once, in `actcfg.backends.torch.TABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from actcfg.backends import Backend
from actcfg.backends.table import MISSING, Key, field_value
from actcfg.backends.torch import CHECKPOINT_API, OFFLOAD_ENGINE, TABLE
from actcfg.schema import Policy
from actcfg.translate._refuse import refuse_inexpressible

__all__ = [
    "CHECKPOINT_API",
    "OFFLOAD_ENGINE",
    "CheckpointPlan",
    "ExternalCheckpointPlan",
    "OffloadPlan",
    "WrapPlan",
    "to_torch_native",
]


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Which modules are checkpointed, and through which torch function with which kwargs."""

    modules: tuple[str, ...]
    """fnmatch patterns, matched against each module's class names and qualified name."""
    every: int
    """Wrap every n-th matched module, in module order."""
    use_reentrant: bool
    """torch's `use_reentrant` kwarg, always passed explicitly."""
    preserve_rng_state: bool = True
    """torch's `preserve_rng_state` kwarg: replay dropout identically in recomputation."""
    selective_save_ops: tuple[str, ...] | None = None
    """Ops whose outputs are saved (`aten.mm` = every overload of `torch.ops.aten.mm`), given to
    `create_selective_checkpoint_contexts` as `context_fn`; None = full recomputation."""
    api: str = CHECKPOINT_API
    """Dotted name of the torch function each selected module's forward is run through."""

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
class ExternalCheckpointPlan:
    """The model checkpoints itself (`checkpoint.mode: external`): nothing is wrapped."""

    api: None = None
    """No function of actcfg's: the model's own calls checkpoint."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"api": None, "by": "the model"}


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Saved activations kept in host memory until backward (saved-tensor hooks)."""

    scope: Literal["checkpoint_inputs", "all_saved"]
    """`checkpoint_inputs`: only what checkpointed modules save (their inputs), the same as
    DeepSpeed cpu_checkpointing; `all_saved`: every activation autograd saves outside a
    checkpointed call (all of them without checkpointing; with `mode: external`, what the
    model's own checkpointed calls keep)."""
    pin: bool
    """Page-locked host buffers."""
    pin_budget: int | None
    """Most pinned bytes held; past it, pageable memory. None = unbounded."""
    engine: str = OFFLOAD_ENGINE
    """What offloads them."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {"engine": self.engine, "scope": self.scope, "pin": self.pin,
                "pin_budget": self.pin_budget}


@dataclass(frozen=True, kw_only=True)
class WrapPlan:
    """What the torch runtime does to a model: checkpoint wrapping and activation offload."""

    checkpoint: CheckpointPlan | ExternalCheckpointPlan | None
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
            value = field_value(policy, path)[0]
            if value is not MISSING:
                out[entry.key] = value
    return out


def to_torch_native(policy: Policy) -> WrapPlan:
    """The torch-native plan for `policy`; TranslationError for DeepSpeed-only settings."""
    refuse_inexpressible(policy, Backend.TORCH)
    dest = _destinations(policy)
    mode = dest["checkpoint"]
    checkpoint: CheckpointPlan | ExternalCheckpointPlan | None = None
    if mode == "external":
        checkpoint = ExternalCheckpointPlan()
    elif mode != "none":
        checkpoint = CheckpointPlan(
            modules=tuple(dest["checkpoint.modules"]),
            every=dest["checkpoint.every"],
            use_reentrant=dest["checkpoint.use_reentrant"],
            selective_save_ops=(tuple(dest["checkpoint.selective_save_ops"])
                                if mode == "selective" else None),
        )
    offload = None
    if dest["offload.scope"]:
        offload = OffloadPlan(
            scope="checkpoint_inputs" if mode in ("full", "selective") else "all_saved",
            pin=dest["offload.pin"],
            pin_budget=dest["offload.pin_budget"],
        )
    return WrapPlan(checkpoint=checkpoint, offload=offload)
