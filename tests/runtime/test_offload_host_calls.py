"""The offload engine's host work in a training forward depends on the blocks it offloads, not
on how many modules the model has: counted in Python calls, not timed.

On the H200 a Llama stack's forward is launch-bound (the GPU's queue empty through it), so each
Python call the engine makes there is step time. Its first version walked every buffer of the
model at each step's start (on benchmarks/engine_host_cost.py's tiny Llama, 214 calls per
layer over checkpointing alone, 112 without the walk).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from actcfg.api import apply
from actcfg.runtime.offload import host_loopback
from actcfg.verification.models import blocks
from _helpers import python_calls

CHECKPOINT = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
OFFLOAD = {**CHECKPOINT, "cpu_checkpointing": True}


def _stack(unused: int) -> tuple[nn.Module, torch.Tensor]:
    """4 blocks whose inputs (4 x 512 x 128 float32, 1 MiB) the engine moves, each with
    `unused` submodules holding a buffer that the forward never calls."""
    torch.manual_seed(0)
    model, x = blocks(n=4, d_model=128, heads=2, ffn=256, batch=4, seq=512, dtype=torch.float32,
                      device="cpu")
    for block in model.blocks:
        holders = nn.ModuleList()
        for _ in range(unused):
            holder = nn.Module()
            holder.register_buffer("state", torch.zeros(4))
            holders.append(holder)
        block.unused = holders
    return model, x.requires_grad_(True)


def _forward_calls(unused: int, policy: dict[str, Any]) -> tuple[int, int]:
    """Python frames entered by one steady step's forward, and the bytes the engine moved."""
    model, x = _stack(unused)
    with host_loopback(), apply(model, policy) as handle:
        for _ in range(2):  # the first step learns which groups stay for backward
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        # A garbage collection inside the forward would run finalizers (Python calls) at a
        # moment of its own choosing: CI counted 310 against 313 once with it on.
        gc.collect()
        gc.disable()
        losses = []
        try:
            calls = python_calls(lambda: losses.append(model(x).square().mean()))
        finally:
            gc.enable()
        losses[0].backward()
        moved = handle.engine.stats.offloaded_bytes if handle.engine is not None else 0
    return calls, moved


def test_the_engines_forward_calls_do_not_grow_with_modules_outside_its_blocks_work():
    added = {}
    for unused in (0, 64):
        plain, _ = _forward_calls(unused, CHECKPOINT)
        offloaded, moved = _forward_calls(unused, OFFLOAD)
        assert moved == 2 * 4 * 512 * 128 * 4  # n - 2 block inputs left the device
        added[unused] = offloaded - plain
    # 256 more modules, each with a buffer: not one more call (the walk at each step's start
    # made 3072 more: 3575 against 503). The slack is for calls this test does not control
    # (a finalizer torch runs from a weak reference, say), far below one call per module.
    assert added[0] > 0 and abs(added[64] - added[0]) <= 16, added
