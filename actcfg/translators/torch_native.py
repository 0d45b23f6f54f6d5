"""Policy -> the torch-native `WrapPlan` that `actcfg.apply` executes: which modules are
checkpointed through which torch function with which keyword arguments, and how saved
activations are offloaded.

Pure: no I/O and no torch import; the plan is plain data, and the runtime dispatches on it, so
what `actcfg translate --backend torch` prints is what runs. Every field's destination lives
once, in `actcfg.backends.torch.TABLE`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from actcfg.backends import Backend
from actcfg.backends.table import MISSING, Key, field_value
from actcfg.backends.torch import CHECKPOINT_API, COMPILE_API, OFFLOAD_ENGINE, PLANNER, TABLE
from actcfg.policy.schema import DEFAULT_SAVE_OPS, Policy
from actcfg.translators._refuse import refuse_inexpressible

__all__ = [
    "CHECKPOINT_API",
    "OFFLOAD_ENGINE",
    "PLANNER",
    "CheckpointPlan",
    "CompilePlan",
    "ExternalCheckpointPlan",
    "OffloadPlan",
    "PlanRequest",
    "RulePlan",
    "RulesPlan",
    "WrapPlan",
    "to_torch_native",
]


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Which modules are checkpointed, and through which torch function with which kwargs."""

    modules: tuple[str, ...]
    """fnmatch patterns, matched against each module's class names and qualified name."""
    every: int
    """Wrap every n-th matched module, in module order."""
    use_reentrant: bool
    """torch's `use_reentrant` kwarg, always passed explicitly."""
    preserve_rng_state: bool = True
    """torch's `preserve_rng_state` kwarg: replay dropout identically in recomputation."""
    selective_save_ops: tuple[str, ...] | None = None
    """Ops whose outputs are saved (`aten.mm` = every overload of `torch.ops.aten.mm`), given to
    `create_selective_checkpoint_contexts` as `context_fn`; None = full recomputation."""
    api: str = CHECKPOINT_API
    """Dotted name of the torch function each selected module's forward is run through."""

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments `api` takes (the runtime adds `context_fn` for selective)."""
        return {"use_reentrant": self.use_reentrant, "preserve_rng_state": self.preserve_rng_state}

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {
            "api": self.api,
            "modules": list(self.modules),
            "every": self.every,
            "use_reentrant": self.use_reentrant,
            "preserve_rng_state": self.preserve_rng_state,
            "selective_save_ops": (None if self.selective_save_ops is None
                                   else list(self.selective_save_ops)),
        }


@dataclass(frozen=True, kw_only=True)
class ExternalCheckpointPlan:
    """The model checkpoints itself (`checkpoint.mode: external`): nothing is wrapped."""

    api: None = None
    """No function of actcfg's: the model's own calls checkpoint."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"api": None, "by": "the model"}


@dataclass(frozen=True, kw_only=True)
class RulePlan:
    """One rule of `checkpoint.mode: rules`: its modules, how they are checkpointed, and whether
    what they keep is offloaded."""

    modules: tuple[str, ...]
    """fnmatch patterns; a module takes the first rule that matches it."""
    checkpoint: Literal["none", "full", "selective"]
    """How the modules recompute: not at all, whole, or all but `selective_save_ops`."""
    offload: bool
    """Their group is marked for offload: everything they save (`none`), or their inputs (`full`)."""
    selective_save_ops: tuple[str, ...] | None = None
    """With `selective`: ops whose outputs are saved."""
    use_reentrant: bool = False
    """torch's `use_reentrant` kwarg: rules always checkpoint non-reentrantly."""
    preserve_rng_state: bool = True
    """torch's `preserve_rng_state` kwarg."""

    @property
    def api(self) -> str | None:
        """The function the modules' forwards run through; None when they are not checkpointed."""
        return None if self.checkpoint == "none" else CHECKPOINT_API

    def checkpoint_plan(self) -> CheckpointPlan | None:
        """The checkpoint these modules run through (every matched module: `every` is 1)."""
        if self.checkpoint == "none":
            return None
        return CheckpointPlan(modules=self.modules, every=1, use_reentrant=self.use_reentrant,
                              preserve_rng_state=self.preserve_rng_state,
                              selective_save_ops=self.selective_save_ops)

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {
            "modules": list(self.modules),
            "checkpoint": self.checkpoint,
            "api": self.api,
            "use_reentrant": self.use_reentrant if self.api else None,
            "preserve_rng_state": self.preserve_rng_state if self.api else None,
            "selective_save_ops": (None if self.selective_save_ops is None
                                   else list(self.selective_save_ops)),
            "offload": self.offload,
        }


