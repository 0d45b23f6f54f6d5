"""What a profile of one training step says about each candidate block, as plain data (no torch).

`actcfg.plan.profile` measures it on the GPU (or estimates it on the CPU, for tests), and
`actcfg.plan.solve` chooses from it. Bytes are GPU bytes above what is allocated when a step
begins; times are milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CHOICES",
    "CHOICE_OF",
    "CHOICE_TABLE",
    "COUNTERPART",
    "OFFLOADS",
    "BlockProfile",
    "Choice",
    "Option",
    "Profile",
]


@dataclass(frozen=True)
class Choice:
    """What a block may do with what it saves, and the `checkpoint.mode: rules` rule it becomes.

    The one statement of a choice: its name (the plan's, the report's and the JSON's word for
    it), its rule's checkpoint mode, whether it offloads, and its on-device twin. A new choice
    is one row of `CHOICE_TABLE`; the solver, the profile and the written plan read it from here.
    """

    name: str
    mode: str
    """The rule's `mode`: `none`, `selective` or `full`."""
    offload: bool = False
    """True when the rule sets `cpu_checkpointing`: what the block keeps goes to the host."""
    counterpart: str | None = None
    """An offload choice's on-device twin: the same recompute, without the copies."""
    parts: bool = False
    """True when the rule names the block's parts (`checkpoint.submodules`) instead of the
    block: each part is checkpointed on its own, and what the block saves outside its parts
    stays saved. In backward only one part is recomputed at a time, so the block's recompute
    peaks at its largest part, not at the whole block."""

    def rule(self, modules: tuple[str, ...]) -> Any:
        """This choice as a `checkpoint.mode: rules` rule over `modules` (fnmatch patterns)."""
        from actcfg.policy.schema import Rule

        # cpu_checkpointing only where it is true: as the written plan sets it (fields set match).
        offload = {"cpu_checkpointing": True} if self.offload else {}
        return Rule(modules=modules, mode=self.mode, **offload)


CHOICE_TABLE: tuple[Choice, ...] = (
    Choice("keep", "none"),
    Choice("selective", "selective"),
    Choice("split", "full", parts=True),
    Choice("full", "full"),
    Choice("full_offload", "full", offload=True, counterpart="full"),
    Choice("split_offload", "full", offload=True, counterpart="split", parts=True),
    Choice("offload", "none", offload=True, counterpart="keep"),
)
"""Every choice, from the most memory to the least (roughly)."""

CHOICE_OF: dict[str, Choice] = {c.name: c for c in CHOICE_TABLE}
"""A choice by its name."""

CHOICES: tuple[str, ...] = tuple(c.name for c in CHOICE_TABLE)
"""The choices' names, in `CHOICE_TABLE` order."""

OFFLOADS: frozenset[str] = frozenset(c.name for c in CHOICE_TABLE if c.offload)
"""The choices that copy to the host and back."""

COUNTERPART: dict[str, str] = {c.name: c.counterpart for c in CHOICE_TABLE if c.counterpart}
"""Each offload choice's on-device twin."""


@dataclass(frozen=True)
class Option:
    """What one block costs under one choice.

    The memory model (see `actcfg.plan.solve`): with S the bytes the blocks before this one hold
    and L what their forwards left until the turn, its forward peaks at S + L + (copies still in
    flight) + `forward_peak`, its backward at S + (the reload of the block below, started during
    it, unless the engine waits past its recompute's peak: `BlockProfile.reload_waits`) +
    `backward_peak` (and, where the reload below begins part way, at S + `reload_level` + that
    reload), and from its forward to its backward it adds `held` to what every
    later block sees (and `left` to what every later forward and the turn see).
    """

    held: int
    """Bytes the block keeps on the device from its forward to its backward."""
    moved: int = 0
    """Bytes copied to the host in forward and back in backward (offload choices)."""
    forward_peak: int = 0
    """Peak during the block's forward above S and the copies in flight."""
    backward_peak: int = 0
    """Peak during the block's backward above S and the reload below (its own activations back
    or rematerialized, their gradients, and the parameter gradients of the blocks after it)."""
    recompute_ms: float = 0.0
    """Its forward run again in backward (full: all of it; selective: all but the saved ops)."""
    extra_ms: float = 0.0
    """Everything this choice adds to a plain step besides copies the model prices separately:
    the recompute, and what the uniform run of this choice measured beyond the model."""
    left: int = 0
    """Bytes the block's forward leaves alive beyond `held` until the forward/backward turn:
    what it made that something other than autograd holds until the forward ends (under
    autocast, the casts of weights it does not save, cached until the autocast region ends).
    Every later block's forward and the turn see it; no backward does."""
    moved_last: int = -1
    """Of `moved`, the bytes of the block's last offload group: what the engine reloads while
    the block above runs its backward (it reloads one group ahead). A choice on parts moves each
    part as a group of its own, so only its last part's inputs come back that early (the CPU
    blocks stack: 4 of a split_offload block's 8 block inputs); any other choice is one group.
    -1: not measured, all of `moved`."""
    moved_first: int = -1
    """Of `moved_last`, the bytes of its `RELOAD_STORAGES` newest storages
    (`actcfg.runtime.offload`): what the engine reloads of it first, newest first, and holds
    ahead of their use while the block above runs its backward. Where a block's widest storages
    are not its last (an attention's scores before a narrow MLP), this is less than its
    `reload_ahead`. -1: not measured (`reload_ahead` bounds it)."""
    reload_level: int = -1
    """Where the block's backward begins reloading the block below only part way through
    (a recompute the engine waits past, `BlockProfile.reload_waits`; a choice on parts, under
    its first part): the peak of the rest of its backward above S, less the reload below its
    uniform run held there. A larger reload below (an `offload` block's two newest storages,
    `moved_first`, where that run reloaded one block input) meets this level, not `backward_peak`: the model
    takes the larger of the two. Read from the offload twin's uniform run (`full_offload` for a
    whole recompute, `split_offload` for parts); -1: not measured (no such run, or the reload
    below never began in its backward)."""


