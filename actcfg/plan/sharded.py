"""Planning a model as it trains when its parameters are sharded (FSDP2's `fully_shard`), on
every rank of the group; and the wrappers a profile cannot run under (DDP, the DeepSpeed engine).

The profile runs the sharded model itself: FSDP2's own pre- and post-forward hooks gather each
unit's parameters and free them after, so the gathered parameters count toward every peak the
profile reads (CUDA: the allocator's statistics; CPU: `LiveBytes` counts a gathered storage while
it holds bytes), and each profiled backward reduce-scatters the gradients into the sharded
`.grad`s, which the profile puts back after (`actcfg.plan.profile._restored`). Nothing else of
FSDP2's is left changed: each step reshards what it gathered.

A sharded step is full of collectives (an all-gather per unit in forward and backward, a
reduce-scatter per unit in backward), so with several ranks:

* every rank runs the same profile steps in the same order. The profile's sequence is fixed
  except where it follows this rank's own readings: a run out of memory is skipped, and compiled
  runs warm up until their time settles. Under a group, out of memory ends the plan (`strict`
  in `actcfg.plan.profile.profile`) and `compile:` is refused before any step;
* a rank that fails must not leave the others inside a collective: the ranks agree on success
  at the start of each profiled forward (before FSDP2's first all-gather: a failure between
  steps meets the others there) and at each step's loss (`Steps.loss`: after the forward's
  collectives, before the backward's), and before and after the whole profile
  (`actcfg.plan.consensus.settle`). A failure inside a forward or a backward (out of memory
  mid-step) cannot be agreed on: the other ranks already wait inside FSDP2's next collective,
  which no later call of this rank can match. That rank then raises at once, saying so
  (`Steps.inside`), and the group's timeout ends the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actcfg.errors import PlanError
from actcfg.plan.consensus import settle

__all__ = ["DDP_WHY", "DEEPSPEED_WHY", "WHILE_PROFILING", "Steps", "is_sharded",
           "refuse_compile_across_ranks", "refuse_unplannable"]

DEEPSPEED_WHY = ("its gradient hooks (ZeRO's, or the bf16 optimizer's) move each gradient the "
                 "profile's backward produces into the optimizer's partitioned buffers, which "
                 "engine.step then applies, and which cannot be put back exactly")
"""Why the DeepSpeed engine is not profiled (`refuse_unplannable`, and both trainer callbacks)."""

WHILE_PROFILING = " (while profiling)"
"""Where every agreement during the profile says the failure happened: each rank raises the same
sentence, whichever agreement point the failing rank and the others met at."""

DDP_WHY = ("whose reducer all-reduces every backward's gradients into its buckets: the profile's "
           "backward passes would be reduced and counted")
"""Why DDP is not profiled (`refuse_unplannable`, and both trainer callbacks)."""


def is_sharded(model: nn.Module) -> bool:
    """True when `model` or a module in it is sharded with FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without torch.distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _class_names(model: nn.Module) -> set[str]:
    return {c.__name__ for c in type(model).__mro__}


