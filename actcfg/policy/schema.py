"""The activation-memory policy, schema version 1: Pydantic models and cross-field rules.

Version 1 grew compatibly: `checkpoint.mode: rules` (per-module choices, what `actcfg plan`
writes) and `checkpoint.mode: auto` with `memory_budget` (ask for a plan) are new; every file
that validated before still does, and means the same.

No I/O and no torch: this module is imported by `actcfg validate`, which must stay light.
Every model is strict (unknown keys are errors, a quoted "false" is not a boolean) and
frozen, and every field carries a docstring that becomes its description in `actcfg schema`
(through `_descriptions.py`, generated from those docstrings).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from actcfg.policy._descriptions import DESCRIPTIONS as _DOC
from actcfg.backends import BACKENDS, RUNTIME_BACKENDS, Backend
from actcfg.backends.table import Finding, findings

__all__ = [
    "AutoCheckpoint",
    "Backend",
    "Checkpoint",
    "Compile",
    "DEFAULT_SAVE_OPS",
    "ExternalCheckpoint",
    "Finding",
    "FullCheckpoint",
    "MODULES_PLACEHOLDER",
    "NoCheckpoint",
    "Policy",
    "Prediction",
    "Rule",
    "RulesCheckpoint",
    "SelectiveCheckpoint",
    "check_rules",
    "format_size",
    "parse_size",
    "policy_field_paths",
    "policy_json_schema",
    "user_path",
]


# --- sizes ---------------------------------------------------------------------------

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# Exactly the strings parse_size accepts: units in any case ("16GIB"), and a fraction only
# with a unit larger than a byte ("1.5GiB", never "1.5" or "1.5B").
SIZE_PATTERN = r"^\s*(\d+\s*[bB]?|\d+(\.\d+)?\s*[kKmMgGtT][iI]?[bB])\s*$"


def parse_size(value: Any) -> int:
    """A byte count from a whole number of bytes or a human size such as `16GiB` or `8 GB`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PydanticCustomError(
            "size_type",
            "expected a size such as 16GiB or a whole number of bytes, got {kind}",
            {"kind": type(value).__name__},
        )
    if isinstance(value, int):
        if value < 0:
            raise PydanticCustomError("size_negative", "a size cannot be negative", {})
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _SIZE_UNITS):
        raise PydanticCustomError(
            "size_format",
            "'{value}' is not a size: write a number and one of B, KB, MB, GB, TB, "
            "KiB, MiB, GiB, TiB, such as 16GiB",
            {"value": value},
        )
    number = match.group(1)
    if unit in ("", "b") and "." in number:
        raise PydanticCustomError(
            "size_format", "'{value}' is not a whole number of bytes", {"value": value}
        )
    # Integer arithmetic, not float: exact for 1.5GiB, no OverflowError for 400 digits.
    # A fraction of a byte is rounded down, but a size that is not zero never becomes 0.
    scale = _SIZE_UNITS[unit or "b"]
    whole, _, fraction = number.partition(".")
    size = int(whole) * scale + int(fraction or "0") * scale // 10 ** len(fraction)
    if size == 0 and number.strip("0.") != "":
        raise PydanticCustomError(
            "size_under_a_byte",
            "'{value}' is less than one byte, which would round to 0 (no pinned memory at all)",
            {"value": value},
        )
    return size


