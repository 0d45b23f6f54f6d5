"""What both trainer callbacks say in the trainer's own output: one line when the policy takes
effect (what was applied or planned, with the predicted peak and step time), and one after the
first training step (what was measured: recomputes, bytes offloaded, and on a GPU the step's
peak above its start, the quantity `memory_budget` bounds).

The peak is the forward and backward of a step above what was allocated when it began, less the
parameter gradients alive then, read just before the optimizer step: the optimizer's state and
its update are outside it, as they are outside the planner's profile and `memory_budget`; the
parameter gradients are inside it, also where a step begins with the previous step's (Lightning
frees them after `training_step`, inside the step; a second `fit` starts with the first's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actcfg.units import memory_size

__all__ = ["FirstStepPeak", "applied_line", "measured_line"]


def applied_line(applied: Any, *, planned_in_s: float | None = None, written: Path | None = None,
                 plan_file: Path | None = None) -> str:
    """The line for the policy taking effect: the handle's summary, or for a plan what was
    planned (and how long planning took, and where the plan was written) or reused."""
    plan = applied.plan
    if plan is not None:
        line = plan.summary()
        if planned_in_s is not None:
            # What the profile did not take (solving, writing the plan, applying it, the
            # integration's own checks): the part of a trainer's planning no profile part shows,
            # with the solver's share said apart (it grows with blocks, choices and fronts).
            outside = max(0.0, planned_in_s - (plan.profile_ms + plan.compile_ms) / 1000)
            line += (f"; planned in {planned_in_s:.1f} s on the first batch ({outside:.1f} s of it "
                     f"outside the profile, {plan.solve_ms / 1000:.2f} s of that solving)")
        if written is not None:
            line += f"; plan written to {written}"
        return line
    line = applied.summary()
    if plan_file is not None:
        line = f"actcfg: plan {plan_file} applied; " + line.removeprefix("actcfg: ")
    predicted = getattr(applied.policy.checkpoint, "predicted", None)
    if predicted is not None:
        line += f"; predicted {predicted.step_time_ms:.1f} ms, peak {memory_size(predicted.peak)}"
    return line


def _predicted_peak(applied: Any) -> int | None:
    if applied.plan is not None:
        return applied.plan.predicted_peak
    predicted = getattr(applied.policy.checkpoint, "predicted", None)
    return None if predicted is None else predicted.peak


def measured_line(applied: Any, peak: int | None) -> str:
    """The line after the first step: recomputes, bytes offloaded, the step's peak."""
    parts = []
    if applied.checkpointed or applied.rules is not None:
        c = applied.counters
        parts.append(f"{c.calls} checkpointed forwards, {c.recomputes} recomputed in backward")
    elif applied.checkpoint is not None and applied.checkpoint.api is None:
        parts.append("checkpointing left to the model")
    engine = applied.engine
    if engine is not None:
        st = engine.stats
        parts.append(f"{memory_size(st.offloaded_bytes)} offloaded to the host in {st.offloaded_tensors} "
                     f"copies, {memory_size(st.reloaded_bytes)} reloaded")
    predicted = _predicted_peak(applied)
    if peak is not None:
        parts.append(f"peak {memory_size(peak)} above the step's start"
                     + (f" (predicted {memory_size(predicted)})" if predicted is not None else ""))
    elif predicted is not None:
        parts.append("peak not measured on the CPU")
    return "actcfg: after the first step: " + ("; ".join(parts) or "nothing to count")


class FirstStepPeak:
    """The first step's GPU memory peak above its start less the gradients alive then, from its
    beginning to the optimizer step (None on the CPU). Resets torch's peak statistics once, at
    that step's start."""

    def __init__(self) -> None:
        self.base: int | None = None
        self.peak: int | None = None
        self._device: Any = None

    def begin(self, model: Any) -> None:
        """Start (or restart, after planning in the step) measuring at what is allocated now."""
        import torch

        from actcfg.plan.probe import gradient_bytes

        device = next((p.device for p in model.parameters()), None)
        if device is None or device.type != "cuda" or self.peak is not None:
            return
        self._device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device) - gradient_bytes(model)
        torch.cuda.reset_peak_memory_stats(device)

    def stop(self) -> None:
        """Read the peak (once: later steps leave it as the first step measured it)."""
        import torch

        if self.base is None or self.peak is not None:
            return
        torch.cuda.synchronize(self._device)
        self.peak = torch.cuda.max_memory_allocated(self._device) - self.base
