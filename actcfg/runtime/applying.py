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
from actcfg.runtime.deepspeed_applier import apply_deepspeed
from actcfg.runtime.handle import AppliedPolicy
from actcfg.runtime.reports import PlanReport
from actcfg.runtime.torch_applier import apply_torch
from actcfg.runtime.wrap import APPLIED, WRAPPED, Marker

__all__ = ["APPLIERS", "Applier", "apply_policy", "refuse_if_applied", "runtime_backend"]

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
        model.__dict__[APPLIED] = Marker(handle.summary())
        handle.undo.push(lambda: model.__dict__.pop(APPLIED, None))
    except BaseException:
        handle.remove()
        raise
    log.info(handle.summary())
    return handle


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
                "(a copy.deepcopy of an applied model carries the policy with it)"
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