def format_size(n: int) -> str:
    """The shortest exact binary spelling of a byte count (`16GiB`), else plain bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


Size = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": SIZE_PATTERN},
            ]
        }
    ),
]



def _not_zero(size: int) -> int:
    if size == 0:
        raise PydanticCustomError("size_zero", "a size of 0 bytes leaves no room at all", {})
    return size


PositiveSize = Annotated[
    int,
    BeforeValidator(parse_size),
    AfterValidator(_not_zero),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1},
                # SIZE_PATTERN, less the spellings of zero (`0`, `0GiB`, `0.0 MiB`)
                {"type": "string",
                 "pattern": r"^(?!\s*0+(\.0+)?\s*[a-zA-Z]*\s*$)" + SIZE_PATTERN[1:]},
            ]
        }
    ),
]
"""A size that must be more than 0 bytes (a budget: 0 would be a plan that fits nothing)."""

# --- checkpoint modes ----------------------------------------------------------------

# Matmul-class outputs are expensive to recompute and are what selective
# activation checkpointing keeps; pointwise ops and norms are recomputed.
# The same default as torchtitan's `_save_list`, minus collectives.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)

MODULES_PLACEHOLDER = "CHANGE_ME"
"""What `actcfg import` writes for `checkpoint.modules` when the ds_config cannot say which
modules are checkpointed; a rule refuses it until it is replaced."""

OpName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_.]*$")]
ModulePattern = Annotated[StrictStr, Field(min_length=1)]


def _relative_pattern(value: str) -> str:
    # A submodule pattern is matched against names relative to a block (`mlp`, `attn.*`):
    # an empty segment or an unclosed `[` can match nothing, and would only fail at plan time.
    if not value.strip() or value != value.strip():
        raise PydanticCustomError("relative_pattern", "a submodule pattern is empty or has spaces "
                                  "around it; write a name relative to the block, such as `mlp`")
    if value.startswith(".") or value.endswith(".") or ".." in value:
        raise PydanticCustomError(
            "relative_pattern", "'{value}' has an empty name segment: a submodule pattern is a "
            "dotted name relative to the block (`mlp`, `self_attn`, `attn.*`), with no leading, "
            "trailing or doubled dot", {"value": value})
    if value.count("[") != value.count("]"):
        raise PydanticCustomError(
            "relative_pattern", "'{value}' has an unclosed `[`: in an fnmatch pattern `[...]` is a "
            "set of characters; write `[[]` for a literal `[`", {"value": value})
    return value


SubmodulePattern = Annotated[StrictStr, AfterValidator(_relative_pattern)]
# A word or a list, told apart before validating: a plain union reported both branches' errors.
Submodules = Annotated[
    Union[Annotated[Literal["none", "children"], Tag("word")],
          Annotated[tuple[SubmodulePattern, ...], Field(min_length=1), Tag("patterns")]],
    Discriminator(lambda v: "word" if isinstance(v, str) else "patterns"),
]


class _Strict(BaseModel):
    """Shared strictness: unknown keys are errors, values are frozen, defaults validated.

    Each field's description is the docstring under it, as with `use_attribute_docstrings=True`,
    but read from `_descriptions.py` (generated from this file; tests/policy/test_descriptions.py keeps
    it in sync): Pydantic would re-read this source on every import, ~9 ms of `actcfg validate`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, defer_build=True)


class NoCheckpoint(_Strict):
    """No activation checkpointing: autograd saves every activation it needs."""

    mode: Literal["none"] = Field(description=_DOC["NoCheckpoint.mode"])
    """`none`: no recomputation."""


class _Checkpointed(_Strict):
    modules: tuple[ModulePattern, ...] = Field(min_length=1, description=_DOC["_Checkpointed.modules"])
    """Which submodules are checkpointed: fnmatch patterns, each matched against a
    module's class name and its qualified name (`GPT2Block`, `layers.*`)."""

    every: StrictInt = Field(1, ge=1, description=_DOC["_Checkpointed.every"])
    """Checkpoint every n-th matched module in module order (the n-th, 2n-th, ...); 1 = all."""

    reentrant: StrictBool = Field(False, description=_DOC["_Checkpointed.reentrant"])
    """torch only: use torch's reentrant checkpoint (default: non-reentrant, as torch advises)."""


class FullCheckpoint(_Checkpointed):
    """Keep only each checkpointed module's inputs; recompute its insides in backward."""

    mode: Literal["full"] = Field(description=_DOC["FullCheckpoint.mode"])
    """`full`: whole-module recomputation."""


class SelectiveCheckpoint(_Checkpointed):
    """torch only: keep the outputs of expensive ops, recompute the cheap ones."""

    mode: Literal["selective"] = Field(description=_DOC["SelectiveCheckpoint.mode"])
    """`selective`: op-level recomputation (torch `create_selective_checkpoint_contexts`)."""

    save_ops: tuple[OpName, ...] = Field(DEFAULT_SAVE_OPS, description=_DOC["SelectiveCheckpoint.save_ops"])
    """Ops whose outputs are saved, as `namespace.op` (`aten.mm`); every other op is recomputed."""


