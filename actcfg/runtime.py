"""Put a policy into effect on a model: checkpoint wrapping, activation offload, DeepSpeed routing.

`apply(model, cfg)` is the one entry point. It never changes a module, parameter or state_dict
name: non-reentrant checkpointing goes through torch's composable `checkpoint` (forward hooks),
reentrant and selective checkpointing and DeepSpeed routing replace the *instance's* `forward`
with a bound method of a small callable, so `copy.deepcopy` rebinds it to the copy and the copy
computes with its own weights. Everything `apply` does is recorded as an undo step, run in
reverse by `AppliedPolicy.remove()` (and by `apply` itself if it fails half-way).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actcfg._deepspeed_route import apply as route_through_deepspeed
from actcfg._deepspeed_route import mpu_from_group
from actcfg._wrap import WRAPPED, grad_path, inner_forward, override_forward, select_modules
from actcfg.errors import PolicyApplyError, TranslationError
from actcfg.schema import Backend, Policy, format_size

__all__ = ["AppliedPolicy", "apply", "block_groups", "mpu_from_group", "resolve_ops", "select_modules"]

log = logging.getLogger("actcfg")

# Set in a module's __dict__ by apply; copy.deepcopy carries them, so a copy of an applied
# model is recognised too (applying to it again would wrap twice).
_APPLIED = "_actcfg_applied"
_CONTAINERS = (nn.ModuleList, nn.Sequential)


# --- the handle --------------------------------------------------------------------------


class AppliedPolicy:
    """What `apply` did to a model; `remove()` undoes all of it. Usable as a context manager."""

    def __init__(self, model: nn.Module, policy: Policy, backend: Backend) -> None:
        self.model = model
        self.policy = policy
        self.backend = backend
        self.checkpointed: tuple[str, ...] = ()
        """Qualified names of the checkpointed (or DeepSpeed-routed) modules, in module order."""
        self.checkpoint_api: str | None = None
        """The function that checkpoints them."""
        self.offload: dict[str, Any] | None = None
        """Live offload settings: scope, pin, pin_budget, group boundaries and how they were chosen."""
        self.deepspeed: dict[str, Any] | None = None
        """DeepSpeed settings: the configure() kwargs passed and the module state read back."""
        self.engine: Any = None
        """The `actcfg.offload.OffloadEngine`, when actcfg offloads (torch backend)."""
        self._undo: list[Callable[[], None]] = []
        self._removed = False

    @property
    def removed(self) -> bool:
        """True once `remove()` has run."""
        return self._removed

    def report(self) -> dict[str, Any]:
        """Everything applied, as JSON-able data."""
        ckpt = self.policy.checkpoint
        return {
            "backend": str(self.backend),
            "checkpoint": None if ckpt.mode == "none" else {
                "mode": ckpt.mode,
                "api": self.checkpoint_api,
                "modules": list(self.checkpointed),
                "every": ckpt.every,
                "reentrant": ckpt.reentrant,
                "save_ops": list(ckpt.save_ops) if ckpt.mode == "selective" else None,
            },
            "offload": self.offload,
            "deepspeed": self.deepspeed,
        }

    def summary(self) -> str:
        """One line: what is checkpointed, offloaded and configured."""
        ckpt = self.policy.checkpoint
        parts = [f"actcfg: backend {self.backend}"]
        if ckpt.mode == "none":
            parts.append("no checkpointing")
        else:
            every = f", every {ckpt.every}" if ckpt.every > 1 else ""
            parts.append(f"{ckpt.mode} checkpointing of {len(self.checkpointed)} modules "
                         f"({_short_list(self.checkpointed)}{every}) via {self.checkpoint_api}")
        if self.offload is not None:
            budget = self.offload["pin_budget"]
            mem = ("pinned" + (f" up to {format_size(budget)}" if budget is not None else "")
                   if self.offload["pin"] else "pageable")
            parts.append(f"cpu offload of {self.offload['scope']} into {mem} host memory, "
                         f"{len(self.offload['groups'])} groups ({self.offload['grouping']})")
        elif self.deepspeed is not None and self.policy.cpu_checkpointing:
            parts.append("DeepSpeed cpu_checkpointing")
        if self.deepspeed is not None:
            on = [k for k, v in self.deepspeed["configure_kwargs"].items() if v not in (False, None)]
            parts.append("deepspeed.checkpointing.configure(" + (", ".join(on) or "defaults") + ")")
        return "; ".join(parts)

    def remove(self) -> None:
        """Undo everything `apply` did: hooks, forward overrides, offload engine, DeepSpeed state."""
        if self._removed:
            return
        self._removed = True
        errors: list[BaseException] = []
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except Exception as e:  # keep undoing; report the first failure after
                errors.append(e)
        if errors:
            raise PolicyApplyError(f"remove() could not undo everything: {errors[0]}") from errors[0]

    def __enter__(self) -> AppliedPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "live"
        return f"<AppliedPolicy {state}: {self.summary()}>"


def _short_list(names: tuple[str, ...], limit: int = 3) -> str:
    shown = ", ".join(n or "<root>" for n in names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


# --- the entry point ---------------------------------------------------------------------


def apply(model: nn.Module, cfg: Any, *, backend: Backend | str | None = None,
          mpu: Any = None) -> AppliedPolicy:
    """Put the policy `cfg` (path, YAML string, dict or Policy) into effect on `model`."""
    from actcfg.checker import load

    if not isinstance(model, nn.Module):
        raise PolicyApplyError(f"apply() needs a torch.nn.Module, got {type(model).__name__}")
    chosen = None if backend is None else _backend(backend)
    policy = load(cfg, backends=() if chosen is None else (chosen,))
    chosen = chosen or policy.backend
    _refuse_if_applied(model)
    handle = AppliedPolicy(model, policy, chosen)
    try:
        if chosen is Backend.TORCH:
            if mpu is not None:
                raise PolicyApplyError("mpu= is for the deepspeed backend; the torch backend "
                                       "takes no model-parallel unit (remove mpu=)")
            _apply_torch(model, policy, handle)
        else:
            _apply_deepspeed(model, policy, handle, mpu)
        model.__dict__[_APPLIED] = handle.summary()
        handle._undo.append(lambda: model.__dict__.pop(_APPLIED, None))
    except BaseException:
        handle.remove()
        raise
    log.info(handle.summary())
    return handle


def _backend(value: Backend | str) -> Backend:
    chosen = Backend.parse(value)
    if not chosen.spec.runs:
        raise PolicyApplyError(
            f"backend={chosen.value!r} is a translation target, not a runtime: actcfg.apply runs "
            "the torch or the deepspeed backend (a trainer integration applies either)")
    return chosen


def _refuse_if_applied(model: nn.Module) -> None:
    for name, module in model.named_modules():
        where = f"`{name}`" if name else "the model"
        carried = module.__dict__.get(_APPLIED) or module.__dict__.get(WRAPPED)
        if carried:
            raise PolicyApplyError(
                f"{where} already carries an actcfg policy ({carried}); "
                "call remove() on the handle apply() returned before applying again "
                "(a copy.deepcopy of an applied model carries the policy with it)"
            )
        if "checkpoint" in _composable_registry(module):
            raise PolicyApplyError(
                f"{where} is already checkpointed by torch.distributed._composable.checkpoint; "
                "actcfg would checkpoint it twice: remove that call, or do not apply a policy"
            )


def _add_hook(handle: AppliedPolicy, hook_handle: torch.utils.hooks.RemovableHandle) -> None:
    handle._undo.append(hook_handle.remove)


# --- torch backend -----------------------------------------------------------------------


def _apply_torch(model: nn.Module, policy: Policy, handle: AppliedPolicy) -> None:
    from actcfg.translate import to_torch_native

    try:
        plan = to_torch_native(policy)
    except TranslationError as e:
        raise PolicyApplyError(str(e)) from e
    if plan.offload is not None and not torch.cuda.is_available():
        raise PolicyApplyError(
            "cpu_checkpointing: true needs a CUDA GPU (activations are offloaded from GPU memory "
            "to the host), and torch sees none here; set `cpu_checkpointing: false` to run on the CPU"
        )
    selected: list[tuple[str, nn.Module]] = []
    if plan.checkpoint is not None:
        ck = plan.checkpoint
        selected = select_modules(model, ck.modules, ck.every)
        if ck.selective_save_ops is not None:
            ops = resolve_ops(ck.selective_save_ops)
            forward = _CheckpointedForward(False, ck.preserve_rng_state, ops)
            handle.checkpoint_api = ("torch.utils.checkpoint.checkpoint(use_reentrant=False, "
                                     "context_fn=create_selective_checkpoint_contexts)")
        elif ck.use_reentrant:
            forward = _CheckpointedForward(True, ck.preserve_rng_state, None)
            handle.checkpoint_api = "torch.utils.checkpoint.checkpoint(use_reentrant=True)"
        elif _composable_available():
            forward = None
            handle.checkpoint_api = "torch.distributed._composable.checkpoint"
        else:  # a torch built without torch.distributed: the same checkpoint, by forward override
            forward = _CheckpointedForward(False, ck.preserve_rng_state, None)
            handle.checkpoint_api = "torch.utils.checkpoint.checkpoint(use_reentrant=False)"
        for name, module in selected:
            if forward is None:
                _composable_checkpoint(handle, module, ck.preserve_rng_state)
            else:
                override_forward(handle, name, module, forward, f"checkpointed ({policy.checkpoint.mode})")
        handle.checkpointed = tuple(n for n, _ in selected)
    if plan.offload is not None:
        _apply_offload(model, plan.offload, selected, handle)


_COMPOSABLE_PREFIX = "__composable_api"  # torch's composable APIs keep their state under such keys


def _composable_registry(module: nn.Module) -> dict[str, Any]:
    """The composable APIs applied to `module`, by name (empty where torch has none)."""
    try:
        contract = importlib.import_module("torch.distributed._composable.contract")
        return dict(contract._get_registry(module) or {})
    except (ImportError, AttributeError):
        return {}


def _composable_available() -> bool:
    try:
        importlib.import_module("torch.distributed._composable.checkpoint_activation")
    except ImportError:
        return False
    return True


def _composable_checkpoint(handle: AppliedPolicy, module: nn.Module, preserve_rng_state: bool) -> None:
    """torch's composable (hook-based, name-keeping) non-reentrant checkpoint, undoably.

    It returns no hook handles, so the hooks and the composable state it adds to the module's
    __dict__ are found by difference and taken out again on remove().
    """
    from torch.distributed._composable import checkpoint

    d = module.__dict__
    state_before = {k: set(v) for k, v in d.items()
                    if k.startswith(_COMPOSABLE_PREFIX) and isinstance(v, dict)}
    pre = set(module._forward_pre_hooks)
    post = set(module._forward_hooks)
    checkpoint(module, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    new_pre = [k for k in module._forward_pre_hooks if k not in pre]
    new_post = [k for k in module._forward_hooks if k not in post]
    added = {k: [e for e in v if e not in state_before.get(k, ())] for k, v in d.items()
             if k.startswith(_COMPOSABLE_PREFIX) and isinstance(v, dict)}
    d[WRAPPED] = "checkpointed (full, composable)"

    def undo() -> None:
        for k in new_pre:
            module._forward_pre_hooks.pop(k, None)
            module._forward_pre_hooks_with_kwargs.pop(k, None)
        for k in new_post:
            module._forward_hooks.pop(k, None)
            module._forward_hooks_with_kwargs.pop(k, None)
            module._forward_hooks_always_called.pop(k, None)
        for key, entries in added.items():
            if key not in state_before:
                d.pop(key, None)
            else:
                for e in entries:
                    d[key].pop(e, None)
        d.pop(WRAPPED, None)

    handle._undo.append(undo)


def resolve_ops(names: tuple[str, ...]) -> list[Any]:
    """`aten.mm` -> every overload of `torch.ops.aten.mm`; `aten.mm.default` -> that overload."""
    out: list[Any] = []
    for name in names:
        ns, _, rest = name.partition(".")
        op_name, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op_name)
            if overload:
                out.append(getattr(packet, overload))
            else:
                out.extend(getattr(packet, o) for o in packet.overloads())
        except (AttributeError, RuntimeError) as e:
            raise PolicyApplyError(
                f"checkpoint.save_ops: {name!r} is not an op torch {torch.__version__} knows; "
                "write `namespace.op` or `namespace.op.overload`, such as `aten.mm` "
                "(see torch.ops.aten)"
            ) from e
    return out


class _CheckpointedForward:
    """A module's forward run under `torch.utils.checkpoint.checkpoint`.

    Bound to its module with `types.MethodType`, so `copy.deepcopy` of the model rebinds it to
    the copy; it holds only settings, never a module.
    """

    def __init__(self, reentrant: bool, preserve_rng_state: bool, save_ops: list[Any] | None) -> None:
        self.reentrant = reentrant
        self.preserve_rng_state = preserve_rng_state
        self.save_ops = save_ops

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        fn = inner_forward(module)
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if not self.reentrant:
            extra: dict[str, Any] = {}
            if self.save_ops is not None:
                extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, self.save_ops)
            return checkpoint(fn, *args, use_reentrant=False,
                              preserve_rng_state=self.preserve_rng_state, **extra, **kwargs)
        tensor_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if tensor_kwargs:
            raise PolicyApplyError(
                f"checkpoint.reentrant: {type(module).__name__} was called with tensor keyword "
                f"argument(s) {', '.join(tensor_kwargs)}, which torch's reentrant checkpoint cannot "
                "track for gradients; remove `reentrant: true` (non-reentrant handles them)"
            )
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        return checkpoint(fn, *grad_path(module, args), use_reentrant=True,
                          preserve_rng_state=self.preserve_rng_state)


# --- offload -----------------------------------------------------------------------------


class _OffloadScope:
    """The forward hooks that scope the offload engine to training forwards of the model.

    Shared, not copied, by `copy.deepcopy`: a copy of the model offloads through the same
    engine (and the same pinned pool).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.removed = False
        self._ctx: Any = None
        self._root: int | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadScope:
        return self

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._ctx is not None:
            # The last forward of the root never reached its exit hook: torch runs always_call
            # hooks when forward raises an Exception, not on KeyboardInterrupt or SystemExit.
            # Close that scope now, so it cannot offload this forward's neighbours any longer.
            self._exit_scope()
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.removed:
            raise PolicyApplyError(
                "this model is a copy of a model whose actcfg policy was removed, and its offload "
                "engine is closed; apply the policy to the original again, or train the copy in "
                "torch.no_grad()/eval mode"
            )
        ctx = self.engine.step()
        ctx.__enter__()
        self._ctx, self._root = ctx, id(module)

    def exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # always_call=True: also runs when forward raised an Exception, so the scope ends with it.
        if self._ctx is not None and self._root == id(module):
            self._exit_scope()

    def _exit_scope(self) -> None:
        ctx, self._ctx, self._root = self._ctx, None, None
        ctx.__exit__(None, None, None)

    def mark(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._ctx is not None:
            self.engine.mark_group()

    def close(self) -> None:
        self.removed = True
        if self._ctx is not None:
            self._exit_scope()
        self.engine.close()


def block_groups(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], str]:
    """Offload group boundaries without checkpointing: the children of the outermost block
    containers (ModuleList/Sequential), else the model's top-level children."""
    containers: list[str] = []
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        if any(name == c or name.startswith(c + ".") if c else True for c in containers):
            continue
        containers.append(name)
        prefix = f"{name}." if name else ""
        out.extend((prefix + n, m) for n, m in module.named_children())
    if out:
        where = ", ".join(f"`{c}`" if c else "the model" for c in containers)
        return out, f"children of {where}"
    return [(n, m) for n, m in model.named_children()], "top-level children of the model"


