"""Planning a model as it trains when its parameters are sharded (FSDP2's `fully_shard`), on
every rank of the group, or trained by the DeepSpeed engine with ZeRO-1/2 (`deepspeed_backward`:
the profile's backward out of reach of ZeRO's gradient hooks, their step buffers stood in for)
or with ZeRO-3 where its gathers allocate nothing (one rank, partitions on the device:
`zero3_refusal`, `zero3_profiling`; its gradient hooks followed, not run: `Zero3Gradients`);
and the wrappers a profile cannot run under (DDP, ZeRO-3 elsewhere, the engine object itself).

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

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from actcfg.errors import PlanError
from actcfg.plan.consensus import settle
from actcfg.plan.probe import Backward

__all__ = ["DDP_WHY", "WHILE_PROFILING", "ZERO3_INSTEAD", "Steps", "deepspeed_backward", "is_sharded",
           "is_zero3", "refuse_compile_across_ranks", "refuse_unplannable", "zero3_profiling",
           "zero3_refusal"]

ZERO3_GATHERS = ("ZeRO-3 all-gathers each module's parameters on the device with hooks whose "
                 "timing follows the module order it recorded over the run's steps (prefetching "
                 "up to stage3_prefetch_bucket_size and stage3_max_live_parameters ahead, holding "
                 "gathered parameters that are used again within stage3_max_reuse_distance), so "
                 "the gathered parameters a step holds depend on that trace, which the profile's "
                 "steps (each under another policy) do not reproduce")
"""Why ZeRO-3 is planned only where its gathers allocate nothing (`zero3_refusal`)."""

ZERO3_INSTEAD = ("plan the same model and micro-batch on one rank under ZeRO-3 without "
                 "offload_param (planned there: gathering is a view of the whole partition), "
                 "under ZeRO stage 1 or 2, or with `actcfg plan CONFIG --model pkg.module:factory "
                 "-o plan.yaml`, with memory_budget lowered by what ZeRO-3 holds gathered at once "
                 "(at most every parameter), and apply the written plan")
"""What to do instead where ZeRO-3 is refused: the plan is per-block choices, which apply on any
number of ranks; its peak is counted above the step's start, so only the gathered parameters
(and ZeRO-3's per-rank savings) differ from the run it was made in."""

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
    sees: wrapped in DDP, trained by the DeepSpeed engine with ZeRO-3 where a gather allocates
    (`zero3_refusal`), or the engine itself."""
    where = "`checkpoint.mode: auto` profiles training steps on the model as given, and"
    fix = ("plan the unwrapped model in a one-process run (or with `actcfg plan CONFIG --model "
           "pkg.module:factory -o plan.yaml`) and apply the written plan")
    if "DistributedDataParallel" in _class_names(model):
        # DDP's reducer expects every backward to follow a DDP forward (prepare_for_backward)
        # and all-reduces into the gradients' buckets as they are produced.
        raise PlanError(f"{where} the model is wrapped in DistributedDataParallel, {DDP_WHY}; {fix}")
    if "DeepSpeedEngine" in _class_names(model):
        raise PlanError(f"{where} the model is the DeepSpeed engine itself, whose module names "
                        "carry its `module.` prefix (so would the plan's) and whose forward "
                        "starts the engine's backward bookkeeping (its loss-scaling hook on the "
                        "output, the reduction epilogue after it): pass engine.module, which "
                        "plans under ZeRO stages 0, 1 and 2, and 3 on one rank")
    why = zero3_refusal(model)
    if why is not None:
        raise PlanError(f"{where} the model is trained by the DeepSpeed engine with ZeRO-3, "
                        f"{why}; {ZERO3_INSTEAD}")


def _zero3_params(model: nn.Module) -> list[Any]:
    """The parameters ZeRO-3 partitioned (it marks each with `ds_id`)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def is_zero3(model: nn.Module) -> bool:
    """True when the DeepSpeed engine trains `model` with ZeRO-3 (its parameters partitioned)."""
    return bool(_zero3_params(model))


def zero3_refusal(model: nn.Module) -> str | None:
    """Why `model`, trained by the DeepSpeed engine with ZeRO-3, cannot be profiled as it
    trains (a clause), or None: not ZeRO-3, or ZeRO-3 where every gather allocates nothing.

    DeepSpeed 0.19.8 gathers a parameter whose partition group has one rank without a
    collective (`_no_gather_coalesced`): `NoGatherHandle` sets `param.data` to its partition
    moved to the device and viewed whole, which is the partition itself when it lives on the
    device and is not quantized. Then the parameters a step holds gathered take no memory
    beyond the partitions, which exist before the step, and what a step allocates is what it
    would allocate without ZeRO-3 (its gradient path aside: `deepspeed_backward`), whatever
    DeepSpeed's trace decides to prefetch or keep. Elsewhere a gather allocates the whole
    parameter, for as long as the trace decides (`ZERO3_GATHERS`), and on several ranks every
    gather is also a collective the ranks' profiles would have to match one for one."""
    params = _zero3_params(model)
    if not params:
        return None
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    ranks = max(comm.get_world_size(group=getattr(p, "ds_process_group", None)) for p in params)
    if ranks > 1:
        return (f"whose parameters are partitioned over {ranks} ranks: {ZERO3_GATHERS}, and "
                "each gather is a collective the ranks' profiles would have to match one for one")
    device = torch.device(get_accelerator().current_device_name())
    away = [p for p in params if p.ds_tensor.device != device]
    if away:
        return (f"whose partitions live on {away[0].ds_tensor.device} (offload_param) while it "
                f"computes on {device}: {ZERO3_GATHERS}, and each gather copies the whole "
                "parameter to the device")
    if any(hasattr(p.ds_tensor, "ds_quant_scale") for p in params):
        return (f"whose partitions are quantized (zero_quantized_weights): {ZERO3_GATHERS}, and "
                "each gather dequantizes the whole parameter into new memory")
    leaves = [p for p in params if getattr(p, "ds_z3_leaf_module", None) is not None]
    if leaves:
        return (f"with a ZeRO-3 leaf module ({type(leaves[0].ds_z3_leaf_module).__name__}: "
                "set_z3_leaf_modules or stage3_module_granularity_threshold), whose gradients "
                "ZeRO-3 reduces in a full backward hook on the module, which the profile's "
                "backward would fire")
    return None


def _zero3_offload(model: nn.Module) -> Any:
    """ZeRO-3's DeepSpeedZeRoOffload of `model` (its hooks, its parameter coordinator), read from
    the gradient hooks of ZeRO-3's optimizer, or None when `model` is not ZeRO-3's."""
    if not _zero3_params(model):
        return None
    found = [hook for p in model.parameters()
             for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    owners = {id(o): o for o in map(_hooked_optimizer, found)
              if isinstance(o, DeepSpeedZeroOptimizer_Stage3)}
    if len(owners) != 1:
        raise PlanError(
            "`checkpoint.mode: auto` under the DeepSpeed engine with ZeRO-3: the model's "
            "parameters do not carry the gradient hooks of one ZeRO-3 optimizer "
            "(DeepSpeedZeroOptimizer_Stage3) as DeepSpeed 0.19 registers them, through which the "
            f"profile finds ZeRO-3's parameter hooks; {ZERO3_INSTEAD}")
    (optimizer,) = owners.values()
    return optimizer.parameter_offload


@contextlib.contextmanager
def zero3_profiling(model: nn.Module) -> Iterator[None]:
    """The profile's steps on a ZeRO-3 model (one rank, `zero3_refusal` None) run through
    ZeRO-3's own module hooks, which gather each module's parameters before it runs, again
    before its backward and in a checkpoint's recompute (DeepSpeed's coordinator tells a
    recompute by its graph task, `fetch_sub_module`), and release them after. Around them this
    puts back what those hooks leave behind that the run would see differently:

    * the coordinator's trace: each profiled forward starts with it invalidated, so ZeRO-3
      records (releases every module's parameters after use, prefetches nothing) instead of
      prefetching by the trace of another policy's step; after the profile it is invalid, as
      before the first step of a run, and the run records it again in its next two steps (the
      trace decides only when parameters are gathered and released, never a value; on one rank
      a gather allocates nothing);
    * the engine's external-parameter discovery (`_in_forward` on each module's parameters,
      which the engine's own hooks on engine.module turn on for each profiled forward and off
      after), as it was before the profile;
    * each module's count of forwards awaiting a backward (`applied_pre_backward_ref_cnt`),
      raised by the profile's forwards that no backward follows (its byte counts);
    * parameters gathered at the end (a module whose post-backward hook never fired: its input
      needs no gradient), released after each backward (`deepspeed_backward`) and at the end;
      and those gathered before the profile (persistent ones, once a trace completed), gathered
      again (on one rank a view of the partition, as gathering them in the run would be).
    """
    offload = _zero3_offload(model)
    if offload is None:
        yield
        return
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    coordinator = offload.get_param_coordinator()
    modules = list(model.modules())
    counts = [(m, {k: m.__dict__[k] for k in ("applied_pre_backward_ref_cnt", "ds_grads_remaining")
                   if k in m.__dict__}) for m in modules]
    gathered = {p for p in model.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE}

    # The engine's own pre- and post-forward hooks on engine.module turn it on and off around
    # each profiled forward; a profile inside the engine's forward (a callback's pre-forward
    # hook) leaves it as that forward had it.
    ordered = [m._parameters for m in modules if isinstance(m._parameters, ZeROOrderedDict)]
    discovery = [getattr(d, "_in_forward", False) for d in ordered]

    def enter(module: nn.Module, args: Any) -> None:
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()  # as DeepSpeed does when its hooks are registered again

    # Before ZeRO-3's own pre-forward hook (reset_step), which then starts recording.
    handle = model.register_forward_pre_hook(enter, prepend=True)
    try:
        yield
    finally:
        handle.remove()
        for d, flag in zip(ordered, discovery):
            d._in_forward = flag
        offload.release_backward_leftovers()
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        for p in model.parameters():
            if p.ds_status == ZeroParamStatus.AVAILABLE and p not in gathered:
                p.ds_active_sub_modules.clear()
                p.partition()
        # Persistent parameters (`stage3_param_persistence_threshold`) stay gathered once a
        # complete trace runs; the profile's recording steps release them like any other.
        released = [p for p in model.parameters()
                    if p in gathered and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:
            released[0].all_gather(param_list=released)
        for m, saved in counts:
            for k in ("applied_pre_backward_ref_cnt", "ds_grads_remaining"):
                if k in saved:
                    setattr(m, k, saved[k])
                else:
                    m.__dict__.pop(k, None)


def deepspeed_backward(model: nn.Module) -> Backward:
    """How the profile runs a step's backward on `model`: as the run does (`loss.backward()`),
    or, for a model trained by DeepSpeed's ZeRO-1/2 or bf16 optimizer, with
    `torch.autograd.grad` over its trainable parameters, which DeepSpeed's hooks never see.

    Those optimizers hook each parameter's gradient accumulation
    (`Tensor.register_post_accumulate_grad_hook`, through `deepspeed.utils.torch.
    register_grad_hook`): ZeRO-1/2's hook copies the gradient into the optimizer's bucket,
    reduces it into the partitioned gradients `engine.step` applies and counts it towards the
    engine's backward epilogue; the bf16 optimizer's adds it to its fp32 gradients. A profiled
    `loss.backward()` would be one more gradient-accumulation micro-step of the run. Under
    `torch.autograd.grad` the AccumulateGrad nodes of the parameters asked for do not run (their
    gradients are captured at the node's input), so no post-accumulate-grad hook fires and no
    `.grad` is written; the engine's other hooks are on its own forward's output, which the
    profile never calls (it runs `engine.module`), and on the module's forward (timers).

    What the profile then counts under ZeRO-1/2 and the bf16 optimizer: every parameter's whole
    gradient, held from the moment backward produces it to the step's end, as `.grad` would be
    without DeepSpeed; and, from the start of backward to its end, a stand-in of DeepSpeed's own
    step buffers (`_zero_buffers`), which the hooks allocate at a step's first gradient and free
    in its epilogue. Under ZeRO-3, whose hooks move each gradient into its reduce bucket and
    free it: what they hold, as they hold it (`Zero3Gradients`). Under any of them, the two
    copies of the loss `engine.backward` makes (`Backward.loss_copies`). PlanError when
    parameters carry DeepSpeed's link to an optimizer whose hooks this does not know."""
    params = [p for p in model.parameters() if p.requires_grad]
    # ZeRO-1/2 and the bf16 optimizer link each parameter to its fp32 partition (`_hp_mapping`,
    # set to None again by engine.destroy()). Without a DeepSpeed hook on it (the bf16 optimizer
    # without `immediate_grad_update`) gradients stay in `.grad` until engine.backward's
    # epilogue, which the profile never calls: a plain backward, as without ZeRO.
    # ZeRO-3 marks every parameter it partitioned with `ds_id` instead.
    linked = [p for p in params if getattr(p, "_hp_mapping", None) is not None or hasattr(p, "ds_id")]
    found = [hook for p in linked for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]
    hooks = [hook for hook in found if getattr(hook, "__module__", "").startswith("deepspeed.")]
    # With no hook of DeepSpeed's found, the profile's backward is a plain one, which fires
    # every hook on the parameters: a user's (gradient logging) is harmless there, but one that
    # holds a DeepSpeed object (DeepSpeed's hook wrapped by another module, or registered by a
    # version that names it otherwise) may reduce the profile's gradients into the run.
    wrapped = [hook for hook in found if hook not in hooks and _holds_deepspeed(hook)]
    if not hooks and wrapped:
        raise PlanError(
            "`checkpoint.mode: auto` under the DeepSpeed engine: parameters DeepSpeed links to "
            f"its optimizer carry a gradient hook that holds a DeepSpeed object ({wrapped[0]!r}) "
            "but is not DeepSpeed 0.19's own: the profile cannot tell whether it reduces the "
            "profile's gradients into the run; plan the unwrapped model in a one-process run "
            "(or with `actcfg plan`) and apply the written plan")
    if not hooks:
        return Backward()
    optimizers = {id(o): o for o in map(_hooked_optimizer, hooks)}
    if None in optimizers.values() or len(optimizers) != 1:
        raise PlanError(
            "`checkpoint.mode: auto` under the DeepSpeed engine: the model's parameters carry "
            "DeepSpeed gradient hooks that are not those of one ZeRO-1/2 "
            "(DeepSpeedZeroOptimizer), ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) or bf16 "
            "(BF16_Optimizer) optimizer as DeepSpeed 0.19 "
            "registers them: the profile cannot keep them from its backward and count what "
            "they allocate; plan the unwrapped model in a one-process run (or with `actcfg "
            "plan`) and apply the written plan")
    (optimizer,) = optimizers.values()
    offload = getattr(optimizer, "parameter_offload", None)  # ZeRO-3's module hooks
    # The engine's backward epilogue releases what modules whose post-backward hook never fired
    # still hold gathered (a module whose input needs no gradient); the profile's backward too.
    after = None if offload is None else offload.release_backward_leftovers
    # ZeRO-3 frees each gradient into its bucket as backward produces it: the profile's backward
    # follows it gradient by gradient (`Zero3Gradients`), with no stand-in held through it.
    taking = None if offload is None else Zero3Gradients(optimizer)
    return Backward(apart=tuple(params), buffers=_zero_buffers(optimizer), after=after, taking=taking,
                    loss_copies=2)


def _holds_deepspeed(hook: Any) -> bool:
    """Whether a hook is, or holds in its closure or as its bound object, something of
    DeepSpeed's (one level down: what a wrapper of DeepSpeed's hook would hold)."""
    function = getattr(hook, "__func__", hook)  # a bound method's function
    held = [function, getattr(hook, "__self__", None)]
    for cell in getattr(function, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            pass
    return any(_from_deepspeed(obj) for obj in held if obj is not None)


def _from_deepspeed(obj: Any) -> bool:
    # a function or class by where it was defined, anything else by its type
    module = getattr(obj, "__module__", None) if callable(obj) else None
    return any(isinstance(m, str) and m.startswith("deepspeed.") for m in (module, type(obj).__module__))


def _hooked_optimizer(hook: Any) -> Any:
    """The DeepSpeed optimizer a gradient hook belongs to, read from its closure (`self` in
    `create_gradient_handling_hooks`, `create_grad_acc_hooks` or ZeRO-3's
    `create_reduce_and_remove_grad_hooks`), or None. The engine keeps no link from its module to
    its optimizer."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if getattr(hook, "__module__", None) == "deepspeed.utils.nvtx":
        # ZeRO-3's hook is wrapped by `instrument_w_nvtx`, which holds it as `func`
        hook = _closed_over(hook, "func")
    owner = _closed_over(hook, "self")
    known = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)
    return owner if isinstance(owner, known) else None


def _closed_over(function: Any, name: str) -> Any:
    """What `function` holds in its closure as `name`, or None."""
    names = getattr(getattr(function, "__code__", None), "co_freevars", ())
    if name not in names or function.__closure__ is None:
        return None
    try:
        return function.__closure__[names.index(name)].cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _zero_buffers(optimizer: Any) -> int:
    """Bytes DeepSpeed's gradient hooks allocate in a step and free in its epilogue, which the
    profile (whose backward they do not see) allocates in their place. DeepSpeed 0.19.8's
    `DeepSpeedZeroOptimizer`: with `contiguous_gradients`, each step's first gradient allocates
    one buffer of `reduce_bucket_size` elements per communication dtype (two with
    `overlap_comm`; `setup_buckets`), freed in the epilogue (`_release_ipg_buffers`); ZeRO-2's
    reduction copies the rank's gradients into `grads_in_partition` (its partition, in the
    model's dtype), freed there too, and ZeRO-1's epilogue builds the partition as
    `averaged_gradients` (in the accumulation dtype) while every `.grad` is still alive. One
    partition in the larger of the two dtypes covers either. On one CPU rank the default
    bucket (5e8 elements, fp32) was 2.0 GB of a step whose activations and gradients were
    1.85 MB. The bf16 optimizer's fp32 gradients are allocated with it, before any step: 0.

    The stand-in is held through the whole backward, where ZeRO-2 holds its partition only from
    its first reduction; and the profile holds each parameter's whole gradient to the step's
    end, where ZeRO-2 frees each once its bucket is reduced (ZeRO-1 holds them as the profile
    does). So the profile counts at least what the run allocates, and under ZeRO-2 up to the
    gradients' whole size more (on one CPU rank: 2.23 MB predicted for a step measured at
    1.79 MB, gradients 0.27 MB; ZeRO-1 1.89 MB). With `offload_optimizer` the partition lives on the host and is counted
    on the device all the same: an upper bound there too."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return 0  # ZeRO-3's (not one): its hooks' allocations are made as they happen (`Zero3Gradients`)
    buckets = 0
    if optimizer.contiguous_gradients:
        element = torch.empty((), dtype=optimizer._gradient_reduction_buffer_dtype()).element_size()
        per = 2 if optimizer.overlap_comm else 1
        buckets = len(optimizer.ipg_buckets) * per * int(optimizer.reduce_bucket_size) * element
    widest = max(torch.empty((), dtype=d).element_size()
                 for d in (optimizer.dtype, optimizer.gradient_accumulation_dtype))
    partition = sum(int(n) for n in optimizer.partition_size) * widest
    return buckets + partition


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


class Zero3Gradients:
    """ZeRO-3's gradient path on one rank (DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer_Stage3`,
    `zero3_refusal` None), as the profile's backward follows it (`Backward.taking`): each
    gradient taken apart is let go as soon as backward produces it, and what ZeRO-3's hooks
    allocate is allocated when they would.

    What a step of the engine holds of its gradients: ZeRO-3's reduce buckets
    (`contiguous_gradients`) and the flat buffer of gradient partitions are allocated with the
    optimizer, before any step. Its hook on each parameter's gradient accumulation
    (`create_reduce_and_remove_grad_hooks`) copies the new `.grad` into the bucket of its
    communication dtype and frees it (`__add_grad_to_ipg_bucket`: `.grad` becomes a view of the
    bucket); where the bucket has no room left for it, the bucket is reduced first
    (`reduce_independent_p_g_buckets_and_remove_grads`), and a gradient larger than the bucket,
    or every gradient without `contiguous_gradients`, stays whole in `.grad` until its bucket is
    reduced. Reducing a bucket (`__reduce_and_partition_ipg_grads`) allocates, for a moment,
    the copies its reduction makes (`_reduction_bytes`), then copies each partition into the
    flat buffer (`partition_grads`) and sets `.grad` to None; the backward's last hook reduces
    what the buckets still hold (`independent_gradient_partition_epilogue`). So beyond the
    step's activations a step holds one gradient at a time, those kept whole, and a bucket's
    reduction copies while it runs; the flat buffer, written in place, adds nothing.

    Under the engine's `coalesce_grad_reduction` (its hooks return at once, the gradients stay
    in `.grad` until the context's end) every gradient is held whole, as the profile's backward
    holds them without this. The engine's hook frees the AccumulateGrad's `.grad`, which is the
    incoming gradient itself where autograd can steal it (a clone for a moment where it cannot):
    here the incoming gradient is let go after the hook, so a clone is not counted. On one CPU
    rank, two blocks, reduce buckets of 5e4 and 2e6 elements: the plain and the full steps
    profiled at the engine's own steps to the byte as `LiveBytes` counts them (plain 1851408,
    full 1024272), where holding every gradient whole with a bucket-sized stand-in through
    backward read plain 2051400 and 9851400."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def __call__(self, params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        return self._taking(params)

    @contextlib.contextmanager
    def _taking(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        optimizer = self.optimizer
        if getattr(optimizer, "_coalesce_grad_reduction", False):
            yield  # the hooks reduce nothing now: every gradient stays whole
            return
        buckets: dict[torch.dtype, _Bucket] = {}
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        size = int(optimizer.reduce_bucket_size)

        def take(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            comm = optimizer.get_param_comm_dtype(param)
            bucket = buckets.setdefault(comm, _Bucket())
            n = grad.numel()
            if bucket.elements + n > size and bucket.elements > 0:
                self._reduce(comm, bucket)
            bucket.device = grad.device
            if not (optimizer.contiguous_gradients and bucket.elements + n <= size):
                bucket.held.append(grad)  # stays whole in `.grad` until its bucket is reduced
            bucket.elements += n
            bucket.count += 1
            bucket.largest = max(bucket.largest, n)
            # What autograd.grad returns for it: no memory (the engine keeps no whole gradient).
            key = (grad.dtype, grad.device)
            if key not in zeros:
                zeros[key] = torch.zeros((), dtype=grad.dtype, device=grad.device)
            return zeros[key].expand(grad.shape)

        handles = [p.register_hook(lambda grad, p=p: take(p, grad)) for p in params]
        try:
            yield
            for comm, bucket in buckets.items():  # the epilogue: what the buckets still hold
                if bucket.count:
                    self._reduce(comm, bucket)
        finally:
            for h in handles:
                h.remove()
            buckets.clear()

    def _reduce(self, comm: torch.dtype, bucket: _Bucket) -> None:
        """The bucket's reduction: its copies allocated for a moment, the gradients it kept
        whole freed after."""
        copies = torch.empty(self._reduction_bytes(comm, bucket), dtype=torch.uint8, device=bucket.device)
        del copies
        bucket.held.clear()
        bucket.elements = bucket.count = bucket.largest = 0

    def _reduction_bytes(self, comm: torch.dtype, bucket: _Bucket) -> int:
        """What reducing `bucket` (of communication dtype `comm`) allocates beyond the bucket
        and the flat buffer, on one rank: on the all-reduce path (`contiguous_gradients`
        without `reduce_scatter`: `__avg_scatter_contiguous_grads`, in place on the bucket) the
        multiplication by `gradient_predivide_factor` where that is not 1; on the reduce-scatter
        path (`__avg_scatter_grads`) the conversion to `comm` of gradients kept whole in
        another dtype, the division and multiplication by that factor, and
        `reduce_scatter_coalesced`'s concatenation of the bucket's gradients (a single one is
        reduced in place); on both, the conversion to the accumulation dtype where it differs
        from `comm`; and where the flat buffer lives off the device (`offload_optimizer`),
        `partition_grads`' copy of a partition on the device (one parameter's at a time) and
        its conversion to the master weights' dtype. Summed, though not all of them are alive
        at once: an upper bound."""
        optimizer = self.optimizer

        def width(dtype: torch.dtype) -> int:
            return dtype.itemsize  # no tensor: this runs inside the counted backward

        n = bucket.elements
        scaled = optimizer.postscale_gradients and optimizer.gradient_predivide_factor != 1.0
        total = 0
        if optimizer.contiguous_gradients and n <= int(optimizer.reduce_bucket_size) \
                and not optimizer.reduce_scatter:
            total += n * width(comm) if scaled else 0
        else:
            if comm != optimizer.dtype:
                total += sum(g.numel() for g in bucket.held if g.dtype != comm) * width(comm)
            total += 2 * n * width(comm) if scaled else 0
            total += n * width(comm) if bucket.count > 1 else 0
        accumulation = optimizer.gradient_accumulation_dtype
        if comm != accumulation:
            total += n * width(accumulation)
        flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
        if flat is not None and flat.device != bucket.device:
            master = getattr(optimizer, "master_weights_and_grads_dtype", accumulation)
            total += bucket.largest * (width(accumulation)
                                       + (width(master) if master != accumulation else 0))
        return total


class _Bucket:
    """One of ZeRO-3's reduce buckets as `Zero3Gradients` follows it through a backward."""

    def __init__(self) -> None:
        self.elements = 0
        self.count = 0
        self.largest = 0
        self.held: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        """The device of its gradients (the last one taken)."""