@dataclass(frozen=True, kw_only=True)
class RulesPlan:
    """Per-module choices (`checkpoint.mode: rules`): each module takes the first rule that
    matches it; modules no rule matches are left as they are."""

    rules: tuple[RulePlan, ...]
    predicted_step_time_ms: float | None = None
    """What `actcfg plan` predicted for one step, if it wrote these rules."""
    predicted_peak: int | None = None
    """What `actcfg plan` predicted as the step's peak GPU memory, in bytes."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        predicted = None
        if self.predicted_step_time_ms is not None:
            predicted = {"step_time_ms": self.predicted_step_time_ms, "peak": self.predicted_peak}
        return {"api": CHECKPOINT_API, "rules": [r.to_json() for r in self.rules],
                "predicted": predicted}


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """`checkpoint.mode: auto`: choose per candidate module within `memory_budget`, from a
    profile of one training step (`actcfg plan`, or `apply(..., inputs=...)`), then run the
    `RulesPlan` that comes out."""

    modules: tuple[str, ...]
    """Candidate modules: fnmatch patterns."""
    memory_budget: int
    """Most GPU memory one step may allocate above its start, in bytes."""
    submodules: str | tuple[str, ...] = "none"
    """Each candidate's parts the plan may checkpoint one by one: `none`, `children`, or
    patterns relative to the candidate (`checkpoint.submodules`)."""
    planner: str = PLANNER
    """What plans."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        parts = self.submodules if isinstance(self.submodules, str) else list(self.submodules)
        return {"planner": self.planner, "modules": list(self.modules),
                "memory_budget": self.memory_budget, "submodules": parts}


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Saved activations kept in host memory until backward (saved-tensor hooks)."""

    scope: Literal["checkpoint_inputs", "all_saved", "rules"]
    """`checkpoint_inputs`: only what checkpointed modules save (their inputs), the same as
    DeepSpeed cpu_checkpointing; `all_saved`: every activation autograd saves outside a
    checkpointed call (all of them without checkpointing; with `mode: external`, what the
    model's own checkpointed calls keep); `rules`: what the modules whose rule offloads keep
    (everything they save with `mode: none`, their inputs with `full`)."""
    pin: bool
    """Page-locked host buffers."""
    pin_budget: int | None
    """Most pinned bytes held; past it, pageable memory. None = unbounded."""
    pin_budget_per_node: int | None = None
    """Most pinned bytes the engines of all the job's ranks on one node hold together (a ledger
    they share, `actcfg.runtime.host_budget`). None = unbounded."""
    keep_last: int = 1
    """Groups marked for offload that stay on the device at the forward/backward turn, newest first."""
    max_inflight: int = 1
    """Most groups whose copies to the host run at once."""
    engine: str = OFFLOAD_ENGINE
    """What offloads them."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {"engine": self.engine, "scope": self.scope, "pin": self.pin,
                "pin_budget": self.pin_budget, "pin_budget_per_node": self.pin_budget_per_node,
                "keep_last": self.keep_last,
                "max_inflight": self.max_inflight}


@dataclass(frozen=True, kw_only=True)
class CompilePlan:
    """`compile:`: torch.compile over what the checkpoint and offload plans put in place, per
    block or whole (the plan is profiled this way and applied this way)."""

    scope: Literal["blocks", "model"]
    """`blocks`: each module a rule takes (or each candidate of a plan request); `model`: the root."""
    backend: str
    """torch.compile's `backend=`."""
    api: str = COMPILE_API
    """What compiles."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order."""
        return {"api": self.api, "scope": self.scope, "backend": self.backend}


