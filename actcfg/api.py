"""`apply`, the one runtime entry point: load the policy, plan it first when it says
`checkpoint.mode: auto`, then put it into effect (`actcfg.runtime.applying`).

It sits above the planner and the runtime, so neither imports the other through it:
the planner applies its uniform trial policies with `apply_policy` directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from actcfg.errors import PolicyApplyError
from actcfg.policy.checker import load
from actcfg.policy.schema import Backend
from actcfg.runtime.deepspeed_applier import mpu_from_group
from actcfg.runtime.handle import AppliedPolicy
from actcfg.runtime.applying import apply_policy, refuse_if_applied, runtime_backend

__all__ = ["AppliedPolicy", "apply", "mpu_from_group"]

log = logging.getLogger("actcfg")


def apply(model: nn.Module, cfg: Any, *, backend: Backend | str | None = None,
          mpu: Any = None, inputs: Any = None, loss_fn: Callable[[Any], Any] | None = None) -> AppliedPolicy:
    """Put the policy `cfg` (path, YAML string, dict or Policy) into effect on `model`.

    With `checkpoint.mode: auto`, `inputs` (a batch as the model takes it: a tensor, a tuple of
    positional arguments or a dict of keyword arguments) is needed: one training step is
    profiled with it right here (`loss_fn(output)` -> scalar; default: the output's `loss`, else
    the sum of squares of its first tensor), the fastest per-module plan whose predicted peak
    fits `memory_budget` is chosen, logged in one line, and applied (`handle.plan` says what was
    planned and predicted).
    """
    if not isinstance(model, nn.Module):
        raise PolicyApplyError(f"apply() needs a torch.nn.Module, got {type(model).__name__}")
    chosen = None if backend is None else runtime_backend(backend)
    policy = load(cfg, backends=() if chosen is None else (chosen,))
    chosen = chosen or policy.backend
    refuse_if_applied(model)
    if policy.checkpoint.mode != "auto":
        if inputs is not None or loss_fn is not None:
            raise PolicyApplyError(
                f"inputs= and loss_fn= are for checkpoint.mode auto (they profile a step to plan "
                f"from), and this policy's mode is {policy.checkpoint.mode}: remove them")
        return apply_policy(model, policy, chosen, mpu=mpu)
    if inputs is None:
        raise PolicyApplyError(
            "checkpoint.mode auto plans from a profile of one training step, and apply() got "
            "no example inputs: pass inputs= (a batch, as the model takes it) to plan here, or "
            "write the plan with `actcfg plan CONFIG --model pkg.module:factory -o plan.yaml` "
            "and apply that file")
    if mpu is not None:
        raise PolicyApplyError("mpu= is for the deepspeed backend; a plan runs on torch "
                               "(remove mpu=)")
    from actcfg.plan import plan_model

    planned = plan_model(model, policy, inputs, loss_fn=loss_fn, apply=_apply_trial)
    log.info(planned.report.summary())
    return apply_policy(model, planned.policy, chosen, source=policy, plan=planned.report)


def _apply_trial(model: nn.Module, cfg: Any) -> AppliedPolicy:
    """How the planner applies each uniform policy it profiles (never `mode: auto`)."""
    return apply_policy(model, load(cfg), Backend.TORCH)
