"""What `actcfg.apply` did, as frozen records, and the counters that show it acting at run time.

Plain data and no torch: `AppliedPolicy.report()` renders these, and `verify` reads them by
attribute, never by string key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from actcfg.units import memory_size

__all__ = [
    "CheckpointCounters",
    "CheckpointReport",
    "DeepSpeedReport",
    "OffloadReport",
    "PlanReport",
    "RuleReport",
]


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
    """`checkpoint_inputs` or `all_saved` (see `actcfg.translators.OffloadPlan`)."""
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
    pin_budget_per_node: int | None = None
    """Most pinned bytes of all the job's ranks on this node together (None: unbounded)."""

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


@dataclass(frozen=True)
class RuleReport:
    """One rule of `checkpoint.mode: rules` as applied: the modules it took and what they do."""

    index: int
    """Position of the rule in `checkpoint.rules` (0 first)."""
    modules: tuple[str, ...]
    """Qualified names of the modules that took this rule (the first rule matching wins)."""
    checkpoint: str
    """`none`, `full` or `selective`."""
    offload: bool
    """True when the modules' group is offloaded (what they keep goes to host memory)."""
    save_ops: tuple[str, ...] | None = None
    """With `selective`: the ops whose outputs are saved."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        out = asdict(self)
        out["modules"] = list(self.modules)
        out["save_ops"] = None if self.save_ops is None else list(self.save_ops)
        return out


@dataclass(frozen=True)
class CompileReport:
    """What a policy's `compile:` compiled: the scope, torch.compile's backend and the modules."""

    scope: str
    """`blocks` (each module a rule takes) or `model` (the root)."""
    backend: str
    """torch.compile's `backend=`."""
    modules: tuple[str, ...]
    """Qualified names of the compiled modules (`""`: the model itself)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"scope": self.scope, "backend": self.backend, "modules": list(self.modules)}


_PART_LABELS = {"warm_ups": "warm-ups", "host_pool": "host pool", "copy_bandwidth": "copy bandwidth",
                "measured_whole": "measured whole"}
"""How the planning parts that are not choices read in a line (a choice keeps its name)."""


@dataclass(frozen=True)
class PlanReport:
    """What `checkpoint.mode: auto` planned: the choice per candidate module, what the plan
    predicted, and the rules policy that was applied (the same `actcfg plan` would write).
    Made by `actcfg.plan.Plan.report`, the one place a plan's fields become these."""

    memory_budget: int
    """The budget planned for, in bytes of GPU memory above a step's start."""
    choices: tuple[tuple[str, str], ...]
    """(module, choice) for every candidate module in forward order; a choice is a name of
    `actcfg.plan.CHOICE_TABLE`."""
    predicted_step_time_ms: float
    """Predicted time of one training step under the plan."""
    predicted_peak: int
    """Predicted peak GPU memory of a step above its start, in bytes."""
    plain_step_time_ms: float
    """The step time measured without any policy while profiling."""
    plain_peak: int
    """The peak measured without any policy while profiling, in bytes."""
    max_inflight: int
    """Copies to the host the plan lets run at once."""
    kept_at_turn: int
    """Candidate modules after the last offloaded one that stay on the GPU at the turn."""
    policy_yaml: str
    """The plan as an explicit `checkpoint.mode: rules` policy file."""
    device: str
    """Where the profile ran (`cuda`, or `cpu`, where times are wall-clock and memory is counted
    from saved tensors, not measured)."""
    compiled: str | None = None
    """How the profile's runs were compiled (`blocks with inductor`), None: eager."""
    profile_ms: float = 0.0
    """Wall time the profile took, its compiles excluded."""
    compile_ms: float = 0.0
    """Wall time the profile spent compiling (its counting forwards, and each compiled run's
    warm-up steps less as many settled steps)."""
    parts_ms: dict[str, float] = field(default_factory=dict, hash=False)
    """`profile_ms` by part (`actcfg.plan.Profile.parts_ms`): the counting forwards, each
    choice's run, the runs' first steps, the host pool, the copy bandwidth, the rest."""
    parts_steps: dict[str, int] = field(default_factory=dict, hash=False)
    """The model calls each part made (`actcfg.plan.Profile.parts_steps`): a forward alone under
    `counts`, a training step elsewhere."""
    solve_ms: float = 0.0
    """Wall time the solver took to choose the plan from the profile (outside `profile_ms`)."""

    def planning(self) -> str:
        """How long the profile took and where it went: `15.2 s (counts 0.4, keep 1.1, ...,
        rest 0.1 s)`, and its compiling apart."""
        shown = [f"{_PART_LABELS.get(k, k)} {ms / 1000:.1f}" for k, ms in self.parts_ms.items()]
        return (f"{self.profile_ms / 1000:.1f} s" + (f" ({', '.join(shown)} s)" if shown else "")
                + (f" + {self.compile_ms / 1000:.1f} s compiling" if self.compiled else ""))

    def summary(self) -> str:
        """One line: the choices and the prediction."""
        counts: dict[str, int] = {}
        for _, choice in self.choices:
            counts[choice] = counts.get(choice, 0) + 1
        mix = ", ".join(f"{n} {c}" for c, n in counts.items())
        return (f"actcfg: planned {len(self.choices)} modules within memory_budget "
                f"{memory_size(self.memory_budget)}: {mix}; predicted {self.predicted_step_time_ms:.1f} ms, "
                f"peak {memory_size(self.predicted_peak)} (plain {self.plain_step_time_ms:.1f} ms, "
                f"{memory_size(self.plain_peak)}; profiled on {self.device}"
                + (f", compiled ({self.compiled})" if self.compiled else "")
                + f"; planning took {self.planning()})")

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (the `plan` section of an applied policy's report)."""
        out = asdict(self)
        out["choices"] = self.choices_json()
        return out

    def choices_json(self) -> list[dict[str, str]]:
        """The choices as JSON: `{module, choice}` per candidate module in forward order."""
        return [{"module": m, "choice": c} for m, c in self.choices]

    def plan_json(self) -> dict[str, Any]:
        """The plan as `actcfg plan --format json` writes it: the choices, the schedule, the
        prediction, the plain step and the policy text (the command adds what it measured)."""
        return {
            "memory_budget": self.memory_budget, "choices": self.choices_json(),
            "max_inflight": self.max_inflight, "kept_at_turn": self.kept_at_turn,
            "predicted": {"step_time_ms": self.predicted_step_time_ms, "peak": self.predicted_peak},
            "plain": {"step_time_ms": self.plain_step_time_ms, "peak": self.plain_peak},
            "planning": {"profile_ms": self.profile_ms, "compile_ms": self.compile_ms,
                         "compiled": self.compiled, "parts_ms": dict(self.parts_ms),
                         # only where counted (a plan made by `plan_model`, not from a saved profile)
                         **({"parts_steps": dict(self.parts_steps)} if self.parts_steps else {}),
                         "solve_ms": self.solve_ms},
            "plan": self.policy_yaml,
        }
