"""actcfg's routes, the ways a policy can put a module's forward through checkpointing: each a
policy built for the modules a test checkpoints, so one parametrization covers them all.

`deepspeed` runs only inside a capped subprocess (`_capped.py`): DeepSpeed keeps process-wide
state, its first init compiles an op, and a regression there once hung the machine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn

TORCH_ROUTES = ("full", "reentrant", "selective", "rules", "offload", "rules_offload")
"""Routes that run in the pytest process: torch's checkpoint (non-reentrant and reentrant),
selective checkpointing, per-module rules, and cpu_checkpointing on the host loopback engine."""
ROUTES = (*TORCH_ROUTES, "deepspeed")
REENTRANT_LIKE = ("reentrant", "deepspeed")
"""Routes whose checkpoint is an autograd Function (torch's reentrant one, DeepSpeed's)."""
CAPPED = "ACTCFG_CAPPED"
"""Set in the capped subprocess that runs the deepspeed route."""


def policy(route: str, modules: list[str]) -> dict[str, Any]:
    """The policy that puts `modules` through `route`."""
    full = {"mode": "full", "modules": modules}
    return {
        "full": {"version": 1, "checkpoint": full},
        "reentrant": {"version": 1, "checkpoint": {**full, "reentrant": True}},
        "selective": {"version": 1, "checkpoint": {"mode": "selective", "modules": modules}},
        "rules": {"version": 1, "checkpoint": {"mode": "rules", "rules": [
            {"modules": modules, "mode": "selective", "save_ops": ["aten.addmm", "aten.mm"]}]}},
        "offload": {"version": 1, "checkpoint": full, "cpu_checkpointing": True},
        "rules_offload": {"version": 1, "checkpoint": {"mode": "rules", "rules": [
            {"modules": modules, "mode": "full", "cpu_checkpointing": True}]}},
        "deepspeed": {"version": 1, "backend": "deepspeed", "checkpoint": full},
    }[route]


def params(routes: tuple[str, ...] = ROUTES) -> list[Any]:
    """`routes` as pytest params, the deepspeed one marked so that it runs only when capped."""
    return [pytest.param(r, marks=[pytest.mark.deepspeed]) if r == "deepspeed" else r for r in routes]


@contextlib.contextmanager
def applied(model: nn.Module, route: str, modules: list[str], request: Any = None) -> Iterator[Any]:
    """`actcfg.apply(model, policy(route, modules))`, removed after the block.

    Offload routes build their engine on the host loopback, with `min_offload_bytes` 0 so that
    the tiny tensors of these tests move too (actcfg's default keeps tensors under 1 MiB on the
    device: docs/peer-differences.md). The deepspeed route needs the `ds_env` fixture, which is
    looked up through `request` (and skipped outside the capped subprocess).
    """
    from actcfg.runtime.offload import host_loopback
    from actcfg.api import apply

    if route == "deepspeed":
        if not os.environ.get(CAPPED):
            pytest.skip("the deepspeed route runs in a capped subprocess (test_*_capped)")
        request.getfixturevalue("ds_env")
    with host_loopback():
        handle = apply(model, policy(route, modules))
    if handle.engine is not None:
        handle.engine.min_offload_bytes = 0
    try:
        yield handle
    finally:
        handle.remove()
