"""The verify report as plain data: measurements, verdicts, and their JSON form. No torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from actcfg.policy.schema import Policy

__all__ = [
    "GRAD_TOLERANCE",
    "GradDiff",
    "Measurements",
    "RunMeasurement",
    "Verdict",
    "VerifyReport",
    "growth_per_block",
    "tolerance",
    "worst_grad",
]

# Checkpoint recompute and offload round-trips run the same kernels on the same values, so a
# working policy gives bit-identical gradients (BACKENDS.md 1.6: B-F, M, N). The tolerance only
# leaves room for nondeterministic reductions (split-K matmuls, atomics in attention backward):
# a few tens of units in the last place of each dtype (eps: fp32 1.2e-7, fp16 9.8e-4 at 1.0,
# bf16 7.8e-3). The failures verify exists to catch are of order 1 (BACKENDS.md 7: 1.0).
GRAD_TOLERANCE: dict[str, float] = {
    "float64": 1e-5,
    "float32": 1e-5,
    "float16": 1e-2,
    "bfloat16": 2e-2,
}
"""Largest max-relative gradient error that counts as equal, by the model's loosest dtype."""

@dataclass(frozen=True)
class RunMeasurement:
    """One model's numbers, all on the last step except the median step time."""

    held: tuple[int, ...]
    """Bytes of GPU memory allocated after each block's forward, above the step's start."""
    peak: int
    """Peak bytes of GPU memory allocated during the step (forward and backward), above its start."""
    step_time_s: float
    """Median wall time of one forward+backward step, in seconds (CUDA events)."""


@dataclass(frozen=True)
class GradDiff:
    """How one parameter's gradient under the policy differs from the plain run's."""

    name: str
    """Qualified parameter name."""
    error: float
    """max|g_policy - g_plain| / max|g_plain|; inf when not comparable (see `note`)."""
    note: str | None = None
    """Why the gradient is not comparable: `got no gradient under the policy`, ..."""


@dataclass(frozen=True)
class Measurements:
    """Everything `judge` needs, as plain numbers (no torch)."""

    blocks: tuple[str, ...]
    """Qualified names of the measured blocks, in forward order."""
    block_input_bytes: int
    """Bytes of one block input (median over blocks of the tensors each block is called with)."""
    plain: RunMeasurement
    """The model without the policy."""
    policy: RunMeasurement
    """The same model, same weights and inputs, with the policy applied."""
    grads: tuple[GradDiff, ...]
    """One entry per parameter that has a gradient in either run."""
    dtype: str
    """The loosest floating dtype of the parameters and inputs (`bfloat16`, `float32`, ...)."""
    steps: int = 3
    """Forward+backward steps run on each model."""
    mp_size: int = 1
    """Model-parallel world size of the `mpu` the policy was applied with (1 without one)."""
    offloaded_bytes: int | None = None
    """Bytes the offload engine copied to the host in the policy's last step (None: actcfg's
    engine did not run, as with the deepspeed backend)."""
    recomputes: int | None = None
    """Checkpointed modules run again in the policy's last backward, counted by the runtime
    (None: nothing is checkpointed by actcfg)."""
    host_pinned_bytes: int | None = None
    """Page-locked host memory the policy used for offloading (None: not measurable)."""
    host_pageable_bytes: int | None = None
    """Pageable host memory the policy used for offloading (None: not measurable)."""
    backward_held_bytes: int | None = None
    """Most bytes of offloaded activations the offload engine held on the GPU at once in the
    policy's last backward (its own count, `OffloadStats.most_backward_device_bytes`; None:
    actcfg's engine did not run)."""
    forward_held_bytes: int | None = None
    """The same in the last forward (the open group and the copies in flight)."""
    recompute_held_bytes: int | None = None
    """The same as the last backward's checkpointed modules began their recompute, after the
    reloads each started then (`OffloadStats.most_recompute_device_bytes`): what the engine held
    through a recompute's peak (None: actcfg's engine did not run)."""
    keep_last: int | None = None
    """The engine's `keep_last` (None: actcfg's engine did not run)."""
    compile_ms: float | None = None
    """With `compile:`: the wall milliseconds the policy's warm-up steps took above as many
    settled steps, torch.compile building its graphs; the measured steps came after it (None:
    nothing was compiled)."""


