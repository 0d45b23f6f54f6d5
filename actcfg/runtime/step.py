"""One training step's inputs and loss, as both the planner and verify read them.

Example inputs are a tensor, a tuple or list of positional arguments, or a dict of keyword
arguments; the default loss is the output's `loss` (a Hugging Face model given labels), else the
fp32 sum of squares of its first tensor. Nonlinear on purpose: with a linear loss the gradients
do not depend on the output's values, and a forward that read a DeepSpeed-emptied input
(BACKENDS 1.4) would pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from actcfg.errors import ActcfgError

__all__ = ["default_loss", "split_inputs"]


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`(args, kwargs)` for calling the model on `inputs`."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise ActcfgError(f"example inputs are a {type(inputs).__name__}: give a tensor, a tuple of "
                      "positional arguments or a dict of keyword arguments")


def default_loss(output: Any) -> torch.Tensor:
    """The output's `loss` if it has one, else the fp32 sum of squares of its first tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ActcfgError("the model returned no tensor to take a loss of: pass loss_fn=")
    return tensors[0].float().square().sum()
