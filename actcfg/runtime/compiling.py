"""A policy's `compile:`: torch.compile over what the appliers put in place, per block or whole.

It runs after the applier, as torchtitan orders `apply_ac` then `apply_compile`: the compiled
graphs contain the checkpoint (dynamo traces torch's non-reentrant checkpoint as a higher-order
op), and the offload engine's hooks stay outside them (`torch.compiler.disable`).

Each compiled module's forward becomes one call of a compiled function that takes the module as
an argument, so identical blocks share a graph (dynamo guards on their structure, not on which
block it is). The call sits inside the module's own `__call__`: its hooks (FSDP2's, the
planner's probe, the user's) run eagerly around the compiled forward, which is what lets the
planner time each compiled block. Each handle compiles a fresh copy of that function's code, so
its graphs are its own: a profile's trials do not pile recompiles onto one cache (dynamo falls
back to eager past its recompile limit), and `remove()` drops them with the function.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actcfg.errors import PolicyApplyError
from actcfg.policy.schema import Policy
from actcfg.runtime.handle import AppliedPolicy
from actcfg.runtime.reports import CompileReport
from actcfg.runtime.wrap import call_inner, override_forward, select_by_rules
from actcfg.translators import to_torch_native

__all__ = ["apply_compile", "compiled_modules", "warm_up"]


def warm_up(step: Callable[[], Any], most: int = 8) -> float:
    """Run `step` until its wall time stops falling (within a quarter of the fastest so far),
    at most `most` times; return the milliseconds beyond that many settled steps: the compile
    time. torch.compile builds graphs lazily (backward at its first call, each graph-break
    continuation at its first reach), so one warm-up step is not enough. The planner's profile
    and `verify` both time a compiled policy only after this."""
    times: list[float] = []
    while len(times) < most:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if len(times) >= 2 and times[-1] <= 1.25 * min(times[:-1]):
            break
    return max(0.0, sum(times) - len(times) * min(times)) * 1000.0


def compiled_modules(model: nn.Module, policy: Policy) -> list[tuple[str, nn.Module]]:
    """The modules `policy.compile` compiles: every module a rule takes (`scope: blocks`), or
    the model itself (`scope: model`)."""
    assert policy.compile is not None
    if policy.compile.scope == "model":
        return [("", model)]
    ckpt = policy.checkpoint
    if ckpt.mode != "rules":  # the schema refuses compile elsewhere; auto is planned before
        raise PolicyApplyError(f"compile with checkpoint.mode {ckpt.mode}: only a plan "
                               "(`mode: rules`, or `auto` planned first) is compiled by actcfg")
    return [(n, m) for n, m, _ in select_by_rules(model, [r.modules for r in ckpt.rules])]


def _fresh_call(backend: str) -> Any:
    # A copy of call_inner's code object: dynamo keeps its graphs per code object, so these are
    # this handle's alone (see the module docstring).
    code = call_inner.__code__.replace()
    fresh = types.FunctionType(code, call_inner.__globals__, call_inner.__name__)
    try:
        return torch.compile(fresh, backend=backend)
    except Exception as e:  # an unknown backend name: torch says which exist
        raise PolicyApplyError(f"compile.backend: torch.compile refused backend {backend!r}: {e}; "
                               "use one of torch._dynamo.list_backends() (inductor, aot_eager, ...)"
                               ) from e


class _CompiledForward:
    """The forward override of a compiled module: the shared compiled call, module as argument."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def __call__(self, module: nn.Module, previous: Any, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(module, previous, *args, **kwargs)


def apply_compile(model: nn.Module, policy: Policy, handle: AppliedPolicy) -> None:
    """Compile what `policy.compile` names, undoably; recorded on the handle (`handle.compiled`)."""
    spec = to_torch_native(policy).compile  # what `actcfg translate --backend torch` prints
    if spec is None:
        return
    selected = compiled_modules(model, policy)
    impl = _CompiledForward(_fresh_call(spec.backend))
    for _, module in selected:
        override_forward(handle.undo, module, impl, f"compiled ({spec.backend})")
    handle.set_compile(CompileReport(scope=spec.scope, backend=spec.backend,
                                     modules=tuple(n for n, _ in selected)))