@dataclass(frozen=True)
class BlockProfile:
    """One candidate block: its plain forward and backward time, and each choice's cost."""

    name: str
    """Qualified module name."""
    forward_ms: float
    backward_ms: float
    options: dict[str, Option]
    """The choices measured for this block (offload ones only where offloading can run)."""
    parts: tuple[str, ...] = ()
    """Qualified names of the block's parts (`checkpoint.submodules`), in module order; empty
    when the block is planned whole (then it has no `split` or `split_offload` option)."""
    reload_waits: bool = False
    """True when, under this block checkpointed (any choice that recomputes it whole), the
    offload engine reloads the block below only past this block's recompute peak: its uniform
    full_offload run counted the reload deferred (`OffloadStats.deferred_groups`). False: the
    reload starts as the recompute begins (the engine fell back: a compiled region, no trainable
    parameters of its own, a signal too late; or no full_offload run measured it)."""
    reload_ahead: int = 0
    """Bytes of the block's `RELOAD_STORAGES` largest saved storages
    (`actcfg.runtime.offload`): the most of its offloaded bytes the engine holds reloaded ahead
    of their use at once, below the bytes window. 0: unknown (a profile from before the engine
    counted storages), bounded by the window alone."""
    shared_in: int = 0
    """Bytes of storages the block saves that an earlier block's `held` counts (a tensor given to
    every block, as a Llama's rotary cos/sin, counts to the first block that saves it). Where
    that block moves them (an offload choice) and this one keeps them in place (any other
    choice), they stay on the device from the turn through this block's backward: the model
    counts them to the lowest such block above it (`actcfg.plan.solve`, `PIN`)."""
    shared_out: int = 0
    """Bytes of storages the block's `held` counts that a later block saves too (`shared_in`)."""

    def taken(self, choice: str) -> tuple[str, ...]:
        """The modules the rule of `choice` takes for this block: its parts for a choice on
        parts, else the block itself."""
        return self.parts if CHOICE_OF[choice].parts else (self.name,)


