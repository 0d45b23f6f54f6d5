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

`checkpoint.mode: auto` plans on the first batch the Trainer feeds: a forward pre-hook on the
model catches the first training call (inside `Trainer.compute_loss`, with the keyword
arguments it passes the model, `num_items_in_batch` included), profiles steps on that batch with
the loss `compute_loss` takes from the outputs (`outputs["loss"]`, else `outputs[0]`), the outputs
let go before backward as `compute_loss` lets them go, and, with `gradient_accumulation_steps`
above 1, every parameter gradient added to each peak (a later micro-batch starts with them),
applies the plan, and lets the call go on: the step is the Trainer's first, before its first optimizer step.
The profile puts back gradients, buffers, training mode and the CPU and CUDA RNG state, and
touches neither the optimizer nor the data loader, so the run sees what it would have seen with
the plan applied at train begin. The plan is written to `output_dir/actcfg-plan.yaml`;
`plan_file=` applies such a file at train begin instead, with no profile. Under FSDP2
(`fsdp_config={"fsdp_version": 2}`) the profile runs on the sharded model, on every rank
together, and every rank applies one plan (`actcfg.plan.sharded`). Under the DeepSpeed engine
(`deepspeed=`) with ZeRO stage 0, 1 or 2, or 3 on one rank (`actcfg.plan.sharded.zero3_refusal`),
the profile runs `Trainer.model` (the engine's module)
inside the engine's first forward, its backward passes taken with `torch.autograd.grad` so that
ZeRO's gradient hooks never see them, and DeepSpeed's reduce buckets and gradient partition
counted as its step allocates them (`actcfg.plan.sharded.deepspeed_backward`). ZeRO-3 where a
gather allocates (several ranks, offload_param, quantized weights) or with leaf modules, DDP,
FSDP1 and DataParallel are refused before the first step (`_refuse_planning_in` says why).

What the callback says goes where the Trainer writes its own progress: Trainer's logger stays at
WARNING by default (its INFO lines, such as "***** Running training *****", do not show), and it
prints its metrics with `tqdm.write` (or `print` under `disable_tqdm`) on the main process. One
line when the policy takes effect, one after the first step; both are left out when the
process's log level (`TrainingArguments.log_level`, or transformers' verbosity) is above WARNING.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from actcfg.api import apply
from actcfg.runtime.handle import AppliedPolicy
from actcfg.policy.checker import load
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
from actcfg.integrations._planning import (
    PLAN_FILE_NAME,
    check_plan_fits_model,
    load_plan_file,
    write_plan,
)
from actcfg.integrations._report_lines import FirstStepPeak, applied_line, measured_line
from actcfg.plan import plan_model
from actcfg.plan.sharded import DDP_WHY, ZERO3_INSTEAD, is_sharded, zero3_refusal
from actcfg.policy.schema import Policy

__all__ = ["ActivationPolicyCallback", "trainer_loss"]

_AC, _AC_KWARGS = ARGUMENT, KWARGS  # transformers 5.24's names
_GC, _GC_KWARGS = OLD_NAMES[ARGUMENT], OLD_NAMES[KWARGS]  # the names before (5.17 has only these)
# The key of the kwargs that turns on transformers' own offload, from the hf table.
_OFFLOAD = HF_TABLE["cpu_checkpointing"].key.removeprefix(f"{KWARGS}.")


