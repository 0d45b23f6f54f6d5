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

`checkpoint.mode: auto` plans in `on_train_batch_start` of the first batch, on the batch as
`training_step` gets it (on the device), with `training_step` as the step: the profile runs it
under the precision plugin's `train_step_context` (autocast, as the strategy runs it: entered for
each call, left before backward) and backward from the loss it returns, with its `self.log` calls sent to a collection thrown away
after, then applies the plan before Lightning's own first `training_step`. The plan counts the
step as Lightning runs it: automatic optimization sets the gradients to None after
`training_step` returns, before backward (`Closure.closure` in Lightning 2.6.6), so from the
second step on the previous step's gradients live through every forward
(`Profile.forward_grads`); with `accumulate_grad_batches` > 1, or an `optimizer_zero_grad` of
your own (it may zero them in place), they are counted through the whole step
(`Profile.accumulated_grads`). The profile puts back
gradients, buffers, training mode and the CPU and CUDA RNG state, and touches neither the
optimizers nor the data, so the run sees what it would have seen with the plan applied at fit
start. The plan is written to `trainer.log_dir/actcfg-plan.yaml`; `plan_file=` applies such a
file at fit start instead, with no profile. Planning in the run needs automatic
optimization (the profile must not step an optimizer) and one device, or `ModelParallelStrategy`
with FSDP2's `fully_shard` in `configure_model`: the profile then runs on the sharded model, on
every rank together, and every rank applies one plan (`actcfg.plan.sharded`); or
`DeepSpeedStrategy` with ZeRO stage 0, 1 or 2, or 3 on one GPU
(`actcfg.plan.sharded.zero3_refusal`): the profile's backward passes are taken with
`torch.autograd.grad`, so ZeRO's gradient hooks never see them, and DeepSpeed's reduce buckets
and gradient partition are counted as its step allocates them
(`actcfg.plan.sharded.deepspeed_backward`); the engine's step leaves no gradient to live through
the next forward. ZeRO-3 where a gather allocates (several ranks, offload_param, quantized
weights) or with leaf modules, DDP and FSDPStrategy (FSDP1) are refused before the first step
(`_refuse_planning_in` says why).

What the callback says goes through `rank_zero_info`, Lightning's own INFO logger (its
`lightning.pytorch` logger shows INFO by default, as the "GPU available" lines and the model
summary do): one line when the policy takes effect, one after the first step.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from actcfg.api import apply
from actcfg.runtime.handle import AppliedPolicy
from actcfg.policy.checker import load
from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION, TABLE
from actcfg.backends.table import Key
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
from actcfg.plan.sharded import ZERO3_INSTEAD, is_sharded, zero3_refusal
from actcfg.policy.schema import Policy

__all__ = ["ActivationPolicy", "step_loss"]

_FIT = "fit"


def _keyword_default_section() -> dict[str, Any]:
    """The section `DeepSpeedStrategy(...)` writes when none of its activation keywords is
    passed (each keyword is named after its ds_config key): Lightning's defaults, not the
    user's statement. A config of your own that says exactly this is taken as unset too."""
    params = inspect.signature(DeepSpeedStrategy.__init__).parameters
    return {entry.key: params[entry.key].default for entry in TABLE.values()
            if isinstance(entry, Key) and entry.key in params}


