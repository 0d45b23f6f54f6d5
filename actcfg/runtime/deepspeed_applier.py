"""The deepspeed backend of `apply`: configure DeepSpeed's activation checkpointing, check its
state, and route the selected modules through `deepspeed.checkpointing.checkpoint`.

DeepSpeed keeps these settings in module globals (one policy per process), so the state before
`configure` is saved and put back by `remove()` when the last live DeepSpeed policy goes. The
routed call passes every tensor argument positionally (DeepSpeed's checkpoint, like torch's
reentrant one, gives no gradient to a tensor inside a container or a keyword), and rebuilds
the module's output structure (it would turn a dict into a tuple of its keys).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from actcfg.runtime.wrap import (
    call_inner,
    call_with_flat_tensors,
    class_name,
    drop_cache_for_recompute,
    override_forward,
    prepare_hf_model,
    refuse_stacked_checkpointing,
    select_modules,
)
from actcfg.errors import PolicyApplyError, TranslationError, install_command
from actcfg.runtime.handle import AppliedPolicy
from actcfg.runtime.reports import CheckpointCounters, CheckpointReport, DeepSpeedReport
from actcfg.policy.schema import Policy

__all__ = ["apply_deepspeed", "as_mpu", "current_state", "fresh_alias", "model_parallel_size",
           "mpu_from_group", "read_back"]

# configure() kwarg -> the global of deepspeed/runtime/activation_checkpointing/checkpointing.py
# it sets (ckpt.py:1202-1226).
GLOBAL_BY_KWARG = {
    "partition_activations": "PARTITION_ACTIVATIONS",
    "contiguous_checkpointing": "CONTIGUOUS_CHECKPOINTING",
    "num_checkpoints": "num_layers",
    "checkpoint_in_cpu": "CPU_CHECKPOINT",
    "synchronize": "SYNCHRONIZE",
    "profile": "PROFILE_TIME",
}
# Everything configure() may change, saved before it and restored by remove().
_STATE = (*GLOBAL_BY_KWARG.values(), "mpu", "mp_rank", "mp_size", "mp_group",
          "deepspeed_checkpointing_enabled")

# Live DeepSpeed policies in this process: [(configure kwargs, mpu, saved state)].
_LIVE: list[tuple[dict[str, Any], Any, dict[str, Any]]] = []


def _deepspeed() -> Any:
    try:
        from deepspeed.runtime.activation_checkpointing import checkpointing
    except ImportError as e:
        raise PolicyApplyError(
            "the deepspeed backend needs DeepSpeed, which is not installed: "
            f"{install_command('deepspeed')}, or set `backend: torch`"
        ) from e
    return checkpointing


def model_parallel_size(mpu: Any) -> int:
    """The model-parallel world size DeepSpeed will read from `mpu` (1 without one)."""
    if mpu is None:
        return 1
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(callable(getattr(mpu, prefix + f, None)) for f in ("rank", "world_size", "group")):
            return int(getattr(mpu, prefix + "world_size")())
    raise PolicyApplyError(
        f"mpu={type(mpu).__name__!r} has neither get_tensor_model_parallel_rank/world_size/group "
        "nor get_model_parallel_rank/world_size/group, which DeepSpeed reads; pass DeepSpeed's "
        "mpu object, or actcfg.api.mpu_from_group(process_group)"
    )


def as_mpu(mpu: Any) -> Any:
    """What DeepSpeed reads the model-parallel group from: a process group or a one-dimensional
    DeviceMesh becomes an mpu (`mpu_from_group`); DeepSpeed's own mpu objects pass as they are."""
    import torch.distributed as dist

    if mpu is None or not dist.is_available():
        return mpu
    if isinstance(mpu, dist.ProcessGroup):
        return mpu_from_group(mpu)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mpu, DeviceMesh):
        if mpu.ndim != 1:
            names = ", ".join(repr(n) for n in (mpu.mesh_dim_names or ()))
            raise PolicyApplyError(
                f"mpu= is a {mpu.ndim}-dimensional DeviceMesh: pass its model-parallel dimension, "
                f"such as mpu=mesh['tp']" + (f" (dimensions: {names})" if names else ""))
        return mpu_from_group(mpu.get_group())
    return mpu