class ExternalCheckpoint(_Strict):
    """The model checkpoints itself: actcfg configures the backend and wraps no module."""

    mode: Literal["external"] = Field(description=_DOC["ExternalCheckpoint.mode"])
    """`external`: the model's own code routes its checkpointed calls (Megatron and gpt-neox
    call deepspeed.checkpointing.checkpoint; Hugging Face models with activation checkpointing
    on call torch.utils.checkpoint): actcfg configures the backend (and offloads, with
    `cpu_checkpointing`) around them."""


class Rule(_Strict):
    """One rule of `checkpoint.rules`: which modules it takes, and what they keep of what they save."""

    modules: tuple[ModulePattern, ...] = Field(min_length=1, description=_DOC["Rule.modules"])
    """fnmatch patterns, each matched against a module's class name and its qualified name
    (`Block`, `layers.3`); a module takes the first rule that matches it."""

    mode: Literal["none", "full", "selective"] = Field("full", description=_DOC["Rule.mode"])
    """`full`: keep the module's inputs, recompute its insides in backward; `selective`: keep the
    outputs of `save_ops`, recompute the rest; `none`: no recomputation."""

    cpu_checkpointing: StrictBool = Field(False, description=_DOC["Rule.cpu_checkpointing"])
    """Keep in host memory until backward what the module keeps: with `mode: none` everything it
    saves, with `mode: full` its inputs (actcfg's offload engine)."""

    save_ops: tuple[OpName, ...] | None = Field(None, description=_DOC["Rule.save_ops"])
    """`mode: selective` only: ops whose outputs are saved, as `namespace.op`; unset: matmuls and
    attention, as `checkpoint.save_ops`."""


class Prediction(_Strict):
    """What `actcfg plan` predicted for this policy; `actcfg verify` compares it with what it measures."""

    step_time_ms: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] = Field(
        description=_DOC["Prediction.step_time_ms"])
    """Predicted time of one training step (forward and backward), in milliseconds."""

    peak: Size = Field(description=_DOC["Prediction.peak"])
    """Predicted peak GPU memory of one step above what is allocated when it begins, in bytes
    or a human size (`5GiB`)."""


class RulesCheckpoint(_Strict):
    """torch only: per-module choices, an ordered list of rules; a module takes the first rule
    that matches it, and modules no rule matches keep all their activations."""

    mode: Literal["rules"] = Field(description=_DOC["RulesCheckpoint.mode"])
    """`rules`: each module as its rule says (what `actcfg plan` writes)."""

    rules: tuple[Rule, ...] = Field(min_length=1, description=_DOC["RulesCheckpoint.rules"])
    """The rules, first match wins: each `{modules: [...], mode: none|full|selective,
    cpu_checkpointing: bool, save_ops: [...]}`."""

    keep_last: StrictInt = Field(1, ge=0, description=_DOC["RulesCheckpoint.keep_last"])
    """Offload engine: how many of the newest modules whose rule offloads stay on the GPU at the
    forward/backward turn. Each costs its activations' memory at the turn and saves their copy
    both ways (nothing hides those copies: backward needs the newest modules first)."""

    max_inflight: StrictInt = Field(1, ge=1, description=_DOC["RulesCheckpoint.max_inflight"])
    """Offload engine: most modules whose copies to the host run at once; each in flight keeps
    its GPU memory until its copy is done, and more than one saves time only when modules'
    copies are uneven."""

    predicted: Prediction | None = Field(None, description=_DOC["RulesCheckpoint.predicted"])
    """What `actcfg plan` predicted for these rules (`step_time_ms`, `peak`); `actcfg verify`
    reports it beside what it measures."""


class AutoCheckpoint(_Strict):
    """torch only: ask for the fastest per-module choices that keep a step within `memory_budget`."""

    mode: Literal["auto"] = Field(description=_DOC["AutoCheckpoint.mode"])
    """`auto`: plan from a profile of one training step on the GPU (`actcfg plan`, or
    `actcfg.apply(model, policy, inputs=...)`)."""

    modules: tuple[ModulePattern, ...] = Field(min_length=1, description=_DOC["AutoCheckpoint.modules"])
    """The candidate modules the plan chooses for (the model's blocks, such as `[Block]`): fnmatch
    patterns on class names and qualified names; each keeps, checkpoints or offloads as planned."""

    submodules: Submodules = Field(
        "none", description=_DOC["AutoCheckpoint.submodules"])
    """Finer candidates: the parts of each candidate module the plan may checkpoint one by one
    instead of the whole module (a block's recompute then peaks at its largest part, not the
    whole block). `none`: whole modules only; `children`: each module's direct children that hold
    parameters (a Llama layer's `self_attn`, `mlp` and norms); or fnmatch patterns on names
    relative to the module or class names (`[self_attn, mlp]`, `[LlamaMLP]`)."""


