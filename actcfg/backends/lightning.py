"""Lightning's `DeepSpeedStrategy`: its activation-checkpointing keywords and config section.

Lightning 2.6.6 passes the settings to `deepspeed.checkpointing.configure(mpu_=None,
partition_activations, contiguous_checkpointing, checkpoint_in_cpu, profile)`: it drops
`synchronize_checkpoint_boundary` and `number_checkpoints`, and passes no model-parallel unit
(`strategies/deepspeed.py`, `_set_deepspeed_activation_checkpointing`). The
`actcfg.integrations.lightning` callback configures DeepSpeed itself instead.
"""

from __future__ import annotations

from actcfg.backends import deepspeed
from actcfg.backends.table import Entry, Key, Meta, RoutedBy, Unsupported

__all__ = ["CONFIG_SECTION", "TABLE"]

CONFIG_SECTION = f"config.{deepspeed.SECTION}"
"""Where settings without a strategy keyword go: `DeepSpeedStrategy(config={...})`."""

_CALLBACK = "run the policy with actcfg.integrations.lightning.ActivationPolicy, which passes it on"

TABLE: dict[str, Entry] = {
    **{path: entry for path, entry in deepspeed.TABLE.items()
       if not isinstance(entry, Key)},  # Meta, routing and the torch-only fields: as DeepSpeed
    "checkpoint.mode": RoutedBy("the LightningModule", "route",
                                rejects=deepspeed.TABLE["checkpoint.mode"].rejects),
    "partition": Key(
        "partition_activations", needs_checkpoint=True,
        dropped="Lightning 2.6.6 passes it to configure() without a model-parallel unit "
                "(mpu_=None), so it shards nothing", dropped_fix=_CALLBACK),
    "contiguous": Unsupported(
        "fails-in-lightning",
        "`contiguous` fails in Lightning 2.6.6: it passes contiguous_checkpointing to configure() "
        "without number_checkpoints, and DeepSpeed asserts (Lightning-AI/pytorch-lightning#20329)",
        "remove `contiguous`, or run the policy with actcfg.integrations.lightning.ActivationPolicy, "
        "which passes number_checkpoints on"),
    "num_checkpoints": Key(
        f"{CONFIG_SECTION}.number_checkpoints", needs_checkpoint=True,
        dropped="Lightning 2.6.6 never passes number_checkpoints to configure()",
        dropped_fix=_CALLBACK),
    "cpu_checkpointing": Key("cpu_checkpointing", needs_checkpoint=True,
                             hint_without_checkpoint="offloading every activation is torch-only"),
    "synchronize": Key(
        "synchronize_checkpoint_boundary", needs_checkpoint=True,
        dropped="Lightning 2.6.6 never passes synchronize_checkpoint_boundary to configure()",
        dropped_fix=_CALLBACK),
    "profile": Key(f"{CONFIG_SECTION}.profile", needs_checkpoint=True),
}
"""Policy field -> DeepSpeedStrategy keyword (or a key of its `config` dict)."""