@dataclass(frozen=True, kw_only=True)
class WrapPlan:
    """What the torch runtime does to a model: checkpoint wrapping and activation offload, then
    torch.compile where the policy says `compile`."""

    checkpoint: CheckpointPlan | ExternalCheckpointPlan | RulesPlan | PlanRequest | None
    offload: OffloadPlan | None
    compile: CompilePlan | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, keys in a stable order (`compile` only where the policy compiles)."""
        out = {
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
            "offload": None if self.offload is None else self.offload.to_json(),
        }
        if self.compile is not None:
            out["compile"] = self.compile.to_json()
        return out


def _destinations(policy: Policy) -> dict[str, Any]:
    """WrapPlan attribute path -> value, for every `Key` entry the policy's variant has."""
    out: dict[str, Any] = {}
    for path, entry in TABLE.items():
        if isinstance(entry, Key):
            value = field_value(policy, path)[0]
            if value is not MISSING:
                out[entry.key] = value
    return out


def to_torch_native(policy: Policy) -> WrapPlan:
    """The torch-native plan for `policy`; TranslationError for DeepSpeed-only settings."""
    refuse_inexpressible(policy, Backend.TORCH)
    dest = _destinations(policy)
    mode = dest["checkpoint"]
    compiled = None
    if dest.get("compile.scope", MISSING) is not MISSING:
        compiled = CompilePlan(scope=dest["compile.scope"], backend=dest["compile.backend"])
    if mode == "rules":
        return dataclasses.replace(_rules_plan(policy, dest), compile=compiled)
    if mode == "auto":
        # What the plan offloads is decided by the planner; its rules carry pin and pin_budget.
        return WrapPlan(checkpoint=PlanRequest(modules=tuple(dest["checkpoint.modules"]),
                                               memory_budget=dest["checkpoint.memory_budget"],
                                               submodules=dest["checkpoint.submodules"]),
                        offload=None, compile=compiled)
    checkpoint: CheckpointPlan | ExternalCheckpointPlan | RulesPlan | PlanRequest | None = None
    if mode == "external":
        checkpoint = ExternalCheckpointPlan()
    elif mode != "none":
        checkpoint = CheckpointPlan(
            modules=tuple(dest["checkpoint.modules"]),
            every=dest["checkpoint.every"],
            use_reentrant=dest["checkpoint.use_reentrant"],
            selective_save_ops=(tuple(dest["checkpoint.selective_save_ops"])
                                if mode == "selective" else None),
        )
    offload = None
    if dest["offload.scope"]:
        offload = OffloadPlan(
            scope="checkpoint_inputs" if mode in ("full", "selective") else "all_saved",
            pin=dest["offload.pin"],
            pin_budget=dest["offload.pin_budget"],
            pin_budget_per_node=dest["offload.pin_budget_per_node"],
        )
    return WrapPlan(checkpoint=checkpoint, offload=offload)


def _rules_plan(policy: Policy, dest: dict[str, Any]) -> WrapPlan:
    """The `RulesPlan` of a `mode: rules` policy, rule by rule (the table names where each
    field of a rule goes: `checkpoint.rules[].<attribute>`)."""
    ckpt = policy.checkpoint
    rules = tuple(
        RulePlan(
            modules=tuple(rule.modules),
            checkpoint=rule.mode,
            offload=rule.cpu_checkpointing,
            selective_save_ops=(tuple(rule.save_ops or DEFAULT_SAVE_OPS)
                                if rule.mode == "selective" else None),
        )
        for rule in ckpt.rules
    )
    predicted = ckpt.predicted
    plan = RulesPlan(rules=rules,
                     predicted_step_time_ms=None if predicted is None else predicted.step_time_ms,
                     predicted_peak=None if predicted is None else predicted.peak)
    offload = None
    if any(r.offload for r in rules):
        offload = OffloadPlan(scope="rules", pin=dest["offload.pin"],
                              pin_budget=dest["offload.pin_budget"],
                              pin_budget_per_node=dest["offload.pin_budget_per_node"],
                              keep_last=dest["offload.keep_last"],
                              max_inflight=dest["offload.max_inflight"])
    return WrapPlan(checkpoint=plan, offload=offload)