class Compile(_Strict):
    """torch only, with `checkpoint.mode: auto` (and the `mode: rules` plan it writes): the model
    runs under torch.compile, so the plan is profiled compiled and `actcfg.apply` compiles it the
    same way after applying the rules (checkpoint, then compile, as torchtitan orders them).

    Both ways people compile are spelled, because they plan differently: per block (torchtitan
    compiles each transformer block; graphs end at block boundaries, and identical blocks share
    one graph) and the whole model (one graph, which may fuse and save across blocks)."""

    scope: Literal["blocks", "model"] = Field(description=_DOC["Compile.scope"])
    """`blocks`: each candidate module's forward is compiled (the modules `checkpoint.modules`
    names, every module a rule takes in a plan); `model`: the whole model's forward is compiled."""

    backend: StrictStr = Field("inductor", min_length=1, description=_DOC["Compile.backend"])
    """torch.compile's `backend=`: `inductor` (torch's default, as on a CUDA GPU) unless set;
    `aot_eager` traces autograd as inductor does without generating code (no C compiler needed:
    CPU tests). The plan is profiled with this backend and applied with it."""


Checkpoint = Annotated[
    Union[NoCheckpoint, FullCheckpoint, SelectiveCheckpoint, ExternalCheckpoint, RulesCheckpoint,
          AutoCheckpoint],
    Discriminator("mode"),
]
CHECKPOINT_MODES = ("none", "full", "selective", "external", "rules", "auto")


# --- cross-field rules -----------------------------------------------------------------


def _backend_rules(policy: Policy, backend: Backend, origin: str) -> list[Finding]:
    spec = BACKENDS[backend]
    return findings(spec.table, policy, backend.value, spec.checkpoint_function, origin)


def offloads(policy: Policy) -> bool:
    """True when the policy may offload: `cpu_checkpointing`, a rule that offloads, or a plan."""
    ckpt = policy.checkpoint
    return (policy.cpu_checkpointing or ckpt.mode == "auto"
            or (ckpt.mode == "rules" and any(r.cpu_checkpointing for r in ckpt.rules)))


