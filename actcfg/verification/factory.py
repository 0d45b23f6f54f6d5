"""The model factory behind `actcfg verify --model pkg.module:factory`, and its example inputs.

The contract: `model_factory()` returns `(model, example_inputs)`, or a model with an
`example_inputs` attribute (the inputs) or method (called with no arguments, returning them).
Inputs are a tensor, a tuple or list of positional arguments, or a dict of keyword arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from actcfg.errors import VerifyError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DEFAULT_MODEL", "build", "load_factory"]

DEFAULT_MODEL = "actcfg.probes:linear_chain"
"""The factory `actcfg verify` uses without `--model`: the seed report's Linear chain."""

def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by `pkg.module:factory` (the `--model` flag)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise VerifyError(f"--model {spec!r}: write it as pkg.module:factory "
                          f"(for example {DEFAULT_MODEL})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise VerifyError(f"--model {spec!r}: cannot import {module_name}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise VerifyError(f"--model {spec!r}: {module_name} has no attribute {attr!r}") from e
    if not callable(obj):
        raise VerifyError(f"--model {spec!r}: {attr} is a {type(obj).__name__}, not a callable "
                          "factory returning (model, example_inputs)")
    return obj


def build(factory: Callable[[], Any]) -> tuple[nn.Module, Any]:
    from torch import nn

    made = factory()
    if isinstance(made, tuple) and len(made) == 2:
        model, inputs = made
    else:
        model = made
        inputs = getattr(model, "example_inputs", None)
        if inputs is None:
            raise VerifyError(
                f"the model factory returned a {type(made).__name__}: return "
                "(model, example_inputs), or a model with an `example_inputs` attribute or method")
        if callable(inputs):
            inputs = inputs()
    if not isinstance(model, nn.Module):
        raise VerifyError(f"the model factory returned a {type(model).__name__} as the model, "
                          "not a torch.nn.Module")
    return model, inputs
