"""An actcfg policy in Hugging Face `Trainer`: `ActivationPolicyCallback`.

When it runs (transformers 5.24, accelerate 1.15): `Trainer.train()` turns on HF's own
activation checkpointing (`TrainingArguments(gradient_checkpointing=True)`), then, in
`_prepare_for_training`, runs `accelerator.prepare`, which wraps the model (DDP,
`DeepSpeedEngine` through `deepspeed.initialize`, FSDP, torch.compile) and only then calls
`on_train_begin`. Its `model` is `Trainer.model`: the unwrapped model, whose modules the
wrappers call, so the policy's hooks and forward overrides on submodules run under any of them
(with FSDP, `Trainer.model` is the sharded model itself). Neither transformers nor accelerate
ever calls `deepspeed.checkpointing.configure`, so a ds_config `activation_checkpointing` section
does nothing there; this callback configures DeepSpeed itself, after `deepspeed.initialize`.

Trainer has no hook for an exception in `train()`: a run that raises leaves the policy on the
model. The next `train()` removes it before applying afresh; call `callback.remove()` to undo
it at once.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import actcfg
from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION
from actcfg.backends.hf import ARGUMENT, KWARGS, OLD_NAMES
from actcfg.backends.hf import TABLE as HF_TABLE
from actcfg.errors import PolicyApplyError
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

__all__ = ["ActivationPolicyCallback"]

_AC, _AC_KWARGS = ARGUMENT, KWARGS  # transformers 5.24's names
_GC, _GC_KWARGS = OLD_NAMES[ARGUMENT], OLD_NAMES[KWARGS]  # the names before (5.17 has only these)
# The key of the kwargs that turns on transformers' own offload, from the hf table.
_OFFLOAD = HF_TABLE["cpu_checkpointing"].key.removeprefix(f"{KWARGS}.")


class ActivationPolicyCallback(TrainerCallback):
    """Apply an actcfg policy to the model `Trainer` trains, from train begin to train end."""

    def __init__(self, policy: Any, *, backend: Backend | str | None = None, mpu: Any = None) -> None:
        # Validated now, so a bad policy fails where the Trainer is built, not after setup.
        self.policy: Policy = actcfg.load(policy, backends=() if backend is None else (backend,))
        self.backend = backend
        self.mpu = mpu
        self.applied: actcfg.AppliedPolicy | None = None
        """The live handle between on_train_begin and on_train_end, else None."""
        self._checked_step = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        """Refuse what cannot work, then apply the policy, before the first step."""
        self.remove()  # a train() that raised left the last application on the model
        if model is None:
            raise PolicyApplyError("Trainer called on_train_begin without a model; "
                                   "ActivationPolicyCallback needs Trainer(model=...)")
        plugin = getattr(args, "deepspeed_plugin", None)
        backend = backend_for(self.policy, self.backend, plugin is not None)
        self._refuse_conflicts(args, model, backend)
        if plugin is not None:
            section = (getattr(plugin, "deepspeed_config", None) or {}).get(SECTION)
            refuse_disagreeing_section(section, self.policy, backend, "the ds_config")
        self.applied = actcfg.apply(model, self.policy, backend=backend, mpu=self.mpu)
        self._checked_step = False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """After the first step: the policy's effects really happened."""
        if self._checked_step or self.applied is None:
            return
        self._checked_step = True
        try:
            refuse_idle_offload(self.applied, "Trainer did not call it")
            refuse_no_recompute(self.applied)
            refuse_drifted_deepspeed_state(self.applied, "after the first step")
        except PolicyApplyError:
            self.remove()  # Trainer has no exception hook: take the policy off before raising
            raise

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Undo everything the policy did to the model."""
        self.remove()

    def remove(self) -> None:
        """Undo the policy now (also after a `train()` that raised); a no-op when none is on."""
        applied, self.applied = self.applied, None
        if applied is not None:
            applied.remove()

    def _refuse_conflicts(self, args: TrainingArguments, model: Any, backend: Backend) -> None:
        mode = self.policy.checkpoint.mode
        hf_on = bool(getattr(args, _AC, None) or getattr(args, _GC, None))
        layers = hf_checkpointed_modules(model)
        if mode in ("full", "selective"):
            if hf_on:
                refuse_stacked(f"TrainingArguments({_GC}=True)",
                               f"set {_GC}=False (or {_AC}=False, its new name)", self.policy)
            if layers:
                refuse_stacked(
                    f"the model's Hugging Face activation checkpointing (on in {_short(layers)}; "
                    "activation_checkpointing_enable() or gradient_checkpointing_enable() was called)",
                    "call model.activation_checkpointing_disable() before training", self.policy)
        elif mode == "external":
            if not layers and hasattr(model, "supports_gradient_checkpointing"):
                raise PolicyApplyError(
                    "the actcfg policy's `checkpoint: {mode: external}` leaves checkpointing to the "
                    f"model, but its Hugging Face activation checkpointing is off "
                    f"(TrainingArguments({_GC}=False)), so nothing would recompute: set "
                    f"{_GC}=True, or write `checkpoint: {{mode: full, modules: [...]}}`"
                )
            hf_kwargs = getattr(args, _AC_KWARGS, None) or getattr(args, _GC_KWARGS, None) or {}
            if self.policy.cpu_checkpointing and hf_kwargs.get(_OFFLOAD):
                raise PolicyApplyError(
                    f"TrainingArguments({_GC_KWARGS}={{'{_OFFLOAD}': True}}) and the actcfg policy's "
                    f"cpu_checkpointing would both offload the checkpointed inputs: remove {_OFFLOAD} "
                    f"from {_GC_KWARGS} (actcfg offloads around HF's checkpointing), or set "
                    "`cpu_checkpointing: false`"
                )
            if backend is Backend.DEEPSPEED and layers:
                raise PolicyApplyError(
                    "the actcfg policy's `checkpoint: {mode: external}` with backend deepspeed "
                    "configures DeepSpeed's activation checkpointing, but HF's own checkpointing "
                    "calls torch.utils.checkpoint, which ignores it: pass backend='torch' to "
                    "ActivationPolicyCallback, or write `checkpoint: {mode: full, modules: [...]}` "
                    "so actcfg routes the layers through deepspeed.checkpointing.checkpoint"
                )


def _short(names: list[str], limit: int = 2) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

