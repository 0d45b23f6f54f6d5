"""Put a concrete policy into effect: `APPLIERS` by backend, and `apply_policy`, which runs one.

Each applier never changes a module, parameter or state_dict name (the torch applier executes
the translated `WrapPlan`; the DeepSpeed applier configures DeepSpeed and routes modules through
its checkpoint). Everything an applier does is pushed on the handle's `UndoStack`, run in
reverse by `AppliedPolicy.remove()` (and here if applying fails half-way). A `mode: auto`
policy is planned first, one layer up (`actcfg.api.apply`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from actcfg.errors import PolicyApplyError
from actcfg.policy.schema import Backend, Policy
from actcfg.runtime.compiling import apply_compile
from actcfg.runtime.deepspeed_applier import apply_deepspeed
from actcfg.runtime.handle import LIVE, AppliedPolicy
from actcfg.runtime.reports import PlanReport
from actcfg.runtime.torch_applier import apply_torch
from actcfg.runtime.workspaces import model_device, prime_matmul_workspaces
from actcfg.runtime.wrap import APPLIED, WRAPPED, Marker, strip_overrides

__all__ = ["APPLIERS", "Applier", "apply_policy", "refuse_if_applied", "runtime_backend",
           "strip_policy"]

log = logging.getLogger("actcfg")

Applier = Callable[[nn.Module, Policy, AppliedPolicy, Any], None]

APPLIERS: dict[Backend, Applier] = {
    Backend.TORCH: apply_torch,
    Backend.DEEPSPEED: apply_deepspeed,
}
"""The one place a backend maps to the code that applies it (`Backend.spec.runs` says which)."""


def apply_policy(model: nn.Module, policy: Policy, backend: Backend, *, mpu: Any = None,
                 source: Policy | None = None, plan: PlanReport | None = None) -> AppliedPolicy:
    """Apply `policy` (no `mode: auto`) with `backend`'s applier; the handle records `source`
    (the policy as written, when `policy` is its plan) and `plan`, and logs one line."""
    refuse_if_applied(model)
    handle = AppliedPolicy(model, source or policy, backend)
    if plan is not None:
        handle.set_plan(plan)
    try:
        APPLIERS[backend](model, policy, handle, mpu)
        if policy.compile is not None:  # after the rules, as torchtitan compiles after AC
            apply_compile(model, policy, handle)
        model.__dict__[APPLIED] = Marker(handle.summary())
        handle.undo.push(lambda: model.__dict__.pop(APPLIED, None))
        # So that the first step's peak is its later steps' (the planner's prediction).
        prime_matmul_workspaces(model_device(model))
    except BaseException:
        handle.remove()
        raise
    LIVE.add(handle)
    log.info(handle.summary())
    return handle


def strip_policy(model: nn.Module) -> int:
    """Take actcfg's edits off `model`, a `copy.deepcopy` of an applied model: its forward
    overrides, offload hooks and markers; returns how many edits were taken off (0: it carried
    none). The copy then computes plainly, can be saved with `torch.save` and applied again.

    A deep copy carries the policy (a copy that trains keeps its checkpointing, as copies of
    torch's checkpoint_wrapper do) but no handle of its own: the original's `remove()` undoes
    the original only. This is the copy's way back. A model (or a module of one) whose policy
    a handle still holds is refused: call that handle's `remove()`, which also restores what
    lives outside the model (DeepSpeed's settings, `use_cache`). What a copy inherited outside
    its modules stays as it is: a Hugging Face config copied with `use_cache` off keeps it off.
    """
    if not isinstance(model, nn.Module):
        raise PolicyApplyError(f"strip_policy() needs a torch.nn.Module, got {type(model).__name__}")
    mine = {id(m) for m in model.modules()}
    for handle in list(LIVE):
        if not handle.removed and any(id(m) in mine for m in handle.model.modules()):
            raise PolicyApplyError(
                "this model's actcfg policy is held by a live handle (the one apply() returned): "
                "call remove() on it, which undoes everything apply did; strip_policy is for a "
                "copy.deepcopy of an applied model, which has no handle of its own")
    return strip_overrides(model)


def runtime_backend(value: Backend | str) -> Backend:
    """`value` parsed as a backend `apply` runs; a translation target is refused."""
    chosen = Backend.parse(value)
    if chosen not in APPLIERS:
        raise PolicyApplyError(
            f"backend={chosen.value!r} is a translation target, not a runtime: actcfg.apply runs "
            + " or ".join(repr(b.value) for b in APPLIERS)
            + f" (`actcfg translate --backend {chosen.value}` prints its names)")
    return chosen


def refuse_if_applied(model: nn.Module) -> None:
    """Refuse a model that already carries a policy or torch's composable checkpoint."""
    for name, module in model.named_modules():
        where = f"`{name}`" if name else "the model"
        carried = module.__dict__.get(APPLIED) or module.__dict__.get(WRAPPED)
        if carried:
            raise PolicyApplyError(
                f"{where} already carries an actcfg policy ({carried}); "
                "call remove() on the handle apply() returned before applying again "
                "(a copy.deepcopy of an applied model carries the policy with it: "
                "actcfg.strip_policy(copy) takes it off)"
            )
        if "checkpoint" in _composable_registry(module):
            raise PolicyApplyError(
                f"{where} is already checkpointed by torch.distributed._composable.checkpoint; "
                "actcfg would checkpoint it twice: remove that call, or do not apply a policy"
            )


def _composable_registry(module: nn.Module) -> dict[str, Any]:
    """The composable APIs applied to `module`, by name (empty where torch has none)."""
    try:
        contract = importlib.import_module("torch.distributed._composable.contract")
        return dict(contract._get_registry(module) or {})
    except (ImportError, AttributeError):
        return {}