def _apply_offload(model: nn.Module, plan: Any, selected: list[tuple[str, nn.Module]],
                   handle: AppliedPolicy, engine_type: Any = None) -> None:
    if engine_type is None:
        from actcfg.offload import OffloadEngine as engine_type
    if plan.scope == "checkpoint_inputs":
        groups, grouping = selected, "the checkpointed modules"
        every = getattr(handle.policy.checkpoint, "every", 1)
        if every > 1:
            # The engine's hooks cover the whole forward: what the unchecked modules between two
            # checkpointed ones save joins the group before it and is offloaded with it.
            grouping += (f" (one in every {every} matches; what the modules between them save is "
                         "offloaded with the group before it)")
    else:
        groups, grouping = block_groups(model)
    device = next((p.device for p in model.parameters() if p.is_cuda), None)
    engine = engine_type(pin=plan.pin, pin_budget=plan.pin_budget, device=device)
    engine.skip_tensors_of(model)
    scope = _OffloadScope(engine)
    handle.engine = engine
    handle._undo.append(scope.close)
    for _, module in groups:
        # prepend: a boundary must be marked before a composable checkpoint pre-hook saves
        # the block's inputs.
        _add_hook(handle, module.register_forward_pre_hook(scope.mark, prepend=True))
    # Outermost on the root: the engine's saved-tensor hooks must enclose any checkpoint hooks.
    _add_hook(handle, model.register_forward_pre_hook(scope.enter, prepend=True))
    _add_hook(handle, model.register_forward_hook(scope.exit, always_call=True))
    handle.offload = {
        "scope": plan.scope,
        "pin": plan.pin,
        "pin_budget": plan.pin_budget,
        "min_offload_bytes": engine.min_offload_bytes,
        "device": str(engine.device),
        "groups": [n for n, _ in groups],
        "grouping": grouping,
    }


# --- deepspeed backend -------------------------------------------------------------------


def _apply_deepspeed(model: nn.Module, policy: Policy, handle: AppliedPolicy, mpu: Any) -> None:
    route_through_deepspeed(model, policy, handle, mpu)