def refuse_unplannable(model: nn.Module) -> None:
    """PlanError for a model the profile cannot run a step of without changing what the run
    sees: wrapped in DDP, or in (or trained by) the DeepSpeed engine."""
    where = "`checkpoint.mode: auto` profiles training steps on the model as given, and"
    fix = ("plan the unwrapped model in a one-process run (or with `actcfg plan CONFIG --model "
           "pkg.module:factory -o plan.yaml`) and apply the written plan")
    if "DistributedDataParallel" in _class_names(model):
        # DDP's reducer expects every backward to follow a DDP forward (prepare_for_backward)
        # and all-reduces into the gradients' buckets as they are produced.
        raise PlanError(f"{where} the model is wrapped in DistributedDataParallel, {DDP_WHY}; {fix}")
    # ZeRO-3 marks its parameters with `ds_id`; ZeRO-1/2 and the bf16 optimizer link each to
    # its fp32 partition (`_hp_mapping`, set to None again by engine.destroy()).
    zero = [n for n, p in model.named_parameters()
            if hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None]
    if zero:
        # ZeRO-1/2's gradient hooks (stage_1_and_2.create_gradient_handling_hooks) move each
        # parameter's gradient into the optimizer's ipg bucket as backward produces it, reduce
        # it into the partitioned gradients engine.step reads and clear `param.grad`; the
        # engine's `_backward_post_hook` runs the epilogue even for a direct loss.backward(). A
        # profile's backward passes would be reduced in as gradient-accumulation micro-steps,
        # kept in private structures of the installed DeepSpeed version (buckets, partitioned
        # gradients, grad_accum, reduced flags) with no API to save and restore them. ZeRO-3
        # adds hooks that fetch and release partitions by a recorded trace. (docs/trainers.md)
        raise PlanError(f"{where} the model is trained by the DeepSpeed engine ({DEEPSPEED_WHY}); "
                        f"{fix}")
    if "DeepSpeedEngine" in _class_names(model):
        # Without ZeRO (stage 0, fp32; fp16/bf16 through FP16_UnfusedOptimizer in 0.19) the
        # engine leaves gradients to autograd until engine.step: its module's backward is
        # torch's, and only the engine's forward hooks on it (timers) see the profile.
        raise PlanError(f"{where} the model is the DeepSpeed engine itself, whose module names "
                        "carry its `module.` prefix (so would the plan's) and whose forward does "
                        "the engine's per-step bookkeeping: pass engine.module, which plans "
                        "without ZeRO (stage 0); with ZeRO, " + fix)


class Steps:
    """Where the profile's steps are on this rank, for a sharded model under a group: inside a
    forward or backward (FSDP2 collectives in flight), or between them. The ranks agree on
    success at the start of each forward of the model and, through `loss`, which wraps the
    profile's loss, at each step's loss."""

    def __init__(self, model: nn.Module, group: Any) -> None:
        self.group = group
        self.settled = False
        """True once the ranks agreed that a step failed (every rank raised the same error)."""
        self.inside = False
        """True from a forward's start to the end of its backward (or of the forward, when no
        backward follows, as in the profile's byte counts)."""
        self._handles = [
            # Before FSDP2's root pre-forward (prepend=True too), whose all-gather is the step's
            # first collective.
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._leave),  # not always_call: a failure stays inside
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        # A rank that failed between steps (the profile's checks after a step) agrees on it
        # here with the others, before any of them starts the next step's collectives.
        self._agree(None)
        self.inside = True

    def _agree(self, error: BaseException | None) -> None:
        try:
            settle(error, self.group, where=WHILE_PROFILING)
        except PlanError:
            self.settled = True  # every rank raises here: nothing left to agree on
            raise

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.inside = False

    def loss(self, loss_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`loss_fn` with the ranks' agreement on success after it: every rank gets past its
        forward's collectives to here, so a loss that fails on one rank fails on all, with its
        sentence. From here to the end of the backward, this rank is inside a step again."""
        def agreed(output: Any) -> Any:
            error = None
            try:
                loss = loss_fn(output)
            except Exception as e:
                error = e
            self._agree(error)
            self.inside = True
            loss.register_hook(self._backward_started)
            return loss

        return agreed

    def _backward_started(self, grad: torch.Tensor) -> None:
        # Runs first in backward, so this callback is queued before FSDP2's root queues its own
        # (the post-backward that waits for the last reduce-scatters); it queues the one that
        # marks the end, which then runs after FSDP2's (the engine runs callbacks queued while
        # it runs them, in order).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ending)

    def _backward_ending(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.inside = False

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []


def refuse_compile_across_ranks(compiled: bool) -> None:
    """PlanError for `compile:` when a sharded model plans on several ranks: compiled runs warm
    up until their time settles, a count each rank reads from its own clock, and the ranks'
    sharded steps must match one for one."""
    if compiled:
        raise PlanError(
            "`compile:` with a sharded (FSDP2) model on several ranks: the profile warms each "
            "compiled run up until its step time settles, a count each rank reads from its own "
            "clock, and every rank's sharded steps (their all-gathers and reduce-scatters) must "
            "match one for one; plan compiled on one rank (a one-rank group) and apply the "
            "written plan on every rank, or remove `compile`")
