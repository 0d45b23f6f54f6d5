"""Policy -> the Hugging Face `TrainingArguments` keywords for transformers' own checkpointing.

Pure: no I/O, no transformers import. Names come from `actcfg.backends.hf`. What transformers
cannot express is refused (TranslationError); `actcfg.integrations.hf` runs any policy instead.
"""

from __future__ import annotations

from typing import Any

from actcfg.backends import Backend
from actcfg.backends.hf import ARGUMENT, KWARGS, OLD_NAMES, TABLE
from actcfg.backends.table import MISSING, Key, field_value
from actcfg.policy.schema import Policy
from actcfg.translators._refuse import refuse_inexpressible

__all__ = ["to_hf"]


def to_hf(policy: Policy) -> dict[str, Any]:
    """`{"training_arguments": {...}, "training_arguments_before_5_24": {...}, "layers": ...,
    "warnings": [...]}` for `policy`.

    `training_arguments` are keywords of `transformers.TrainingArguments` (5.24 and later);
    `training_arguments_before_5_24` the same under the names earlier versions take (5.24 still
    takes them, with a deprecation warning, until v6). `layers` repeats the policy's module
    patterns, which must be the model's decoder layer classes (transformers checkpoints every
    GradientCheckpointingLayer and cannot choose).
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
    notes = [f"{'.'.join(w.path)}: {w.reason}" for w in warnings]
    before: dict[str, Any] | None = {
        OLD_NAMES[k]: ({n: x for n, x in v.items() if n != "offload"} if k == KWARGS else v)
        for k, v in arguments.items()}
    if kwargs.get("offload"):
        # Earlier versions have no `offload`: torch.utils.checkpoint would pass the unknown
        # keyword into the layer's forward, which swallows it, and nothing would be offloaded.
        before = None
        notes.append("cpu_checkpointing: transformers before 5.24 cannot offload (no `offload` "
                     "keyword); use 5.24 or later, or actcfg.integrations.hf.ActivationPolicyCallback")
    return {"training_arguments": arguments, "training_arguments_before_5_24": before,
            "layers": layers, "warnings": notes}
