"""Policy -> the Hugging Face `TrainingArguments` keywords for transformers' own checkpointing.

Pure: no I/O, no transformers import. Names come from `actcfg.backends.hf`. What transformers
cannot express is refused (TranslationError); `actcfg.integrations.hf` runs any policy instead.
"""

from __future__ import annotations

from typing import Any

from actcfg.backends import Backend
from actcfg.backends.hf import ARGUMENT, KWARGS, TABLE
from actcfg.backends.table import MISSING, Key, field_value
from actcfg.schema import Policy
from actcfg.translate._refuse import refuse_inexpressible

__all__ = ["to_hf"]


def to_hf(policy: Policy) -> dict[str, Any]:
    """`{"training_arguments": {...}, "layers": ..., "warnings": [...]}` for `policy`.

    `training_arguments` are keywords of `transformers.TrainingArguments`; `layers` repeats the
    policy's module patterns, which must be the model's decoder layer classes (transformers
    checkpoints every GradientCheckpointingLayer and cannot choose).
    """
    warnings = refuse_inexpressible(policy, Backend.HF)
    mode = policy.checkpoint.mode
    kwargs: dict[str, Any] = {}
    if mode != "none":
        for path, entry in TABLE.items():
            if isinstance(entry, Key) and entry.key.startswith(f"{KWARGS}."):
                value = field_value(policy, path)[0]
                if value is not MISSING:
                    kwargs[entry.key.removeprefix(f"{KWARGS}.")] = value
        kwargs.setdefault("use_reentrant", False)  # transformers' own default, said explicitly
    arguments: dict[str, Any] = {ARGUMENT: mode != "none"}
    if kwargs:
        arguments[KWARGS] = kwargs
    layers = list(policy.checkpoint.modules) if mode in ("full", "selective") else None
    return {"training_arguments": arguments, "layers": layers,
            "warnings": [f"{'.'.join(w.path)}: {w.reason}" for w in warnings]}