@dataclass(frozen=True)
class Profile:
    """One training step, profiled: the candidate blocks in forward order and the rest."""

    blocks: tuple[BlockProfile, ...]
    plain_step_ms: float
    """Step time with no policy."""
    plain_peak: int
    """Peak bytes of a step with no policy."""
    turn_peak: int
    """Peak around the forward/backward turn above what the blocks hold and left (what runs
    after the blocks: a head, the loss, the start of backward; with `after_turn_peak`, only
    until the model's forward returns)."""
    forward_after_ms: float
    """Forward compute after the last block (the last block's copy can hide behind it)."""
    backward_before_ms: float
    """Backward compute before the last block's backward (its reload can hide behind it)."""
    outside_peak: int = 0
    """Peak of what runs before the first block and after the last backward mark (an
    embedding's forward and backward, the parameter gradients at the end): no choice moves it."""
    head_peak: int = 0
    """The part of `outside_peak` before the first block, inside the model's forward (what
    `forward_grads` meets)."""
    d2h_gbps: float = 0.0
    """Copy bandwidth to the host, pinned, GB/s (0: offload not profiled)."""
    h2d_gbps: float = 0.0
    """Copy bandwidth back to the device, pinned, GB/s."""
    largest_storage: int = 0
    """The largest storage a block saves (bytes): the offload engine's copy windows are counted
    in it (see `window_storages`)."""
    turn_peaks: dict[str, int] = field(default_factory=dict)
    """Per choice of the last block, the peak around the turn above what the blocks hold, as
    that choice's uniform run measured it, the last block's copies in flight and reloads ahead
    included (they meet the head's start, not necessarily its peak). A choice not here: its
    copies at the turn added to `turn_peak`, the largest of the turns."""
    after_turn_peak: int = 0
    """The largest of `after_turn_peaks`: the turn after the model's forward returned, above
    what the blocks hold (what they left is gone by then); the turn is the larger of this and
    `turn_peak` with what the blocks left."""
    after_turn_peaks: dict[str, int] = field(default_factory=dict)
    """Per choice of the last block, the part of its turn after the model's forward returned,
    as `turn_peaks` (a choice not here: `after_turn_peak`)."""
    accumulated_grads: int = 0
    """Bytes of the parameter gradients a later micro-batch of gradient accumulation starts
    with (they live from the first micro-batch's backward to the optimizer step): added to
    every peak, as that micro-batch's forward and turn meet all of them (its backward meets
    those the first one's had made by then too, so there it is an upper bound). 0: every step
    starts without gradients."""
    forward_grads: int = 0
    """Bytes of the previous step's parameter gradients that live through a step's forward and
    are freed before its backward (Lightning's automatic optimization sets them to None after
    `training_step` returns): added to every term until the model's forward returns (each
    block's forward, the head, the turn's part inside the forward), not to backward's, where
    the profile measured the new gradients as they are made. A step's memory is read above its
    start less these gradients, so that the parameter gradients are inside `memory_budget` in
    every trainer. 0: the gradients are freed before the step starts (or under
    `accumulated_grads`, which counts them everywhere)."""
    window_storages: int = 0
    """The engine's copy window, in `largest_storage`s, per `max_inflight` in forward (copies in
    flight) and per prefetch in backward (reloads ahead of their use): the engine copies storage
    by storage within it (`actcfg.runtime.offload.WINDOW_STORAGES`); 0: unknown, whole blocks
    in flight."""
    device: str = "cuda"
    """`cuda`: measured; `cpu`: times are wall-clock and memory is counted, not measured."""
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    """The uniform runs measured while profiling: choice -> {step_ms, peak}."""
    notes: tuple[str, ...] = ()
    """What the profile could not measure and estimated instead."""
    compiled: str = ""
    """How every run was compiled (`blocks with inductor`); empty: eager."""
    profile_ms: float = 0.0
    """Wall time of the whole profile, its compiles excluded."""
    compile_ms: float = 0.0
    """Wall time the profile spent compiling: its counting forwards, and each compiled run's
    warm-up steps less as many settled steps."""
    parts_ms: dict[str, float] = field(default_factory=dict)
    """`profile_ms` by part, in this order: `counts` (the counting forwards, the first forward
    of the profile among them), each choice's uniform run (applying it, its probed and unprobed
    steps, removing it), `warm_ups` (every run's first step), `host_pool` (host buffers made and
    pinned on the runs' critical path, and unpinned at the end), `copy_bandwidth` and `rest`.
    Compiling is in `compile_ms`, not here."""
    parts_steps: dict[str, int] = field(default_factory=dict)
    """How many times each part of `parts_ms` called the model: under `counts` a forward alone
    (a third of a step or so), elsewhere a training step's forward (its backward follows).
    `warm_ups` counts every step a run took before the steps it read (compiled: each step that
    compiled, whose time beyond a steady step is in `compile_ms`)."""

    def copy_ms(self, nbytes: int, to_host: bool) -> float:
        """Milliseconds one copy of `nbytes` takes at the profiled bandwidth."""
        gbps = self.d2h_gbps if to_host else self.h2d_gbps
        return 0.0 if nbytes == 0 or gbps <= 0 else nbytes / (gbps * 1e6)

    def copy_windows(self) -> list[dict[str, Any]]:
        """Per block, the compute its copies can hide behind while the copy engine would otherwise
        idle: to the host, the next block's forward (the last block's: what runs after the
        blocks); back, the next block's plain backward (the last block's: what runs before it)."""
        out = []
        n = len(self.blocks)
        for b, block in enumerate(self.blocks):
            later = self.blocks[b + 1] if b + 1 < n else None
            out.append({
                "block": block.name,
                "to_host_ms": later.forward_ms if later else self.forward_after_ms,
                "to_device_ms": later.backward_ms if later else self.backward_before_ms,
                "keep_bytes": block.options["keep"].held if "keep" in block.options else None,
                "to_host_copy_ms": self.copy_ms(block.options["offload"].moved, True)
                if "offload" in block.options else None,
            })
        return out

    def choices(self) -> tuple[str, ...]:
        """The choices every block has, in CHOICES order."""
        return tuple(c for c in CHOICES if all(c in b.options for b in self.blocks))

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """The profile `to_json` wrote."""
        blocks = tuple(
            BlockProfile(b["name"], b["forward_ms"], b["backward_ms"],
                         {c: Option(**o) for c, o in b["options"].items()}, tuple(b.get("parts", ())),
                         bool(b.get("reload_waits", False)), int(b.get("reload_ahead", 0)),
                         int(b.get("shared_in", 0)), int(b.get("shared_out", 0)))
            for b in data["blocks"])
        rest = {k: v for k, v in data.items() if k != "blocks"}
        rest["notes"] = tuple(rest.get("notes", ()))
        return cls(blocks=blocks, **rest)
