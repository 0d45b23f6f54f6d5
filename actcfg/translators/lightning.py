"""Policy -> Lightning's `DeepSpeedStrategy` keywords, or the `config` section when a setting has none.

Pure: no I/O, no lightning import. Names come from `actcfg.backends.lightning`. Each setting
Lightning 2.6.6 drops on its way to DeepSpeed comes back as a warning that says so; the
`actcfg.integrations.lightning` callback configures DeepSpeed itself and drops nothing.
"""

from __future__ import annotations

from typing import Any

from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION
from actcfg.backends.lightning import CONFIG_SECTION, TABLE
from actcfg.backends.table import Key, field_value
from actcfg.policy.schema import Policy
from actcfg.translators._refuse import refuse_inexpressible
from actcfg.translators.deepspeed import deepspeed_route

__all__ = ["to_lightning"]


def to_lightning(policy: Policy) -> dict[str, Any]:
    """`{"strategy_kwargs": ..., "config": ..., "usage": ..., "route": ..., "warnings": [...]}`.

    `DeepSpeedStrategy(config=...)` ignores every keyword of the strategy (cpu_checkpointing
    too), so the output is one or the other: keywords when each setting has one, else a
    complete `activation_checkpointing` section for the user's DeepSpeed config.
    """
    warnings = refuse_inexpressible(policy, Backend.LIGHTNING)
    kwargs: dict[str, Any] = {}
    section: dict[str, Any] = {}
    needs_config = False
    for path, entry in TABLE.items():
        if not isinstance(entry, Key):
            continue
        value, default, _ = field_value(policy, path)
        in_config = entry.key.startswith(f"{CONFIG_SECTION}.")
        section[entry.key.removeprefix(f"{CONFIG_SECTION}.")] = value
        if in_config:
            needs_config = needs_config or value != default
        else:
            kwargs[entry.key] = value
    if needs_config:
        strategy_kwargs: dict[str, Any] | None = None
        config: dict[str, Any] | None = {SECTION: section}
        usage = (f"DeepSpeedStrategy(config=...): merge this `{SECTION}` section into your DeepSpeed "
                 "config; DeepSpeedStrategy ignores all its keywords once config= is given")
    else:
        strategy_kwargs, config = kwargs, None
        usage = "DeepSpeedStrategy(**strategy_kwargs)"
    route = deepspeed_route(policy)
    return {"strategy_kwargs": strategy_kwargs, "config": config, "usage": usage, "route": route,
            "warnings": [f"{'.'.join(w.path)}: {w.reason}; {w.hint}" for w in warnings]}
