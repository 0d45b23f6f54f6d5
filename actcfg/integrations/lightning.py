"""An actcfg policy in a Lightning `Trainer`: the `ActivationPolicy` callback.

When it runs (Lightning 2.6.6, `Trainer._run`): `Callback.setup`, `LightningModule.setup`,
`configure_model`, then `Strategy.setup` (DDP wrapping, FSDP sharding, `deepspeed.initialize`
followed by `DeepSpeedStrategy._set_deepspeed_activation_checkpointing`), then `on_fit_start`.
A callback's `setup` runs before `configure_model`, so layers built there do not exist yet, and
Lightning calls no callback hook between `configure_model` and the strategy's setup: the policy
is applied in `on_fit_start`, the first hook after both. `setup` refuses, before any model
work, a strategy config that disagrees with the policy.

- `DeepSpeedStrategy`: Lightning calls `deepspeed.checkpointing.configure(mpu_=None,
  partition_activations, contiguous_checkpointing, checkpoint_in_cpu, profile)` and drops
  `synchronize_checkpoint_boundary` and `number_checkpoints`. configure() resets all six
  settings on every call, so actcfg's own call (all six keywords and the mpu) comes after
  Lightning's, in `on_fit_start`, and the globals are read back at `on_train_start` and after
  the first step. The strategy's `activation_checkpointing` section must agree with the policy.
  The strategy refuses any accelerator but CUDA.
- `FSDPStrategy` shards in its setup, so the policy checkpoints inside each FSDP unit, the order
  Lightning's own `activation_checkpointing_policy` uses (which stacks with a policy, and is
  refused). `ModelParallelStrategy` leaves sharding to your `configure_model`, so the policy is
  applied after `fully_shard` (FSDP2 keeps module names); to checkpoint before sharding, as
  torchtitan orders it, call `actcfg.apply` in `configure_model` before `fully_shard` instead.

The policy is removed in `teardown`, and in `on_exception` (Lightning skips `teardown` then).
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy

import actcfg
from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION, TABLE
from actcfg.backends.table import Key
from actcfg.integrations._guards import (
    backend_for,
    hf_checkpointed_modules,
    refuse_disagreeing_section,
    refuse_drifted_deepspeed_state,
    refuse_idle_offload,
    refuse_no_recompute,
    refuse_stacked,
)
from actcfg.policy.schema import Policy

__all__ = ["ActivationPolicy"]

_FIT = "fit"


def _keyword_default_section() -> dict[str, Any]:
    """The section `DeepSpeedStrategy(...)` writes when none of its activation keywords is
    passed (each keyword is named after its ds_config key): Lightning's defaults, not the
    user's statement. A config of your own that says exactly this is taken as unset too."""
    params = inspect.signature(DeepSpeedStrategy.__init__).parameters
    return {entry.key: params[entry.key].default for entry in TABLE.values()
            if isinstance(entry, Key) and entry.key in params}


class ActivationPolicy(pl.Callback):
    """Apply an actcfg policy to the LightningModule for `fit`, from fit start to teardown."""

    def __init__(self, policy: Any, *, backend: Backend | str | None = None, mpu: Any = None) -> None:
        # Validated now, so a bad policy fails where the Trainer is built, not after setup.
        self.policy: Policy = actcfg.load(policy, backends=() if backend is None else (backend,))
        self.backend = backend
        self.mpu = mpu
        self.applied: actcfg.AppliedPolicy | None = None
        """The live handle between on_fit_start and teardown, else None."""
        self._checked_step = False

    def _backend(self, trainer: pl.Trainer) -> Backend:
        return backend_for(self.policy, self.backend, isinstance(trainer.strategy, DeepSpeedStrategy))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a strategy config that disagrees with the policy, before any model work."""
        if stage != _FIT:
            return
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            section = (strategy.config or {}).get(SECTION)
            if section == _keyword_default_section():
                section = None
            refuse_disagreeing_section(section, self.policy, self._backend(trainer),
                                       "the DeepSpeedStrategy config")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply the policy: after configure_model and the strategy's setup (see the module doc)."""
        self.remove()
        mode = self.policy.checkpoint.mode
        if mode in ("full", "selective"):
            wrapped = _checkpoint_wrapped(pl_module)
            if wrapped:
                refuse_stacked(
                    f"torch's checkpoint_wrapper on {wrapped} (FSDPStrategy's "
                    "activation_checkpointing_policy, or your own apply_activation_checkpointing)",
                    "remove activation_checkpointing_policy from the strategy", self.policy)
            layers = hf_checkpointed_modules(pl_module)
            if layers:
                refuse_stacked(
                    f"Hugging Face activation checkpointing on `{layers[0]}`"
                    + (f" and {len(layers) - 1} more" if len(layers) > 1 else ""),
                    "call activation_checkpointing_disable() on the Hugging Face model", self.policy)
        self.applied = actcfg.apply(pl_module, self.policy, backend=self._backend(trainer), mpu=self.mpu)
        self._checked_step = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """DeepSpeed's globals still hold the policy when training starts."""
        refuse_drifted_deepspeed_state(self.applied, "at train start")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """After the first step: the policy's effects really happened."""
        if self._checked_step or self.applied is None:
            return
        self._checked_step = True
        refuse_idle_offload(
            self.applied, "training_step did not call it: call self(...) in training_step, or "
            "apply the policy with actcfg.apply to the submodule training_step calls")
        refuse_no_recompute(self.applied)
        refuse_drifted_deepspeed_state(self.applied, "after the first step")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo everything the policy did to the LightningModule."""
        self.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Undo the policy when fit raises (Lightning calls no teardown hook then)."""
        self.remove()

    def remove(self) -> None:
        """Undo the policy now; a no-op when none is on."""
        applied, self.applied = self.applied, None
        if applied is not None:
            applied.remove()


def _checkpoint_wrapped(module: Any) -> str:
    """Where torch's `checkpoint_wrapper` already wraps a module (first name and a count)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch built without torch.distributed has no such wrapper
        return ""
    names = [n for n, m in module.named_modules() if isinstance(m, CheckpointWrapper)]
    if not names:
        return ""
    return f"`{names[0]}`" + (f" and {len(names) - 1} more" if len(names) > 1 else "")