class ActivationPolicy(pl.Callback):
    """Apply an actcfg policy to the LightningModule for `fit`, from fit start to teardown.

    `memory_budget` (with `checkpoint.mode: auto`) bounds the GPU memory one training step's
    forward and backward allocate above what is allocated when the step begins, less the
    parameter gradients alive then (its activations, their gradients, the parameter gradients,
    the previous step's included: Lightning frees them after `training_step`, so the forward
    holds them): the weights, the optimizer's state and the optimizer step are outside it. The plan is made on the first batch (see the module
    doc) and written to `trainer.log_dir/actcfg-plan.yaml`; `plan_file=` reuses one without
    profiling.
    """

    def __init__(self, policy: Any, *, backend: Backend | str | None = None, mpu: Any = None,
                 plan_file: str | Path | None = None) -> None:
        # Validated now, so a bad policy fails where the Trainer is built, not after setup.
        self.policy: Policy = load(policy, backends=() if backend is None else (backend,))
        self.plan_file: Path | None
        """The plan applied instead of planning (`plan_file=`), else None."""
        self.plan_file, self._plan = load_plan_file(self.policy, plan_file)
        _refuse_whole_model_compile(self._plan or self.policy, self.plan_file)
        self.backend = backend
        self.mpu = mpu
        self.applied: AppliedPolicy | None = None
        """The live handle between on_fit_start (with mode auto: the first batch) and
        teardown, else None."""
        self.plan_written: Path | None = None
        """Where the plan made on the first batch was written (`log_dir/actcfg-plan.yaml`)."""
        self.plan_seconds: float | None = None
        """Seconds planning took on the first batch (its profile steps), else None."""
        self._checked_step = False
        self._waiting = False  # mode auto, no plan file: plan on the first batch
        self._peak = FirstStepPeak()

    @property
    def first_step_peak(self) -> int | None:
        """The first training step's GPU memory peak above its start, read before the optimizer
        step: what `memory_budget` bounds (None on the CPU, and before that step)."""
        return self._peak.peak

    def _backend(self, trainer: pl.Trainer) -> Backend:
        if self.policy.checkpoint.mode == "auto":
            return Backend.TORCH  # a plan is a torch policy, whatever the strategy
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
        """Apply the policy: after configure_model and the strategy's setup (see the module doc);
        with `mode: auto` and no plan file, wait for the first batch."""
        self.remove()
        mode = self.policy.checkpoint.mode
        if mode in ("full", "selective", "auto"):
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
        self._checked_step = False
        self._peak = FirstStepPeak()
        if mode != "auto":
            self.applied = apply(pl_module, self.policy, backend=self._backend(trainer),
                                        mpu=self.mpu)
            rank_zero_info(applied_line(self.applied))
        elif self._plan is not None:
            assert self.plan_file is not None
            check_plan_fits_model(pl_module, self.policy, self._plan, self.plan_file)
            self.applied = apply(pl_module, self._plan, backend=Backend.TORCH)
            rank_zero_info(applied_line(self.applied, plan_file=self.plan_file))
        else:
            _refuse_planning_in(trainer, pl_module)
            self._waiting = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """DeepSpeed's globals still hold the policy when training starts."""
        refuse_drifted_deepspeed_state(self.applied, "at train start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """With `mode: auto`, plan on the first batch; the first step's memory is measured
        from here (on a GPU)."""
        if self._waiting:
            self._waiting = False
            began = time.perf_counter()
            view = _TrainingStepView(pl_module, trainer.precision_plugin.train_step_context)
            # Under DeepSpeedStrategy the engine's step sets every gradient to None (stage 0) or
            # keeps only its partitions (ZeRO-1/2): none lives through the next forward.
            deepspeed = isinstance(trainer.strategy, DeepSpeedStrategy)
            with _logs_thrown_away(trainer, pl_module):
                planned = plan_model(view, self.policy, (batch, batch_idx), loss_fn=step_loss,
                                     apply=apply, grads_through_forward=not deepspeed,
                                     accumulating=_gradients_through_step(trainer, pl_module))
            self.applied = apply(pl_module, planned.policy, backend=Backend.TORCH)
            self.applied.set_plan(planned.report)
            took = self.plan_seconds = time.perf_counter() - began
            # Every rank reads log_dir: under several processes it is a broadcast from rank 0
            # (Strategy.broadcast), which a read on rank 0 alone would leave waiting.
            folder = trainer.log_dir or trainer.default_root_dir
            if trainer.is_global_zero:
                self.plan_written = write_plan(folder, planned.report.policy_yaml)
            rank_zero_info(applied_line(self.applied, planned_in_s=took, written=self.plan_written))
        if not self._checked_step:
            self._peak.begin(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """The first step's peak, before the optimizer step (outside `memory_budget`)."""
        if not self._checked_step:
            self._peak.stop()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """After the first step: the policy's effects really happened, and what was measured."""
        if self._checked_step or self.applied is None:
            return
        self._checked_step = True
        refuse_idle_offload(
            self.applied, "training_step did not call it: call self(...) in training_step, or "
            "apply the policy with actcfg.apply to the submodule training_step calls")
        refuse_no_recompute(self.applied)
        refuse_drifted_deepspeed_state(self.applied, "after the first step")
        self._peak.stop()  # where no optimizer step ran (manual optimization)
        rank_zero_info(measured_line(self.applied, self._peak.peak))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo everything the policy did to the LightningModule."""
        self.remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Undo the policy when fit raises (Lightning calls no teardown hook then)."""
        self.remove()

    def remove(self) -> None:
        """Undo the policy now; a no-op when none is on."""
        self._waiting = False
        applied, self.applied = self.applied, None
        if applied is not None:
            applied.remove()


def _gradients_through_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether a step's parameter gradients may live through its backward too: a later
    micro-batch of `accumulate_grad_batches` starts with them and is not zeroed, and an
    overridden `optimizer_zero_grad` may zero in place (`set_to_none=False`), keeping them."""
    own_zero_grad = type(pl_module).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad
    return trainer.accumulate_grad_batches > 1 or own_zero_grad


def step_loss(output: Any) -> Any:
    """The loss Lightning runs backward from: what `training_step` returns, a tensor or a dict's
    `loss`."""
    if isinstance(output, dict):
        output = output.get("loss")
    if output is None:
        raise PolicyApplyError(
            "checkpoint.mode auto profiles steps with the loss training_step returns, and it "
            "returned no loss (None, or a dict without `loss`) on the first batch: return the "
            f"loss there, or pass the {PLAN_FILE_NAME} of a run that planned as plan_file=")
    return output


class _TrainingStepView(nn.Module):
    """The LightningModule as the planner profiles it: the same children, parameters and
    buffers under the same names (shared, not copied), with `training_step(batch, batch_idx)`
    as its forward, under the precision plugin's `train_step_context` (autocast) as Lightning
    runs it: entered per call and left before backward. Around the whole profile, a context
    that caches (autocast's weight casts; Lightning's own AMP plugin passes
    `cache_enabled=False`, a custom plugin need not) would keep what it made from the first
    profiled step to the last, and no step would count what a real step makes and frees. The
    planner calls `model(*inputs)` and runs backward from the loss."""

    def __init__(self, module: pl.LightningModule,
                 context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self.step = module.training_step
        self.context = context
        self.train(module.training)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        with self.context():
            return self.step(batch, batch_idx)


@contextlib.contextmanager
def _logs_thrown_away(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """`self.log` in the profile's training_step runs lands in a result collection dropped after
    it: the epoch's logged means hold the real steps only."""
    # Lightning has no public switch for self.log; in 2.6.6 `trainer._results` is the training
    # epoch loop's collection, and self.log files each value under `_current_fx_name`.
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    loop = trainer.fit_loop.epoch_loop
    kept, fx = loop._results, pl_module._current_fx_name
    scratch = _ResultCollection(training=True)
    scratch.batch = kept.batch
    loop._results = scratch
    pl_module._current_fx_name = "training_step"
    try:
        yield
    finally:
        loop._results = kept
        pl_module._current_fx_name = fx


def _refuse_whole_model_compile(policy: Policy, plan_file: Path | None) -> None:
    """PolicyApplyError for `compile: {scope: model}`: the policy is applied to the
    LightningModule, whose forward Lightning never calls (it calls training_step), so nothing
    would be compiled, while the profile compiles training_step itself."""
    if policy.compile is None or policy.compile.scope != "model":
        return
    where = f"{plan_file}: " if plan_file is not None else ""
    raise PolicyApplyError(
        f"{where}compile.scope: `model` compiles the forward of the module the policy is applied "
        "to, and the Lightning callback applies it to the LightningModule, whose forward "
        "Lightning does not call (it calls training_step): nothing would run compiled; write "
        "`compile: {scope: blocks}` to compile each candidate module")


def _refuse_planning_in(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """PolicyApplyError for a fit whose first batch cannot be planned on in this process.

    One device is planned, `DeepSpeedStrategy` with ZeRO stage 0, 1 or 2 (3 on one GPU), and
    `ModelParallelStrategy` with FSDP2 (`fully_shard` in `configure_model`) on one process or
    each of several, which plan together (`actcfg.plan.sharded`). What is refused is what a profile's backward cannot run under and
    leave the fit as it was."""
    strategy = trainer.strategy
    why = None
    if isinstance(strategy, DeepSpeedStrategy):
        # ZeRO stages 0-2, and 3 on one rank, are planned: the LightningModule's parameters are
        # the engine module's, and the profile's backward keeps DeepSpeed's gradient hooks out
        # (actcfg.plan.sharded.deepspeed_backward, zero3_refusal).
        zero3 = zero3_refusal(pl_module)
        if zero3 is not None:
            why = f"the Trainer runs DeepSpeedStrategy with ZeRO-3, {zero3} ({ZERO3_INSTEAD})"
    elif isinstance(strategy, ModelParallelStrategy) and not is_sharded(pl_module):
        # Tensor parallel alone (no fully_shard) has collectives in every step too, but the
        # agreement of the ranks' steps is built and tested for FSDP2's.
        why = ("the Trainer runs ModelParallelStrategy and configure_model sharded no module with "
               "FSDP2's fully_shard: only FSDP2-sharded models are profiled across processes")
    elif not isinstance(strategy, (SingleDeviceStrategy, ModelParallelStrategy)) or (
            trainer.world_size > 1 and not isinstance(strategy, ModelParallelStrategy)):
        # DDP's reducer, and FSDPStrategy's (FSDP1) flat parameters, whose names are not the
        # module's (so neither is a plan's).
        why = (f"the Trainer runs {type(strategy).__name__} over {trainer.world_size} "
               "process(es), whose gradient hooks (DDP's reducer, FSDP1's flat parameters) the "
               "profile's backward passes would fire (ModelParallelStrategy with FSDP2's "
               "fully_shard in configure_model is planned on every rank together)")
    if why is None and not pl_module.automatic_optimization:
        why = ("the LightningModule steps its optimizers itself (automatic_optimization is off), "
               "so running training_step to profile it would step them")
    if why is not None:
        raise PolicyApplyError(
            f"checkpoint.mode auto plans on the first batch, in the training process, and {why}: "
            f"plan once in a one-device run (it writes {PLAN_FILE_NAME} to trainer.log_dir), "
            "or with `actcfg plan CONFIG --model pkg.module:factory -o plan.yaml`, and pass the "
            "file as ActivationPolicy(..., plan_file=...)")


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