@dataclass(frozen=True)
class Verdict:
    """Whether one promise of the policy held, in one sentence with numbers."""

    promise: str
    """`cpu_checkpointing`, `peak`, `partition` or `gradients`."""
    ok: bool
    """True when the promise held."""
    message: str
    """One sentence with the numbers that decided it."""


@dataclass(frozen=True)
class VerifyReport:
    """The measurements and a verdict per promise; `ok` when every promise held."""

    policy: Policy
    backend: str
    measurements: Measurements
    """This process's measurements; rank 0's when several ranks measured (see `ranks`)."""
    verdicts: tuple[Verdict, ...] = field(default=())
    """One per promise; with several ranks, a promise holds only where it held on every rank."""
    ranks: tuple[Measurements, ...] = ()
    """Every rank's measurements in rank order, when verify ran on a torch.distributed group of
    more than one rank (under torchrun); empty in one process."""

    @property
    def ok(self) -> bool:
        """True when every promise held."""
        return all(v.ok for v in self.verdicts)

    @property
    def world_size(self) -> int:
        """How many ranks measured."""
        return max(1, len(self.ranks))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (non-finite numbers become null). With several ranks,
        the top level holds rank 0's numbers and `ranks` each rank's."""
        m = self.measurements
        out: dict[str, Any] = {
            "ok": self.ok,
            "backend": self.backend,
            "policy": self.policy.model_dump(mode="json"),
            "dtype": m.dtype,
            "steps": m.steps,
            **_numbers(m),
            "verdicts": [asdict(v) for v in self.verdicts],
        }
        predicted = getattr(self.policy.checkpoint, "predicted", None)
        if predicted is not None:
            measured_ms = m.policy.step_time_s * 1000
            out["predicted"] = {
                "step_time_ms": predicted.step_time_ms, "peak_bytes": predicted.peak,
                "measured_step_time_ms": measured_ms, "measured_peak_bytes": m.policy.peak,
                "step_time_error": _finite((predicted.step_time_ms - measured_ms) / measured_ms
                                           if measured_ms else math.nan),
                "peak_error": _finite((predicted.peak - m.policy.peak) / m.policy.peak
                                      if m.policy.peak else math.nan),
            }
        if self.ranks:
            out["world_size"] = self.world_size
            out["ranks"] = [{"rank": rank, **_numbers(r)} for rank, r in enumerate(self.ranks)]
        return out


def _numbers(m: Measurements) -> dict[str, Any]:
    """One rank's measurements as JSON-able data (the part that differs between ranks)."""
    worst = worst_grad(m.grads)
    return {
        "mp_size": m.mp_size,
        "block_input_bytes": m.block_input_bytes,
        "blocks": [
            {"name": name, "plain_held_bytes": p, "policy_held_bytes": q}
            for name, p, q in zip(m.blocks, m.plain.held, m.policy.held)
        ],
        "peak_bytes": {"plain": m.plain.peak, "policy": m.policy.peak},
        "step_time_s": {"plain": m.plain.step_time_s, "policy": m.policy.step_time_s},
        "compile_ms": None if m.compile_ms is None else _finite(m.compile_ms),
        "host_bytes": {"pinned": m.host_pinned_bytes, "pageable": m.host_pageable_bytes},
        "gradients": {
            "max_rel_error": _finite(worst.error) if worst else 0.0,
            "parameter": worst.name if worst else None,
            "tolerance": tolerance(m.dtype),
            "parameters": [
                {**asdict(g), "error": _finite(g.error)} for g in m.grads
            ],
        },
    }


def growth_per_block(held: Sequence[int]) -> tuple[float, int]:
    """Mean growth of memory held per block over the second half of the stack, and the index
    where that half starts (at least two readings).

    The mean over the span (not a median of steps) so that a policy checkpointing every other
    block, which grows in alternate steps, still shows its growth.
    """
    if len(held) < 2:
        raise ValueError(f"growth per block needs at least two readings, got {len(held)}")
    start = min(len(held) // 2, len(held) - 2)
    return (held[-1] - held[start]) / (len(held) - 1 - start), start


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def worst_grad(grads: Sequence[GradDiff]) -> GradDiff | None:
    """The parameter with the largest error (the first of equals, in parameter order)."""
    return max(grads, key=lambda g: g.error if not math.isnan(g.error) else math.inf, default=None)


def tolerance(dtype: str) -> float:
    """The gradient tolerance for `dtype`; 1e-5 for any dtype not in GRAD_TOLERANCE."""
    return GRAD_TOLERANCE.get(dtype, 1e-5)