def apply_deepspeed(model: nn.Module, policy: Policy, handle: AppliedPolicy, mpu: Any) -> None:
    """Configure DeepSpeed for `policy`, verify its state and route the selected modules."""
    from actcfg.translators import to_deepspeed

    ckpt = _deepspeed()
    try:
        section = to_deepspeed(policy)
    except TranslationError as e:
        raise PolicyApplyError(str(e)) from e
    kwargs = dict(section["configure_kwargs"])
    route = section["route"]
    mpu = as_mpu(mpu)
    mp_size = model_parallel_size(mpu)
    if kwargs["partition_activations"] and mp_size <= 1:
        raise PolicyApplyError(
            "partition: true needs a model-parallel group larger than one, and "
            + ("no mpu= was given" if mpu is None else f"mpu= has model-parallel size {mp_size}")
            + ": DeepSpeed would shard nothing, and on one GPU its partition path returned wrong "
            "gradients in three of four small models; pass mpu= with model-parallel size > 1, "
            "or set `partition: false`"
        )
    if kwargs["checkpoint_in_cpu"] and not kwargs["partition_activations"]:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            # On the CPU accelerator DeepSpeed 0.19.8 takes a blocking-copy path whose backward
            # fails ("element 0 of tensors does not require grad"; BACKENDS.md 1.3).
            raise PolicyApplyError(
                "cpu_checkpointing: true with the deepspeed backend needs a GPU: DeepSpeed's CPU "
                "accelerator offloads nothing useful and its backward fails; set "
                "`cpu_checkpointing: false` to run on the CPU"
            )
    # checkpoint.mode none: nothing is routed, but DeepSpeed is still configured explicitly
    # (to its defaults), so its state is known rather than whatever an earlier caller left.
    # mode external: the model calls deepspeed.checkpointing.checkpoint itself.
    routes = route is not None and "modules" in route
    if routes:
        refuse_stacked_checkpointing(model)
    selected = select_modules(model, tuple(route["modules"]), route["every"]) if routes else []
    notes: list[str] = []
    if kwargs["contiguous_checkpointing"] and kwargs["num_checkpoints"] is None:
        if not routes:
            raise PolicyApplyError(
                "contiguous: true needs num_checkpoints here: the model calls "
                "deepspeed.checkpointing.checkpoint itself (checkpoint.mode external), so actcfg "
                "cannot count its checkpointed calls per step; set `num_checkpoints` to that count")
        # DeepSpeed sizes one contiguous buffer per checkpointed call between backwards:
        # exactly the modules routed here.
        kwargs["num_checkpoints"] = len(selected)
        notes.append(f"num_checkpoints set to {len(selected)}, the number of routed modules")
    if kwargs["contiguous_checkpointing"] and kwargs["num_checkpoints"] < len(selected):
        raise PolicyApplyError(
            f"num_checkpoints: {kwargs['num_checkpoints']} is fewer than the {len(selected)} "
            "modules routed through deepspeed.checkpointing.checkpoint (DeepSpeed's contiguous "
            f"buffers would fail with IndexError); set `num_checkpoints: {len(selected)}` or more"
        )
    import deepspeed.comm as dist

    if not dist.is_initialized():
        raise PolicyApplyError(
            "the deepspeed backend needs torch.distributed initialised before apply "
            "(deepspeed.checkpointing.configure calls dist.get_rank()): call "
            "deepspeed.init_distributed() or deepspeed.initialize() first, even on one GPU"
        )
    for live_kwargs, live_mpu, _ in _LIVE:
        if live_kwargs != kwargs or live_mpu != mpu:
            raise PolicyApplyError(
                "another DeepSpeed policy is live in this process with different settings "
                f"({_describe(live_kwargs)}); DeepSpeed keeps one activation-checkpointing "
                "configuration per process: remove() the other policy first"
            )

    if route is not None:
        prepare_hf_model(model, handle.undo)
    saved = {name: getattr(ckpt, name) for name in _STATE}
    entry = (kwargs, mpu, saved)
    _LIVE.append(entry)
    handle.undo.push(lambda: _restore(entry))  # also undoes a configure() that failed half-way
    try:
        ckpt.configure(mpu, **kwargs)
    except (AssertionError, TypeError, ValueError, AttributeError) as e:
        raise PolicyApplyError(f"deepspeed.checkpointing.configure refused the policy: {e!r}") from e
    state = read_back(ckpt)
    differ = {k: (v, state[k]) for k, v in kwargs.items() if state[k] != v}
    if not ckpt.is_configured():
        differ["is_configured()"] = (True, False)
    if ckpt.mp_size != mp_size:
        differ["model-parallel size"] = (mp_size, ckpt.mp_size)
    if differ:
        raise PolicyApplyError(
            "DeepSpeed's activation-checkpointing state after configure() differs from the "
            "policy: " + "; ".join(f"{k}: wanted {w!r}, DeepSpeed has {h!r}"
                                   for k, (w, h) in differ.items())
        )

    forward = _DeepSpeedForward(handle.counters, mp_size if kwargs["partition_activations"] else 1)
    for _, module in selected:
        override_forward(handle.undo, module, forward, "routed through deepspeed.checkpointing.checkpoint")
    if route is not None:
        handle.set_checkpoint(CheckpointReport.of(
            policy, route["function"], tuple(n for n, _ in selected), {}, tuple(notes)))
    handle.set_deepspeed(DeepSpeedReport(
        configure_kwargs=kwargs,
        state={**state, "is_configured": ckpt.is_configured(), "mp_size": ckpt.mp_size},
        mp_size=int(ckpt.mp_size),
        mpu=None if mpu is None else repr(mpu),
        input_guard="checkpointed modules receive fresh aliases of their tensor inputs",
    ), current_state)