def _plan_rules(policy: Policy) -> list[Finding]:
    """The rules of `memory_budget`, `mode: auto` and `mode: rules`."""
    out: list[Finding] = []
    ckpt = policy.checkpoint
    if ckpt.mode == "auto" and policy.memory_budget is None:
        out.append(Finding(
            "budget-needed", "error", ("checkpoint", "mode"),
            "checkpoint.mode `auto` asks for the fastest plan within `memory_budget`, which is not set",
            "add `memory_budget: <size>` (the most GPU memory one training step may allocate, such "
            "as 40GiB), or choose the mode yourself: none, full, selective or rules",
        ))
    if policy.memory_budget is not None and ckpt.mode != "auto":
        out.append(Finding(
            "budget-without-plan", "error", ("memory_budget",),
            f"`memory_budget` asks for a plan, but checkpoint.mode is {ckpt.mode}, set by hand: "
            "the budget and the hand-set mode could disagree",
            "remove `memory_budget`, or write `checkpoint: {mode: auto, modules: [...]}` to let "
            "actcfg plan within it (`actcfg plan` writes the plan as `mode: rules`)",
        ))
    if policy.cpu_checkpointing and ckpt.mode in ("rules", "auto"):
        out.append(Finding(
            "offload-per-rule" if ckpt.mode == "rules" else "offload-by-plan", "error",
            ("cpu_checkpointing",),
            "top-level `cpu_checkpointing` does not apply with checkpoint.mode rules: each rule "
            "says whether its modules offload" if ckpt.mode == "rules" else
            "top-level `cpu_checkpointing` does not apply with checkpoint.mode auto: the plan "
            "decides which modules offload",
            "remove it, and set `cpu_checkpointing: true` in the rules whose modules should offload"
            if ckpt.mode == "rules" else "remove `cpu_checkpointing`",
        ))
    if ckpt.mode == "rules":
        for i, rule in enumerate(ckpt.rules):
            if rule.save_ops is not None and rule.mode != "selective":
                out.append(Finding(
                    "save-ops-need-selective", "error", ("checkpoint", "rules", i, "save_ops"),
                    f"`save_ops` names the ops a selective rule saves, but checkpoint.rules.{i} "
                    f"has mode {rule.mode}",
                    "set `mode: selective` in this rule, or remove `save_ops`",
                ))
            if MODULES_PLACEHOLDER in rule.modules:
                out.append(_placeholder(("checkpoint", "rules", i, "modules")))
        if not offloads(policy):
            for key, default in (("keep_last", 1), ("max_inflight", 1)):
                if key in ckpt.model_fields_set and getattr(ckpt, key) != default:
                    out.append(Finding(
                        "unused-setting", "warning", ("checkpoint", key),
                        f"`{key}` schedules the offload engine, but no rule offloads "
                        "(`cpu_checkpointing: true`)",
                        f"remove `{key}`, or set `cpu_checkpointing: true` in a rule",
                    ))
    if ckpt.mode == "auto" and MODULES_PLACEHOLDER in ckpt.modules:
        out.append(_placeholder(("checkpoint", "modules")))
    if policy.compile is not None and ckpt.mode not in ("auto", "rules"):
        out.append(Finding(
            "compile-without-plan", "error", ("compile",),
            f"`compile` says the plan is profiled and applied under torch.compile, but "
            f"checkpoint.mode is {ckpt.mode}: there is no plan to profile",
            "remove `compile` (and compile the model yourself), or write `checkpoint: {mode: auto, "
            "modules: [...]}` with `memory_budget` to plan under compile",
        ))
    return out


def _placeholder(path: tuple[str | int, ...]) -> Finding:
    return Finding(
        "placeholder", "error", path,
        f"`{MODULES_PLACEHOLDER}` is the placeholder `actcfg import` writes: a ds_config "
        "cannot say which modules the model checkpoints",
        f"replace {MODULES_PLACEHOLDER} with the class names of the modules to checkpoint, "
        "or write `mode: external` if the model calls deepspeed.checkpointing.checkpoint itself",
    )


def check_rules(policy: Policy, backends: tuple[Backend | str, ...] = ()) -> list[Finding]:
    """Every cross-field finding for `policy` under its own backend and each of `backends`."""
    out: list[Finding] = []
    ckpt = policy.checkpoint
    if policy.contiguous and not policy.partition:
        out.append(Finding(
            "contiguous-needs-partition", "error", ("contiguous",),
            "`contiguous` packs partitioned activations into one buffer; it needs `partition: true`",
            "set `partition: true`, or remove `contiguous`",
        ))
    if policy.contiguous and policy.num_checkpoints is None and ckpt.mode == "external":
        # With `mode: full` actcfg.apply routes the modules and passes their number; with
        # `external` the model makes the checkpointed calls, and nothing counts them.
        out.append(Finding(
            "contiguous-needs-num-checkpoints", "error", ("contiguous",),
            "`contiguous` preallocates one buffer per checkpointed call and needs "
            "`num_checkpoints` with checkpoint.mode external: the model makes the calls, so "
            "actcfg cannot count them (DeepSpeed asserts at configure time)",
            "set `num_checkpoints` to the number of checkpointed calls per step (Megatron: "
            "num_layers; gpt-neox: ceil(num_layers / checkpoint_num_layers))",
        ))
    if ckpt.mode in ("full", "selective") and MODULES_PLACEHOLDER in ckpt.modules:
        out.append(_placeholder(("checkpoint", "modules")))
    out.extend(_plan_rules(policy))
    if policy.num_checkpoints is not None and not policy.contiguous:
        out.append(Finding(
            "unused-setting", "warning", ("num_checkpoints",),
            "`num_checkpoints` is only read by DeepSpeed's contiguous buffers; it does nothing here",
            "remove `num_checkpoints`, or set `contiguous: true`",
        ))
    if ckpt.mode == "selective" and ckpt.reentrant:
        out.append(Finding(
            "selective-not-reentrant", "error", ("checkpoint", "reentrant"),
            "selective checkpointing runs only on torch's non-reentrant checkpoint",
            "remove `reentrant: true`, or use `mode: full`",
        ))
    for key in ("pin_budget", "pin_budget_per_node"):
        if getattr(policy, key) is not None and not offloads(policy):
            out.append(Finding(
                "unused-setting", "warning", (key,),
                f"`{key}` bounds host memory for offloaded activations, but `cpu_checkpointing` "
                "is off: nothing is offloaded",
                f"set `cpu_checkpointing: true`, or remove `{key}`",
            ))
        elif getattr(policy, key) is not None and not policy.pin:
            out.append(Finding(
                "unused-setting", "warning", (key,),
                f"`{key}` bounds pinned memory, but `pin: false` pins nothing",
                f"remove `{key}`, or set `pin: true`",
            ))
    seen: set[Backend] = set()
    for backend in map(Backend.parse, (policy.backend, *backends)):
        if backend in seen:
            continue
        seen.add(backend)
        origin = "" if backend is policy.backend else " (from --backend)"
        out.extend(_backend_rules(policy, backend, origin))
    return out


