"""The torch backend of `apply`: execute the `WrapPlan` that `actcfg translate --backend torch` prints.

Each selected module's forward runs through the plan's `api` (torch.utils.checkpoint.checkpoint)
with the plan's keyword arguments; with an offload plan, the root's forward runs inside the
offload engine's step (a `with` around it, as torch's OffloadWrapper scopes save_on_cpu) and each
group boundary is marked as its module is entered. Every tensor argument reaches the checkpoint
function positionally, so keyword and nested inputs are saved (and offloaded) like the others.
A `RulesPlan` does the same module by module: each module its rule's checkpoint and kwargs, and,
when a rule offloads, a group at every module a rule takes (moved only where its rule offloads;
what runs between them stays on the device).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import nn

from actcfg.runtime.wrap import (
    NotPicklable,
    call_inner,
    call_with_flat_tensors,
    drop_cache_for_recompute,
    label,
    override_forward,
    prepare_hf_model,
    refuse_stacked_checkpointing,
    select_by_rules,
    select_modules,
)
from actcfg.backends.torch import CHECKPOINT_API
from actcfg.errors import PolicyApplyError, TranslationError
from actcfg.runtime.offload import OffloadEngine, loopback_enabled
from actcfg.runtime.handle import AppliedPolicy
from actcfg.runtime.reports import CheckpointCounters, CheckpointReport, OffloadReport, RuleReport
from actcfg.runtime.workspaces import model_device
from actcfg.policy.schema import Policy
from actcfg.translators import CheckpointPlan, OffloadPlan, PlanRequest, RulesPlan, to_torch_native

__all__ = ["apply_torch", "block_groups", "resolve_ops"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def apply_torch(model: nn.Module, policy: Policy, handle: AppliedPolicy, mpu: Any) -> None:
    """Put `policy` into effect on `model` with torch's checkpoint and actcfg's offload engine."""
    if mpu is not None:
        raise PolicyApplyError("mpu= is for the deepspeed backend; the torch backend "
                               "takes no model-parallel unit (remove mpu=)")
    try:
        plan = to_torch_native(policy)
    except TranslationError as e:
        raise PolicyApplyError(str(e)) from e
    if isinstance(plan.checkpoint, PlanRequest):
        # runtime.apply plans first and hands the rules here; reaching this is a wiring bug.
        raise PolicyApplyError("checkpoint.mode auto must be planned before it is applied: call "
                               "actcfg.apply(model, policy, inputs=...)")
    device = _offload_device(model) if plan.offload is not None else None
    if isinstance(plan.checkpoint, RulesPlan):
        _apply_rules(model, policy, plan.checkpoint, plan.offload, handle, device)
        return
    if isinstance(plan.checkpoint, CheckpointPlan):
        refuse_stacked_checkpointing(model)
    if plan.checkpoint is not None or plan.offload is not None:
        prepare_hf_model(model, handle.undo)
    selected: list[tuple[str, nn.Module]] = []
    if isinstance(plan.checkpoint, CheckpointPlan):
        ck = plan.checkpoint
        selected = select_modules(model, ck.modules, ck.every)
        ops = resolve_ops(ck.selective_save_ops) if ck.selective_save_ops is not None else None
        impl = _Checkpointed(ck, ops, handle.counters)
        for name, module in selected:
            override_forward(handle.undo, module, impl, f"checkpointed ({policy.checkpoint.mode})")
        handle.set_checkpoint(CheckpointReport.of(policy, ck.api, tuple(n for n, _ in selected),
                                                  ck.kwargs()))
    elif plan.checkpoint is not None:
        handle.set_checkpoint(CheckpointReport.of(policy, None, (), {}))
    if plan.offload is not None:
        _apply_offload(model, plan.offload, selected, handle, device)


def _offload_device(model: nn.Module) -> torch.device:
    device = model_device(model)
    if device is None:  # no parameter or buffer: where a tensor would go by default
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    if device.type == "cuda" or (device.type == "cpu" and loopback_enabled()):
        return device
    if not torch.cuda.is_available():
        raise PolicyApplyError(
            "cpu_checkpointing: true needs a CUDA GPU (activations are offloaded from GPU memory "
            "to the host), and torch sees none here; set `cpu_checkpointing: false` to run on the CPU"
        )
    raise PolicyApplyError(
        f"cpu_checkpointing: true offloads GPU memory to the host, but the model is on {device}; "
        "move the model to the GPU before actcfg.apply, or set `cpu_checkpointing: false`"
    )


def resolve_ops(names: tuple[str, ...], where: str = "checkpoint.save_ops") -> list[Any]:
    """`aten.mm` -> every overload of `torch.ops.aten.mm`; `aten.mm.default` -> that overload.
    `where`: the key the names came from, for the error (`checkpoint.rules.0.save_ops`)."""
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
                f"{where}: {name!r} is not an op torch {torch.__version__} knows; "
                "write `namespace.op` or `namespace.op.overload`, such as `aten.mm` "
                "(see torch.ops.aten)"
            ) from e
    return out


class _Checkpointed:
    """A module's forward run through the plan's checkpoint function with the plan's kwargs.

    Counts, in eager mode, each checkpointed call and each run of the module's insides (the
    difference is what was recomputed); under torch.compile the compiled graph recomputes and
    nothing is counted (a counter inside a checkpointed region would break the graph).
    """

    def __init__(self, plan: CheckpointPlan, save_ops: list[Any] | None,
                 counters: CheckpointCounters | tuple[CheckpointCounters, ...]) -> None:
        self.api = _resolve(plan.api)
        self.kwargs = plan.kwargs()
        if save_ops is not None:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            self.kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_ops)
        self.reentrant = plan.use_reentrant
        # The handle's counters, and with rules the rule's own as well.
        self.counters = counters if isinstance(counters, tuple) else (counters,)

    def __call__(self, module: nn.Module, previous: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return call_inner(module, previous, *args, **kwargs)
        if module.training:
            kwargs = drop_cache_for_recompute(module, kwargs)
        counters = self.counters
        if not torch.compiler.is_compiling():
            for c in counters:
                c.calls += 1

            def counted(*a: Any, **k: Any) -> Any:
                for c in counters:
                    c.runs += 1
                return call_inner(module, previous, *a, **k)
        else:
            counted = functools.partial(call_inner, module, previous)
        trains = self.reentrant and any(p.requires_grad for p in module.parameters())
        return call_with_flat_tensors(self.api, counted, args, kwargs,
                                      needs_grad_input=trains, flat_outputs=self.reentrant,
                                      owner=module, **self.kwargs)


def _apply_rules(model: nn.Module, policy: Policy, plan: RulesPlan, offload: OffloadPlan | None,
                 handle: AppliedPolicy, device: torch.device | None) -> None:
    """Each module its rule: checkpointed through the rule's function and kwargs, and, when a
    rule offloads, an offload group at every module a rule takes."""
    rules = plan.rules
    if any(r.checkpoint != "none" for r in rules):
        refuse_stacked_checkpointing(model)
    prepare_hf_model(model, handle.undo)
    selected = select_by_rules(model, [r.modules for r in rules])
    handle.rule_counters = tuple(CheckpointCounters() for _ in rules)
    impls: dict[int, _Checkpointed] = {}
    for name, module, i in selected:
        rule = rules[i]
        checkpoint = rule.checkpoint_plan()
        if checkpoint is None:
            continue
        if i not in impls:
            ops = (resolve_ops(checkpoint.selective_save_ops, f"checkpoint.rules.{i}.save_ops")
                   if checkpoint.selective_save_ops is not None else None)
            impls[i] = _Checkpointed(checkpoint, ops, (handle.counters, handle.rule_counters[i]))
        override_forward(handle.undo, module, impls[i], f"checkpointed ({rule.checkpoint}, rule {i})")
    checkpointed = tuple(n for n, _, i in selected if rules[i].checkpoint != "none")
    kwargs = next((r.checkpoint_plan().kwargs() for r in rules if r.checkpoint != "none"), {})
    handle.set_checkpoint(CheckpointReport.of(policy, CHECKPOINT_API if checkpointed else None,
                                              checkpointed, kwargs))
    handle.set_rules(tuple(
        RuleReport(index=i, modules=tuple(n for n, _, j in selected if j == i), checkpoint=r.checkpoint,
                   offload=r.offload, save_ops=r.selective_save_ops)
        for i, r in enumerate(rules)))
    if offload is not None:
        _apply_offload(model, offload, [(n, m) for n, m, _ in selected], handle, device,
                       offloads=[rules[i].offload for _, _, i in selected],
                       recomputed=[rules[i].checkpoint != "none" for _, _, i in selected])


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- offload ---------------------------------------------------------------------------------


class _OffloadScope(NotPicklable):
    """The offload step around the enclosing module's forward, and a mark at each group's entry.

    The step is a `with` around the forward of the innermost module that contains every group,
    so a KeyboardInterrupt leaves it as any exception does. A model that calls its groups
    without calling that module (its layers reached as attributes) gets the step opened at the
    first group's entry instead, and closed after the last group's forward. Shared, not copied,
    by `copy.deepcopy`: a copy of the model offloads through the same engine (and pinned pool).
    The engine's step and marks run outside torch.compile's graphs (`torch.compiler.disable`):
    a mark traced once would never run again, and saved-tensor hooks are not traceable; the
    model's own forward inside the step is compiled.
    """

    def __init__(self, engine: OffloadEngine, gaps: bool = False) -> None:
        self.engine = engine
        self.gaps = gaps  # rules: what runs outside the groups stays on the device
        self.removed = False
        self.opened_at_group: Any = None
        self.group_names: dict[int, str] = {}
        """Group index -> the module that opened it, in the last step."""
        self.own_group: tuple[str, bool] | None = None
        """(name, offload) when the module whose forward is the step is a group itself (a rule
        that takes the root): the step marks it, as a pre-hook would open a second step."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadScope:
        return self

    def _training(self, module: nn.Module) -> bool:
        # By grad mode, not module.training: what autograd saves is what fills the GPU, and it
        # saves under grad mode whatever the module's mode (training in eval() mode, to keep
        # dropout off, is common). The checkpoint runs by grad mode too, and DeepSpeed's
        # cpu_checkpointing offloads regardless of mode; an eval()-mode step that offloaded
        # nothing here was silent. Evaluation under torch.no_grad()/inference_mode saves
        # nothing, and is not offloaded.
        if not torch.is_grad_enabled():
            return False
        if self.removed:
            raise PolicyApplyError(
                "this model is a copy of a model whose actcfg policy was removed, and its offload "
                "engine is closed; apply the policy to the original again, run the copy under "
                "torch.no_grad(), or take the policy off the copy with "
                "actcfg.strip_policy(copy)"
            )
        return True

    def __call__(self, module: nn.Module, previous: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._training(module):
            return call_inner(module, previous, *args, **kwargs)
        self._close_group_step()  # one a KeyboardInterrupt left open
        with self.engine.step(inputs=(args, kwargs)):  # the caller's batch stays
            self._begin()
            if self.own_group is not None:
                name, offload = self.own_group
                self.engine.mark_group(offload)
                self.group_names[self.engine.open_group_index] = name
            return call_inner(module, previous, *args, **kwargs)

    def _begin(self) -> None:
        self.group_names.clear()
        if self.gaps:
            self.engine.end_group()  # what runs before the first group stays on the device

    @torch.compiler.disable
    def mark(self, module: nn.Module, args: tuple[Any, ...], name: str = "", offload: bool = True,
             recomputed: bool = False) -> None:
        if not self.engine.in_step() and self._training(module):
            self._close_group_step()
            step = self.engine.step()
            step.__enter__()
            self.opened_at_group = step
            self._begin()
        self.engine.mark_group(offload, recomputed=module if recomputed else None)
        index = self.engine.open_group_index
        if index is not None:
            self.group_names[index] = name

    @torch.compiler.disable
    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.engine.end_group()

    @torch.compiler.disable
    def after_last(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._close_group_step()

    def _close_group_step(self) -> None:
        step, self.opened_at_group = self.opened_at_group, None
        if step is not None:
            step.__exit__(None, None, None)

    def close(self) -> None:
        self.removed = True
        self._close_group_step()
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


def _apply_offload(model: nn.Module, plan: OffloadPlan, selected: list[tuple[str, nn.Module]],
                   handle: AppliedPolicy, device: torch.device, offloads: list[bool] | None = None,
                   recomputed: list[bool] | None = None) -> None:
    if plan.scope == "rules":
        groups, grouping = selected, (
            "the modules the rules take (moved where their rule offloads; the others, and what "
            "runs between groups, stay on the device)")
    elif plan.scope == "checkpoint_inputs":
        groups, grouping = selected, "the checkpointed modules"
        every = getattr(handle.policy.checkpoint, "every", 1)
        if every > 1:
            # The engine's hooks cover the whole forward: what the unchecked modules between two
            # checkpointed ones save joins the group before it and is offloaded with it.
            grouping += (f" (one in every {every} matches; what the modules between them save is "
                         "offloaded with the group before it)")
    else:
        groups, grouping = block_groups(model)
    for name, module in groups:
        if isinstance(module, torch.jit.ScriptModule):
            raise PolicyApplyError(
                f"cpu_checkpointing: {label(name, module)} is a TorchScript module, on which actcfg "
                "cannot mark an offload group; apply the policy before torch.jit.script")
    engine = OffloadEngine(pin=plan.pin, pin_budget=plan.pin_budget,
                           pin_budget_per_node=plan.pin_budget_per_node, keep_last=plan.keep_last,
                           max_inflight=plan.max_inflight, device=device)
    engine.skip_tensors_of(model)
    rules = plan.scope == "rules"
    scope = _OffloadScope(engine, gaps=rules)
    handle.engine = engine
    handle.offload_group_names = scope.group_names
    handle.undo.push(scope.close)
    within, enclosing = _enclosing(model, [n for n, _ in groups])
    for k, (name, module) in enumerate(groups):
        if module is enclosing:  # the only group (nested ones are refused): the step marks it
            scope.own_group = (name, True if offloads is None else offloads[k])
            continue
        # A checkpointed module's backward begins with its recompute: the engine reloads the
        # group below once that backward is past the recompute's peak.
        checkpointed = plan.scope == "checkpoint_inputs" if recomputed is None else recomputed[k]
        mark = functools.partial(scope.mark, name=name,
                                 offload=True if offloads is None else offloads[k], recomputed=checkpointed)
        # prepend: the boundary is marked before any other pre-hook of the block saves tensors.
        handle.undo.push(module.register_forward_pre_hook(mark, prepend=True).remove)
        if rules:
            # what the modules between two groups save stays on the device
            handle.undo.push(module.register_forward_hook(scope.leave).remove)
    if groups and groups[-1][1] is not enclosing:
        last = groups[-1][1]
        handle.undo.push(last.register_forward_hook(scope.after_last, always_call=True).remove)
    override_forward(handle.undo, enclosing, scope, "offload scope")
    handle.set_offload(OffloadReport(
        engine=plan.engine, scope=plan.scope, pin=plan.pin and device.type == "cuda",
        pin_budget=plan.pin_budget, min_offload_bytes=engine.min_offload_bytes,
        device=str(engine.device), groups=tuple(n for n, _ in groups), grouping=grouping,
        within=within, pin_budget_per_node=plan.pin_budget_per_node,
    ))


def _enclosing(model: nn.Module, groups: list[str]) -> tuple[str, nn.Module]:
    """The innermost module with a forward of its own that contains every group: its forward is
    the offload step. Not always the root: a LightningModule's own forward is never called
    (Lightning calls training_step, which calls the model inside it)."""
    parents = [name.split(".")[:-1] for name in groups]
    common: list[str] = []
    for parts in zip(*parents) if parents else ():
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    while common:
        module = model.get_submodule(".".join(common))
        if type(module).forward is not nn.Module.forward and not isinstance(module, torch.jit.ScriptModule):
            return ".".join(common), module
        common.pop()
    return "", model
