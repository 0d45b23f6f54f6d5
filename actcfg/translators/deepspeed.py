"""Policy -> DeepSpeed: the ds_config `activation_checkpointing` section, the keyword arguments
of `deepspeed.checkpointing.configure`, and the route the runtime applies.

Pure: no I/O, no torch, no deepspeed import. Every name comes from `actcfg.backends.deepspeed`.
"""

from __future__ import annotations

from typing import Any

from actcfg.backends import Backend
from actcfg.backends.deepspeed import CHECKPOINT_FUNCTION, SECTION, TABLE
from actcfg.backends.table import Key, field_value
from actcfg.policy.schema import Policy
from actcfg.translators._refuse import refuse_inexpressible

__all__ = ["CHECKPOINT_FUNCTION", "FILL_IN", "NUM_CHECKPOINTS_FROM_ROUTE", "SECTION", "deepspeed_route",
           "to_deepspeed"]

FILL_IN = "fill_in"
"""Output key: what the runtime fills in that the policy leaves unset, and from where."""
NUM_CHECKPOINTS_FROM_ROUTE = (
    "the number of modules the route selects: actcfg.apply passes it to configure(); "
    "passed as null, deepspeed.checkpointing.configure asserts"
)


def deepspeed_route(policy: Policy) -> dict[str, Any] | None:
    """How DeepSpeed's checkpoint function is reached under `policy`: called by the model
    itself (`external`), routed by actcfg over the policy's modules, or not at all (`none`).
    The DeepSpeed and Lightning translations both report it."""
    ckpt = policy.checkpoint
    if ckpt.mode == "external":
        return {"function": CHECKPOINT_FUNCTION, "called_by": "the model"}
    if ckpt.mode != "none":
        return {"function": CHECKPOINT_FUNCTION, "modules": list(ckpt.modules), "every": ckpt.every}
    return None


def to_deepspeed(policy: Policy) -> dict[str, Any]:
    """DeepSpeed's names for `policy`: ds_config section, configure() kwargs and the route.

    Every JSON key and every kwarg is explicit: `configure` resets all six settings and then
    applies only the kwargs that are not None, so an omitted kwarg is a silent default.
    """
    refuse_inexpressible(policy, Backend.DEEPSPEED)
    section: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for path, entry in TABLE.items():
        if isinstance(entry, Key):
            value = field_value(policy, path)[0]
            section[entry.key] = value
            if entry.kwarg is not None:
                kwargs[entry.kwarg] = value
    route = deepspeed_route(policy)
    out: dict[str, Any] = {SECTION: section, "configure_kwargs": kwargs, "route": route}
    if policy.contiguous and policy.num_checkpoints is None:
        # The schema allows this only when the runtime routes the modules: it knows their count.
        out[FILL_IN] = {"num_checkpoints": NUM_CHECKPOINTS_FROM_ROUTE}
    return out