# --- the policy ----------------------------------------------------------------------------

RuntimeBackend = Annotated[
    Literal[tuple(b.value for b in RUNTIME_BACKENDS)],  # type: ignore[valid-type]
    AfterValidator(Backend.parse),
]
"""A backend `actcfg.apply` runs; the others (hf, lightning) are translation targets only."""


def _whole_number(value: Any) -> Any:
    # Literal[1] alone takes `true` and `1.0` (both == 1); the JSON Schema's `const: 1` does not.
    if isinstance(value, (bool, float)):
        raise PydanticCustomError("literal_error", "Input should be 1", {"expected": "1"})
    return value


class Policy(_Strict):
    """An activation-memory policy: what is recomputed, partitioned and offloaded."""

    version: Annotated[Literal[1], BeforeValidator(_whole_number)] = Field(
        description=_DOC["Policy.version"])
    """Schema version of this file; this actcfg reads version 1."""

    backend: RuntimeBackend = Field(Backend.TORCH, description=_DOC["Policy.backend"])
    """Backend that `actcfg.apply` and `actcfg translate` use unless told otherwise."""

    checkpoint: Checkpoint = Field(NoCheckpoint(mode="none"), description=_DOC["Policy.checkpoint"])
    """Activation checkpointing: which modules recompute their activations in backward."""

    partition: StrictBool = Field(False, description=_DOC["Policy.partition"])
    """DeepSpeed only: split checkpointed activations across model-parallel ranks
    (DeepSpeed `partition_activations`)."""

    cpu_checkpointing: StrictBool = Field(False, description=_DOC["Policy.cpu_checkpointing"])
    """Keep checkpointed inputs in host memory until backward (DeepSpeed `cpu_checkpointing`);
    torch with `checkpoint.mode: none` offloads every saved activation."""

    pin: StrictBool = Field(True, description=_DOC["Policy.pin"])
    """torch only: offload into page-locked (pinned) host buffers, which copy about 4x faster."""

    pin_budget: Size | None = Field(None, description=_DOC["Policy.pin_budget"])
    """torch only: most pinned host memory the offload engine holds, in bytes or a human size
    (`16GiB`); past it, pageable memory. Unset: no bound (buffers are reused step after step)."""

    pin_budget_per_node: Size | None = Field(None, description=_DOC["Policy.pin_budget_per_node"])
    """torch only: most pinned host memory the offload engines of all the job's ranks on one node
    hold together, in bytes or a human size (`256GiB`); each rank pins what the others leave
    (first come, first served; `pin_budget` still bounds each one), past it pageable memory.
    Unset: no bound per node."""

    contiguous: StrictBool = Field(False, description=_DOC["Policy.contiguous"])
    """DeepSpeed only: pack partitioned activations into one preallocated buffer
    (DeepSpeed `contiguous_memory_optimization`); needs `partition`, and `num_checkpoints`
    unless `checkpoint.mode` is full (apply then passes the number of modules it routes)."""

    num_checkpoints: StrictInt | None = Field(None, ge=1, description=_DOC["Policy.num_checkpoints"])
    """DeepSpeed only: checkpointed calls per step, sizing the contiguous buffers
    (DeepSpeed `number_checkpoints`); unset with `mode: full`: the number of routed modules."""

    synchronize: StrictBool = Field(False, description=_DOC["Policy.synchronize"])
    """DeepSpeed only: synchronize the device at every checkpoint boundary
    (DeepSpeed `synchronize_checkpoint_boundary`); for debugging and timing."""

    profile: StrictBool = Field(False, description=_DOC["Policy.profile"])
    """DeepSpeed only: time checkpoint forward and backward passes (DeepSpeed `profile`)."""

    memory_budget: PositiveSize | None = Field(None, description=_DOC["Policy.memory_budget"])
    """torch only, with `checkpoint.mode: auto`: the most GPU memory one training step may
    allocate above what is allocated when it begins, less the parameter gradients alive then
    (activations, their gradients and the parameter gradients, also the previous step's where
    the step still holds them, as Lightning does until backward), in bytes or a human size
    (`40GiB`); the plan keeps its peak within it."""

    compile: Compile | None = Field(None, description=_DOC["Policy.compile"])
    """torch only, with `checkpoint.mode: auto` or `rules`: the model runs under torch.compile
    (`{scope: blocks|model, backend: inductor}`): the plan is profiled compiled, and
    `actcfg.apply` compiles after applying the rules. Unset: eager, and actcfg compiles nothing."""

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> Policy:
        backends = tuple((info.context or {}).get("backends", ()))
        findings = check_rules(self, backends)
        errors = [f for f in findings if f.severity == "error"]
        if info.context is not None:
            # The checker reports the warnings with positions: hand them over rather than
            # walking the backend tables a second time.
            info.context["warnings"] = [f for f in findings if f.severity == "warning"]
        if errors:
            raise PydanticCustomError(
                "policy_rule",
                "{summary}",
                {
                    "summary": "; ".join(f"{'.'.join(map(str, f.path))}: {f.message} ({f.hint})"
                                         for f in errors),
                    "findings": tuple(errors),
                },
            )
        return self