class ActivationPolicyCallback(TrainerCallback):
    """Apply an actcfg policy to the model `Trainer` trains, from train begin to train end.

    `memory_budget` (with `checkpoint.mode: auto`) bounds the GPU memory one training step's
    forward and backward allocate above what is allocated when the step begins (its
    activations, their gradients, the parameter gradients): the weights, the optimizer's state
    and the optimizer step are outside it. The plan is made on the first batch (see the module
    doc) and written to `output_dir/actcfg-plan.yaml`; `plan_file=` reuses one without profiling.
    """

    def __init__(self, policy: Any, *, backend: Backend | str | None = None, mpu: Any = None,
                 plan_file: str | Path | None = None) -> None:
        # Validated now, so a bad policy fails where the Trainer is built, not after setup.
        self.policy: Policy = load(policy, backends=() if backend is None else (backend,))
        self.plan_file: Path | None
        """The plan applied instead of planning (`plan_file=`), else None."""
        self.plan_file, self._plan = load_plan_file(self.policy, plan_file)
        self.backend = backend
        self.mpu = mpu
        self.applied: AppliedPolicy | None = None
        """The live handle between on_train_begin (with mode auto: the first batch) and
        on_train_end, else None."""
        self.plan_written: Path | None = None
        """Where the plan made on the first batch was written (`output_dir/actcfg-plan.yaml`)."""
        self.plan_seconds: float | None = None
        """Seconds planning took on the first batch (its profile steps), else None."""
        self._checked_step = False
        self._pending: Any = None  # the forward pre-hook that plans on the first batch
        self._run: tuple[TrainingArguments, TrainerState] | None = None
        self._peak = FirstStepPeak()

    @property
    def first_step_peak(self) -> int | None:
        """The first training step's GPU memory peak above its start, read before the optimizer
        step: what `memory_budget` bounds (None on the CPU, and before that step)."""
        return self._peak.peak

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        """Refuse what cannot work, then apply the policy (or its plan file) before the first
        step; with `mode: auto` and no plan file, wait for the first batch."""
        self.remove()  # a train() that raised left the last application on the model
        if model is None:
            raise PolicyApplyError("Trainer called on_train_begin without a model; "
                                   "ActivationPolicyCallback needs Trainer(model=...)")
        plugin = getattr(args, "deepspeed_plugin", None)
        auto = self.policy.checkpoint.mode == "auto"
        # A plan is a torch policy: the trainer running DeepSpeed does not make it a DeepSpeed one.
        backend = Backend.TORCH if auto else backend_for(self.policy, self.backend, plugin is not None)
        self._refuse_conflicts(args, model, backend)
        if plugin is not None:
            section = (getattr(plugin, "deepspeed_config", None) or {}).get(SECTION)
            refuse_disagreeing_section(section, self.policy, backend, "the ds_config")
        self._checked_step = False
        self._peak = FirstStepPeak()
        self._run = (args, state)
        if not auto:
            self.applied = apply(model, self.policy, backend=backend, mpu=self.mpu)
            self._say(applied_line(self.applied))
        elif self._plan is not None:
            assert self.plan_file is not None
            check_plan_fits_model(model, self.policy, self._plan, self.plan_file)
            self.applied = apply(model, self._plan, backend=backend)
            self._say(applied_line(self.applied, plan_file=self.plan_file))
        else:
            _refuse_planning_in(args, model)
            # Before FSDP2's own root pre-forward (registered with prepend=True too, at
            # fully_shard): the profile's steps each go through FSDP2's hooks from the start,
            # rather than nested inside a forward FSDP2 has begun.
            self._pending = model.register_forward_pre_hook(self._plan_on_first_batch,
                                                            with_kwargs=True, prepend=True)

    def _plan_on_first_batch(self, model: torch.nn.Module, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return  # an evaluation before training: not the batch a step trains on
        self._stop_waiting()  # the profile calls the model too
        if args and kwargs:
            raise PolicyApplyError(
                "checkpoint.mode auto plans on the first batch as the Trainer passes it to the "
                "model, and the model was called with positional and keyword arguments (a "
                "compute_loss of your own?): call it with keyword arguments only, or write the "
                "plan with `actcfg plan` and pass plan_file=")
        began = time.perf_counter()
        assert self._run is not None
        run_args, state = self._run
        # As the Trainer's step runs: `compute_loss` returns only the loss, so the outputs (the
        # logits: under bf16, accelerate's fp32 copy of them) are gone before backward; with
        # gradient accumulation a later micro-batch starts with every gradient.
        planned = plan_model(model, self.policy, dict(kwargs) if kwargs else tuple(args),
                             loss_fn=trainer_loss, apply=apply, outputs_held=False,
                             accumulating=run_args.gradient_accumulation_steps > 1)
        self.applied = apply(model, planned.policy, backend=Backend.TORCH)
        self.applied.set_plan(planned.report)
        took = self.plan_seconds = time.perf_counter() - began
        assert self.applied.plan is not None
        if state.is_world_process_zero:
            self.plan_written = write_plan(run_args.output_dir, self.applied.plan.policy_yaml)
        self._say(applied_line(self.applied, planned_in_s=took, written=self.plan_written))
        self._peak.begin(model)  # from here: the profile's own peak is not the step's

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      model: Any = None, **kwargs: Any) -> None:
        """The first step's memory is measured from here (on a GPU)."""
        if not self._checked_step and model is not None:
            self._peak.begin(model)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        """The first step's peak, before the optimizer step (outside `memory_budget`)."""
        if not self._checked_step:
            self._peak.stop()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """After the first step: the policy's effects really happened, and what was measured."""
        if self._checked_step:
            return
        if self._pending is not None:
            self._stop_waiting()
            raise PolicyApplyError(
                "checkpoint.mode auto waited for the first batch, and the first step ran without "
                "calling the model in training mode: nothing was planned (a compute_loss that "
                "calls another module?); write the plan with `actcfg plan` and pass plan_file=")
        if self.applied is None:
            return
        self._checked_step = True
        try:
            refuse_idle_offload(self.applied, "Trainer did not call it")
            refuse_no_recompute(self.applied)
            refuse_drifted_deepspeed_state(self.applied, "after the first step")
        except PolicyApplyError:
            self.remove()  # Trainer has no exception hook: take the policy off before raising
            raise
        self._say(measured_line(self.applied, self._peak.peak))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Undo everything the policy did to the model."""
        self.remove()

    def remove(self) -> None:
        """Undo the policy now (also after a `train()` that raised); a no-op when none is on."""
        self._stop_waiting()
        applied, self.applied = self.applied, None
        if applied is not None:
            applied.remove()

    def _stop_waiting(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.remove()

    def _say(self, line: str) -> None:
        """Write `line` where the Trainer writes its metrics, on the main process only."""
        if self._run is None:
            return
        args, state = self._run
        if not state.is_world_process_zero or args.get_process_log_level() > logging.WARNING:
            return
        if args.disable_tqdm:
            print(line, flush=True)
        else:
            tqdm.write(line)  # above the progress bar, as ProgressCallback writes its logs

    def _refuse_conflicts(self, args: TrainingArguments, model: Any, backend: Backend) -> None:
        mode = self.policy.checkpoint.mode
        hf_on = bool(getattr(args, _AC, None) or getattr(args, _GC, None))
        layers = hf_checkpointed_modules(model)
        if mode in ("full", "selective", "auto"):
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



def trainer_loss(outputs: Any) -> Any:
    """The loss `Trainer.compute_loss` takes from the model's outputs (with no label smoother and
    no compute_loss_func): `outputs["loss"]` of a dict or ModelOutput, else `outputs[0]`."""
    if isinstance(outputs, dict):
        if outputs.get("loss") is None:
            raise PolicyApplyError(
                "checkpoint.mode auto profiles steps with the loss Trainer.compute_loss takes from "
                f"the model's outputs, and they hold no `loss` (keys: {', '.join(outputs)}): the "
                "model got no labels (a compute_loss_func or compute_loss of your own computes the "
                "loss outside it); write the plan with `actcfg plan --model ...` and pass plan_file=")
        return outputs["loss"]
    return outputs[0]


def _refuse_planning_in(args: TrainingArguments, model: Any) -> None:
    """PolicyApplyError for a run whose first batch cannot be planned on in this process.

    FSDP2 is planned (`fsdp_config={"fsdp_version": 2}`: accelerate has called `fully_shard` on
    the model by train begin), on one process or on each of several, which plan together
    (`actcfg.plan.sharded`). What is refused is what a profile's backward cannot run under and
    leave the run as it was."""
    fsdp = getattr(args, "fsdp", None)
    why = None
    zero3 = zero3_refusal(model) if getattr(args, "deepspeed_plugin", None) is not None else None
    if zero3 is not None:
        # ZeRO stages 0-2, and 3 on one rank, are planned: `Trainer.model` is engine.module, and
        # the profile's backward keeps DeepSpeed's gradient hooks out
        # (actcfg.plan.sharded.deepspeed_backward, zero3_refusal).
        why = f"the Trainer runs the DeepSpeed engine with ZeRO-3, {zero3} ({ZERO3_INSTEAD})"
    elif fsdp and not is_sharded(model):
        # FSDP1 wraps the model in FullyShardedDataParallel with flat parameters (its names are
        # not the model's, so neither is a plan's); accelerate on the CPU runs DDP instead.
        why = ("TrainingArguments(fsdp) is set and the model is not sharded with FSDP2's "
               "fully_shard at train begin (FSDP1 wraps it in FullyShardedDataParallel with "
               "flattened parameters, which the profile does not run; on the CPU accelerate "
               "runs DDP instead): set fsdp_config={'fsdp_version': 2}")
    elif args.world_size > 1 and not is_sharded(model):
        why = (f"this is one of {args.world_size} processes under DDP, {DDP_WHY} (FSDP2, "
               "fsdp_config={'fsdp_version': 2}, is planned on every rank together)")
    elif args.n_gpu > 1:
        why = f"the Trainer wraps the model in DataParallel over {args.n_gpu} GPUs"
    elif getattr(args, "torch_compile", False):
        # Trainer compiles after the callback could plan, so the profile would run eager; with
        # `compile:` in the policy actcfg profiles and applies the plan compiled itself instead.
        why = ("TrainingArguments(torch_compile=True) compiles the model, and a plan profiled "
               "in eager is not what runs compiled (to plan compiled, set torch_compile=False "
               "and write `compile: {scope: model}` beside memory_budget: actcfg then profiles "
               "and applies the plan compiled)")
    elif getattr(args, "label_smoothing_factor", 0):
        why = ("TrainingArguments(label_smoothing_factor) takes the labels out of the batch "
               "before the model sees it, so the profile has no loss to run backward from")
    if why is not None:
        raise PolicyApplyError(
            f"checkpoint.mode auto plans on the first batch, in the training process, and {why}: "
            f"plan once in a one-process run without it (it writes {PLAN_FILE_NAME} to "
            "output_dir), or with `actcfg plan CONFIG --model pkg.module:factory -o plan.yaml`, "
            "and pass the file as ActivationPolicyCallback(..., plan_file=...)")