def current_state() -> dict[str, Any]:
    """DeepSpeed's activation-checkpointing settings as they are now, by configure() keyword."""
    return read_back(_deepspeed())


def read_back(ckpt: Any) -> dict[str, Any]:
    """DeepSpeed's activation-checkpointing globals, keyed by configure() kwarg."""
    return {kwarg: getattr(ckpt, name) for kwarg, name in GLOBAL_BY_KWARG.items()}


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _restore(entry: tuple[dict[str, Any], Any, dict[str, Any]]) -> None:
    ckpt = _deepspeed()
    index = next(i for i, e in enumerate(_LIVE) if e is entry)
    del _LIVE[index]
    if index == 0 and _LIVE:
        # A later policy with the same settings is still live: it inherits the state to restore.
        later = _LIVE[0]
        _LIVE[0] = (later[0], later[1], entry[2])
        return
    if not _LIVE:
        ckpt.reset()
        for name, value in entry[2].items():
            setattr(ckpt, name, value)


class _Alias(torch.autograd.Function):
    """A new tensor object on the same storage, with gradients passed straight through.

    Unlike `x.view_as(x)`, it is not a view, so it holds no reference to `x` and DeepSpeed's
    `arg.data = torch.empty([])` frees the storage once the caller lets go of `x`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fresh_alias(value: Any) -> Any:
    """What DeepSpeed may empty in place instead of the caller's tensor."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad and torch.is_grad_enabled():
        return _Alias.apply(value)
    return value.detach()