def user_path(loc: tuple[str | int, ...], data: Any) -> tuple[str | int, ...]:
    """A Pydantic error location as the user wrote it: the union tags (`full` in
    `('checkpoint', 'full', 'modules')`, `patterns` under `submodules`) are not keys of the
    file, so they are dropped."""
    if (
        len(loc) >= 2
        and loc[0] == "checkpoint"
        and loc[1] in CHECKPOINT_MODES
        and isinstance(data, dict)
        and isinstance(data.get("checkpoint"), dict)
        and data["checkpoint"].get("mode") == loc[1]
    ):
        loc = (loc[0], *loc[2:])
    if loc[:2] == ("checkpoint", "submodules") and len(loc) >= 3 and loc[2] in _SUBMODULES_TAGS:
        loc = (*loc[:2], *loc[3:])  # the word-or-list tag of `checkpoint.submodules`, likewise
    return loc


_SUBMODULES_TAGS = ("word", "patterns")


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file, in the draft-07 subset that editors understand."""
    schema = Policy.model_json_schema(ref_template="#/definitions/{model}")
    definitions = schema.pop("$defs", {})
    out = {"$schema": "http://json-schema.org/draft-07/schema#", **schema}
    if definitions:
        out["definitions"] = definitions
    return out


def policy_field_paths() -> list[str]:
    """Every leaf field of the schema as a dotted path, each checkpoint variant included (the
    backend tables must have an entry for each; a test checks)."""
    import typing

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        out: list[str] = []
        for name, info in model.model_fields.items():
            annotation = info.annotation
            while typing.get_origin(annotation) is typing.Annotated:
                annotation = typing.get_args(annotation)[0]
            variants = [a for a in typing.get_args(annotation)
                        if isinstance(a, type) and issubclass(a, BaseModel)]
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                variants = [annotation]
            if not variants:
                out.append(f"{prefix}{name}")
            for variant in variants:
                out += [p for p in walk(variant, f"{prefix}{name}.") if p not in out]
        return out

    return walk(Policy, "")
