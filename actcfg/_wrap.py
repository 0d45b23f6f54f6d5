"""Module selection and undoable edits shared by the torch runtime and the DeepSpeed route.

Both backends select modules the same way (`checkpoint.modules`, `checkpoint.every`) and replace
an instance's `forward` the same way; keeping that here lets `runtime` import the DeepSpeed route
without the route importing `runtime` back.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actcfg.errors import PolicyApplyError

__all__ = ["INNER_FORWARD", "WRAPPED", "grad_path", "inner_forward", "override_forward", "select_modules"]

# Set in a module's __dict__ by an override; copy.deepcopy carries them, so a copy of an
# applied model is recognised too (applying to it again would wrap twice).
WRAPPED = "_actcfg_wrapped"
INNER_FORWARD = "_actcfg_inner_forward"


def _matches(pattern: str, name: str, module: nn.Module) -> bool:
    """fnmatch on the class name; on the qualified name segment by segment, so that `*` never
    crosses a dot (`layers.*` is `layers.0`, not `layers.0.mlp.fc1`)."""
    if fnmatch.fnmatchcase(type(module).__name__, pattern):
        return True
    if not name:
        return False
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def select_modules(model: nn.Module, patterns: tuple[str, ...], every: int) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs `checkpoint.modules`/`every` select, in module order.

    PolicyApplyError for a pattern that matches nothing, a module matched together with one of
    its descendants (nested checkpointing), or a container with no forward of its own.
    """
    named = list(model.named_modules())
    matched: list[tuple[str, nn.Module]] = []
    for pattern in patterns:
        if not any(_matches(pattern, n, m) for n, m in named):
            classes = sorted({type(m).__name__ for _, m in named})
            names = [n for n, _ in named if n][:6]
            raise PolicyApplyError(
                f"checkpoint.modules: pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; class names here: {', '.join(classes[:8])}"
                f"{', ...' if len(classes) > 8 else ''}; qualified names: {', '.join(names)}"
                f"{', ...' if len(named) - 1 > 6 else ''}"
            )
    for n, m in named:
        if any(_matches(p, n, m) for p in patterns):
            matched.append((n, m))
    for i, (outer, om) in enumerate(matched):
        for inner, im in matched[i + 1:]:
            if not outer or inner.startswith(outer + "."):
                raise PolicyApplyError(
                    f"checkpoint.modules: {_label(outer, om)} and its submodule {_label(inner, im)} "
                    "are both matched: nested checkpointing recomputes the inner module twice; "
                    "narrow the patterns so that only one of them matches"
                )
    for n, m in matched:
        if type(m).forward is nn.Module.forward:
            raise PolicyApplyError(
                f"checkpoint.modules: {_label(n, m)} has no forward of its own (a container); "
                f"checkpoint its children instead, such as `{n + '.*' if n else '*'}`"
            )
    chosen = [nm for i, nm in enumerate(matched) if (i + 1) % every == 0]
    if not chosen:
        raise PolicyApplyError(
            f"checkpoint.every: {every}, but only {len(matched)} module(s) match "
            f"{', '.join(repr(p) for p in patterns)}: every n-th match is checkpointed, so none "
            f"would be; set `every` to at most {len(matched)}"
        )
    return chosen


def _label(name: str, module: nn.Module) -> str:
    return f"`{name}` ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


# --- undoable module edits ---------------------------------------------------------------


def override_forward(handle: Any, name: str, module: nn.Module,
                      forward: Callable[..., Any], what: str) -> None:
    """Make `forward(module, *args, **kwargs)` the instance's forward, as a bound method."""
    d = module.__dict__
    if "forward" in d:
        d[INNER_FORWARD] = d["forward"]
    d["forward"] = types.MethodType(forward, module)
    d[WRAPPED] = what

    def undo() -> None:
        d.pop("forward", None)
        d.pop(WRAPPED, None)
        if INNER_FORWARD in d:
            d["forward"] = d.pop(INNER_FORWARD)

    handle._undo.append(undo)


def inner_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward actcfg's override wraps: an earlier instance forward, else the class's."""
    inner = module.__dict__.get(INNER_FORWARD)
    return inner if inner is not None else type(module).forward.__get__(module, type(module))


def grad_path(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Reentrant checkpointing computes parameter gradients only if an input requires grad.

    When none does (the first block of a model whose input is data), the first floating-point
    input is replaced by a detached copy that requires grad; its gradient is discarded.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.requires_grad for t in tensors):
        return args
    if not any(p.requires_grad for p in module.parameters()):
        return args
    out = list(args)
    for i, a in enumerate(out):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            out[i] = a.detach().requires_grad_()
            break
    return tuple(out)
