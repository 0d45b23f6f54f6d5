"""What `actcfg.apply` did, as frozen records, and the counters that show it acting at run time.

Plain data and no torch: `AppliedPolicy.report()` renders these, and `verify` reads them by
attribute, never by string key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CheckpointCounters", "CheckpointReport", "DeepSpeedReport", "OffloadReport"]


@dataclass(frozen=True)
class CheckpointReport:
    """Which modules are checkpointed, through which function with which keyword arguments."""

    mode: str
    """The policy's `checkpoint.mode`."""
    api: str | None
    """The function each module's forward runs through; None when the model checkpoints itself."""
    modules: tuple[str, ...]
    """Qualified names of the checkpointed (or DeepSpeed-routed) modules, in module order."""
    every: int | None
    reentrant: bool | None
    save_ops: tuple[str, ...] | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments `api` is called with (besides `context_fn`)."""
    notes: tuple[str, ...] = ()
    """What apply decided on the policy's behalf (a `num_checkpoints` it filled in, ...)."""

    @classmethod
    def of(cls, policy: Any, api: str | None, modules: tuple[str, ...], kwargs: dict[str, Any],
           notes: tuple[str, ...] = ()) -> CheckpointReport:
        """The report for `policy`'s checkpoint section as applied."""
        ckpt = policy.checkpoint
        return cls(
            mode=ckpt.mode, api=api, modules=modules,
            every=getattr(ckpt, "every", None), reentrant=getattr(ckpt, "reentrant", None),
            save_ops=tuple(ckpt.save_ops) if ckpt.mode == "selective" else None,
            kwargs=dict(kwargs), notes=notes,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        out = asdict(self)
        out["modules"] = list(self.modules)
        out["save_ops"] = None if self.save_ops is None else list(self.save_ops)
        out["notes"] = list(self.notes)
        return out


@dataclass
class CheckpointCounters:
    """Checkpointed calls and runs of their insides since apply, in eager mode.

    Every run beyond the call itself is a recompute in backward. Under torch.compile the compiled
    graph recomputes and these stay still (counting inside a checkpointed region would break it).
    """

    calls: int = 0
    """Checkpointed forwards with grad enabled."""
    runs: int = 0
    """Runs of the checkpointed modules' insides: forwards plus recomputes."""

    @property
    def recomputes(self) -> int:
        """Runs in backward: `runs - calls`."""
        return self.runs - self.calls

    def to_json(self) -> dict[str, int]:
        """JSON-able form."""
        return {"calls": self.calls, "runs": self.runs, "recomputes": self.recomputes}


@dataclass(frozen=True)
class OffloadReport:
    """How the offload engine was set up: scope, host memory, and the group boundaries."""

    engine: str
    scope: str
    """`checkpoint_inputs` or `all_saved` (see `actcfg.translate.OffloadPlan`)."""
    pin: bool
    """True when offloads go to page-locked memory."""
    pin_budget: int | None
    min_offload_bytes: int
    device: str
    groups: tuple[str, ...]
    """Qualified names of the modules at whose entry a new group opens."""
    grouping: str
    """How the groups were chosen, in words."""
    within: str = ""
    """Qualified name of the module whose forward is the offload step ("": the model): the
    innermost one with a forward of its own that contains every group."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        out = asdict(self)
        out["groups"] = list(self.groups)
        return out


@dataclass(frozen=True)
class DeepSpeedReport:
    """What DeepSpeed was configured with, and its state read back after configure()."""

    configure_kwargs: dict[str, Any]
    state: dict[str, Any]
    """DeepSpeed's activation-checkpointing globals by configure() keyword, with `is_configured`
    and `mp_size`."""
    mp_size: int
    mpu: str | None
    input_guard: str

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)
