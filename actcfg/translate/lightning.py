"""Policy -> Lightning's `DeepSpeedStrategy` keywords and the `config` section they miss.

Pure: no I/O, no lightning import. Names come from `actcfg.backends.lightning`. Each setting
Lightning 2.6.6 drops on its way to DeepSpeed comes back as a warning that says so; the
`actcfg.integrations.lightning` callback configures DeepSpeed itself and drops nothing.
"""

from __future__ import annotations

from typing import Any

from actcfg.backends import Backend
from actcfg.backends.deepspeed import CHECKPOINT_FUNCTION
from actcfg.backends.lightning import TABLE
from actcfg.backends.table import Key, field_value
from actcfg.schema import Policy
from actcfg.translate._refuse import refuse_inexpressible

__all__ = ["to_lightning"]


def to_lightning(policy: Policy) -> dict[str, Any]:
    """`{"strategy_kwargs": {...}, "config": {...}, "route": ..., "warnings": [...]}`."""
    warnings = refuse_inexpressible(policy, Backend.LIGHTNING)
    kwargs: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for path, entry in TABLE.items():
        if not isinstance(entry, Key):
            continue
        value = field_value(policy, path)[0]
        if entry.key.startswith("config."):
            *parents, leaf = entry.key.removeprefix("config.").split(".")
            node = config
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        else:
            kwargs[entry.key] = value
    ckpt = policy.checkpoint
    route: dict[str, Any] | None = None
    if ckpt.mode == "external":
        route = {"function": CHECKPOINT_FUNCTION, "called_by": "the model"}
    elif ckpt.mode != "none":
        route = {"function": CHECKPOINT_FUNCTION, "modules": list(ckpt.modules), "every": ckpt.every}
    return {"strategy_kwargs": kwargs, "config": config, "route": route,
            "warnings": [f"{'.'.join(w.path)}: {w.reason}; {w.hint}" for w in warnings]}
