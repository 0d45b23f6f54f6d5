"""cuBLAS's workspaces, allocated when a policy is applied instead of inside its first step.

torch allocates a cuBLAS workspace through the caching allocator the first time a thread runs
a matmul on a stream: one for the thread that runs the forward, one for autograd's device
thread, which runs the backward and a checkpoint's recompute (32 MiB each on an H200, torch
2.11), kept to the process's end. In a process whose first training step is the policy's
first step (a trainer given `plan_file=`, a script that applies a written plan), both were
allocated inside that step, above its start, where no later step has them: on an H200 the
first step of a plan on the blocks stack peaked 64 MiB above its later steps (1.888 against
1.824 GiB, the allocator's history showing the two workspaces as the difference), over what
the planner predicts. The planner's profile never sees them (its warm-up steps allocate
them), so its predictions are the later steps'. Allocating them here, on the stream the step will run on, puts them
below the first step's start, as they are below every later one's; they would be allocated at
that step anyway.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["prime_matmul_workspaces", "model_device"]

log = logging.getLogger("actcfg")


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer (None for a model with neither)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return None


def prime_matmul_workspaces(device: torch.device | None) -> None:
    """Run a tiny matmul forward and backward on `device`'s current stream, so that the forward
    thread's and autograd's cuBLAS workspaces exist before the first step (once they exist it
    allocates nothing: torch keeps them per thread and stream). Nothing off CUDA or under
    `torch.inference_mode`. Best effort: where it fails (a GPU already full) the first step
    allocates them, as without it. It helps where the step runs on this thread and stream, as
    the trainers' callbacks and a training loop that applies first do."""
    if device is None or device.type != "cuda" or torch.is_inference_mode_enabled():
        return  # (under inference_mode no backward can run: nothing to allocate for)
    try:
        with torch.cuda.device(device), torch.enable_grad():
            # Zeros: no RNG is drawn, so the run's random state is unchanged. `linear` with a
            # bias takes the cuBLASLt path (addmm) and `@` the cuBLAS one (mm), both directions.
            x = torch.zeros(8, 8, device=device, requires_grad=True)
            w = torch.zeros(8, 8, device=device, requires_grad=True)
            b = torch.zeros(8, device=device, requires_grad=True)
            (nn.functional.linear(x, w, b).sum() + (x @ w).sum()).backward()
    except RuntimeError as e:  # out of memory, say: the first step allocates them instead
        log.debug("actcfg: cuBLAS's workspaces not allocated ahead: %s", e)