class _DeepSpeedForward:
    """A module's forward run under `deepspeed.checkpointing.checkpoint`.

    With partition or cpu checkpointing, DeepSpeed empties the tensors passed to checkpoint()
    after it returns (`arg.data = torch.empty([])`, ckpt.py:456/491/545), so a caller computing
    `x + block(x)` would silently add garbage (BACKENDS.md 1.4). Every tensor argument is passed
    as a fresh alias, so only the alias is emptied and the caller's tensor keeps its values.
    """

    def __init__(self, counters: CheckpointCounters, partition_size: int) -> None:
        self.counters = counters
        self.partition_size = partition_size

    def __call__(self, module: nn.Module, previous: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            # No graph, nothing to recompute: DeepSpeed would only copy (and, with contiguous
            # buffers, fill buffers that no backward ever frees).
            return call_inner(module, previous, *args, **kwargs)
        ckpt = _deepspeed()
        if module.training:
            kwargs = drop_cache_for_recompute(module, kwargs)
        args, kwargs = _fresh_aliases(args), _fresh_aliases(kwargs)
        if self.partition_size > 1:
            _refuse_indivisible(module, (args, kwargs), self.partition_size)
        counters = self.counters
        counters.calls += 1

        def counted(*a: Any, **k: Any) -> Any:
            counters.runs += 1
            return call_inner(module, previous, *a, **k)

        trains = any(p.requires_grad for p in module.parameters())
        autocast = _autocast_state()
        if autocast:
            # DeepSpeed's recompute runs outside the forward's autocast (it restores the RNG
            # state, not the autocast state): a bf16 forward was recomputed in fp32, so backward
            # differentiated other activations than the forward's. Re-enter it, as torch's does.
            inner = counted

            def counted(*a: Any, **k: Any) -> Any:
                with contextlib.ExitStack() as stack:
                    for device_type, dtype, cache in autocast:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
                    return inner(*a, **k)
        try:
            return call_with_flat_tensors(ckpt.checkpoint, counted, args, kwargs,
                                          needs_grad_input=trains, flat_outputs=True, owner=module)
        except BaseException:
            # A failed forward leaves contiguous-buffer offsets and offload ids behind;
            # reset() clears them so the next step starts clean.
            ckpt.reset()
            raise


def _autocast_state() -> list[tuple[str, torch.dtype, bool]]:
    """(device type, dtype, cache enabled) of each autocast in effect now."""
    cache = torch.is_autocast_cache_enabled()
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return [(d, torch.get_autocast_dtype(d), cache) for d in devices if torch.is_autocast_enabled(d)]


def _fresh_aliases(value: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(fresh_alias, value)


def _refuse_indivisible(module: nn.Module, inputs: Any, size: int) -> None:
    """DeepSpeed asserts ("Doesn't handle if partition activation if item is not divisible by mp
    size") on a floating tensor whose element count the model-parallel size does not divide."""
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(inputs):
        if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= size
                and t.numel() % size):
            raise PolicyApplyError(
                f"partition: a checkpointed {class_name(module)} was called with a tensor of shape "
                f"{list(t.shape)} ({t.numel()} elements), which does not split across the "
                f"model-parallel group of {size}: DeepSpeed partitions each checkpointed input "
                f"evenly; make its size a multiple of {size} (batch, sequence or hidden size), "
                "or set `partition: false`")


def mpu_from_group(group: Any) -> Any:
    """A DeepSpeed model-parallel unit (mpu) for a torch.distributed process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PolicyApplyError(
            "mpu_from_group needs torch.distributed initialised: call "
            "deepspeed.init_distributed() (or torch.distributed.init_process_group) first"
        )
    return _GroupMPU(group)


class _GroupMPU:
    """The model-parallel queries DeepSpeed's activation checkpointing makes, on one group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def get_model_parallel_group(self) -> Any:
        return self.group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _GroupMPU) and other.group is self.group

    def __hash__(self) -> int:
        return id(self.group)

    def __repr__(self) -> str:
        return f"<actcfg mpu: model-parallel size {self.get_model_parallel_world_size()}>"
