"""The cost model: a `Profile` from the byte counts and the uniform runs the profile measured.

Each block's options (see `actcfg.plan.model.Option`) are the measured peaks less what the blocks
before it hold (and, in forward, what they left until the turn), and the recompute and the rest each choice's uniform run took beyond the model
(`actcfg.plan.solve.predict`), spread over its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from actcfg.plan.model import CHOICE_OF, CHOICE_TABLE, CHOICES, COUNTERPART, OFFLOADS, BlockProfile, Option, Profile
from actcfg.plan.probe import StepReading
from actcfg.plan.solve import predict, uniform_copies, uniform_reloads_below

__all__ = ["MIN_EXTRA_MS", "Run", "assemble"]

MIN_EXTRA_MS = 1e-6
"""Every choice but keep costs at least this: a measured recompute of 0 (noise) must not make
checkpointing look free, or a plan would checkpoint what fits anyway."""


@dataclass
class Run:
    """One uniform run: what the probe read, and the bytes the engine moved per block."""

    step: StepReading
    moved: list[int]
    reload_waits: list[bool] = field(default_factory=list)
    """Per block, whether the engine reloaded the block below only past this block's recompute
    peak in the run's last step (`OffloadStats.deferred_groups`); empty: none did."""
    moved_last: list[int] = field(default_factory=list)
    """Per block, the bytes its last group moved (`Option.moved_last`); empty: not counted."""
    moved_first: list[int] = field(default_factory=list)
    """Per block, the bytes of its last group that backward reloads first
    (`Option.moved_first`); empty: not counted."""


def _memory_notes(runs: dict[str, Run], cuda: bool) -> list[str]:
    if cuda:
        return []
    out = ["memory on the CPU is the bytes of live tensor storages (`LiveBytes`), not an "
           "allocator's: no caching, no fragmentation"]
    guessed = [c for c, r in runs.items() if not r.step.memory]  # on the CPU: compiled runs
    if guessed:
        out.append(f"{', '.join(guessed)}: compiled graphs run below the dispatch mode that counts "
                   "live bytes on the CPU, so their peaks are estimated from the counted saved bytes")
    return out


def assemble(names: list[str], held: dict[str, list[int]], runs: dict[str, Run], device: str,
              d2h: float, h2d: float, notes: list[str], *,
              parts: list[tuple[str, ...]] | None = None, largest_storage: int = 0,
              window_storages: int = 0, left: dict[str, list[int]] | None = None,
              twice: dict[str, list[int]] | None = None,
              reload_ahead: list[int] | None = None,
              shared: tuple[list[int], list[int]] | None = None) -> Profile:
    """The profile from the byte counts and the uniform runs (see `Option` for each term);
    `parts` names each block's parts (`checkpoint.submodules`); `largest_storage` and
    `window_storages` state the offload engine's copy window (see `Profile`); `left`, per
    choice counted, what each block's forward leaves alive until the turn (`Option.left`);
    `twice`, per choice counted, the bytes of each block's held count that an earlier block's
    count holds too (one storage: see `saved_bytes`' `passed_on`); `reload_ahead`, per block,
    the most of it the engine holds reloaded ahead of use (`BlockProfile.reload_ahead`);
    `shared`, per block, the bytes of storages it saves that an earlier block's keep count
    holds, and of those it holds that a later block saves (`BlockProfile.shared_in`,
    `shared_out`)."""
    n = len(names)
    ahead = list(reload_ahead or []) + [0] * (n - len(reload_ahead or []))
    shared_in, shared_out = shared or ([0] * n, [0] * n)
    parts = parts or [()] * n
    cuda = device == "cuda"
    # Whether the engine waits past each block's recompute peak to reload the block below: as
    # the uniform full_offload run did it (the one run that recomputes over offloaded blocks).
    waits = list(runs["full_offload"].reload_waits) if "full_offload" in runs else []
    waits = waits + [False] * (n - len(waits))
    estimated_keep = "keep" not in runs
    ref = runs["keep"] if not estimated_keep else runs["full"]
    forward_ms = list(ref.step.forward_ms)
    backward_ms = list(ref.step.backward_ms)
    if estimated_keep:  # a full recompute is one forward: the plain backward is the rest
        backward_ms = [max(0.0, g - f) for g, f in zip(backward_ms, forward_ms)]
    moved = {c: runs[c].moved if c in runs else [0] * n for c in CHOICES}
    moved_last = {c: runs[c].moved_last if c in runs and runs[c].moved_last else [-1] * n for c in CHOICES}
    moved_first = {c: runs[c].moved_first if c in runs and runs[c].moved_first else [-1] * n for c in CHOICES}
    hold: dict[str, list[int]] = {"keep": held["keep"]}
    for c in ("full", "selective", "split"):
        if c in held:
            hold[c] = held[c]
    for choice in CHOICE_TABLE:  # an offload choice holds its twin's bytes less what it moved
        if choice.counterpart in hold:
            hold[choice.name] = [max(0, h - m) for h, m in zip(hold[choice.counterpart],
                                                               moved[choice.name])]
    usable = [c for c in CHOICES if c in hold and (c in runs or (c == "keep" and estimated_keep))]
    # What each block leaves until the turn: counted per on-device choice; an offload choice
    # runs its twin's forward, so it leaves what its twin leaves.
    lasts = {c: list(v) for c, v in (left or {}).items()}
    for choice in CHOICE_TABLE:
        if choice.counterpart in lasts:
            lasts[choice.name] = lasts[choice.counterpart]
    lasts = {c: lasts.get(c, [0] * n) for c in CHOICES}

    # A storage two blocks' counts both hold is held once in the run, so the blocks before b hold
    # it once there. Each block's `held` keeps it (in a plan the other block may not hold it):
    # a plan of such blocks is predicted above what it holds, never below. Read from the
    # inflated sums instead, a selective chain of lone Linears (each output counted as its own
    # saved output and as the next one's input) read every block's own peaks as 0, and a plan of
    # kept Linears with the last one selective was predicted 2 layer inputs under what it ran.
    shared = {c: (twice or {}).get(c, [0] * n) for c in hold}

    def before(c: str, b: int) -> int:  # what the blocks before b hold in a uniform run of c
        return sum(hold[c][:b]) - sum(shared[c][:b])

    def forward_before(c: str, b: int) -> int:  # ... and left, at b's forward (b = n: the turn)
        return before(c, b) + sum(lasts[c][:b])

    # What the model adds above the blocks' held bytes for each uniform run (copies in flight,
    # reloads), from solve's own terms: measured minus these is what each option records.
    copies_only = Profile(
        blocks=tuple(BlockProfile(name, f, 0.0,
                                  {c: Option(held=0, moved=moved[c][b], moved_last=moved_last[c][b],
                                             moved_first=moved_first[c][b])
                                   for c in CHOICES},
                                  reload_waits=waits[b], reload_ahead=ahead[b])
                     for b, (name, f) in enumerate(zip(names, forward_ms))),
        plain_step_ms=0.0, plain_peak=0, turn_peak=0, forward_after_ms=0.0, backward_before_ms=0.0,
        d2h_gbps=d2h, h2d_gbps=h2d, largest_storage=largest_storage,
        window_storages=window_storages, device=device)
    copies = {c: uniform_copies(copies_only, c) for c in CHOICES}

    # Where the reload below begins part way through a block's backward (a recompute the engine
    # waits past; a choice on parts, under its first part), the rest of that backward less the
    # reload its uniform run held there: read in the offload twin's run, whose engine reloads
    # (selective's in full_offload's: past the MLP's gradients it holds what full's recompute
    # rebuilt of the attention, the ops it saved).
    reloads_below = {c: uniform_reloads_below(copies_only, c) for c in ("full_offload", "split_offload")}

    def reload_level(c: str, b: int) -> int:
        ran = "split_offload" if CHOICE_OF[c].parts else "full_offload"
        if CHOICE_OF[c].mode == "none" or ran not in runs or not (cuda or runs[ran].step.memory):
            return -1
        below = runs[ran].step.below_peak
        if b >= len(below) or below[b] < 0:
            return -1
        return max(0, below[b] - before(ran, b) - reloads_below[ran][b])

    options: list[dict[str, Option]] = [{} for _ in range(n)]
    for c in usable:
        ran = c if c in runs else "full"  # keep, estimated from full when it did not fit
        source = runs[ran]
        for b in range(n):
            if cuda or source.step.memory:
                fwd = source.step.forward_peak[b] - forward_before(ran, b) - copies[ran][0][b]
                bwd = source.step.backward_peak[b] - before(ran, b) - copies[ran][1][b]
                if ran != c:
                    fwd += hold["keep"][b] - hold["full"][b] + lasts["keep"][b] - lasts["full"][b]
            else:  # not read (compiled on the CPU): its activations while it runs, and again in backward
                fwd = hold["keep"][b]
                bwd = hold["keep"][b] + hold[c][b] + moved[c][b]
            if CHOICE_OF[c].mode != "none":  # recomputes: as its on-device twin's run measured
                rec_run = runs.get(CHOICE_OF[c].counterpart or c)
                recompute = max(0.0, rec_run.step.backward_ms[b] - backward_ms[b]) if rec_run else 0.0
            else:
                recompute = 0.0
            options[b][c] = Option(held=hold[c][b], moved=moved[c][b], forward_peak=max(0, fwd),
                                   backward_peak=max(0, bwd), recompute_ms=recompute, extra_ms=recompute,
                                   left=lasts[c][b], moved_last=moved_last[c][b],
                                   moved_first=moved_first[c][b],
                                   reload_level=reload_level(c, b))
    # The turn in two parts: until the model's forward returns, with what the blocks left, and
    # after, without it (under autocast the casts go as its region ends with the forward: a
    # GPT-2 under CPU autocast, after them on a kept last block, over-predicted checkpointed
    # blocks then a kept one by a block's casts).
    read = {c: r.step for c, r in runs.items() if c in hold and (cuda or r.step.memory)}
    # Within the forward, the turn may also peak after what the blocks left is gone (accelerate
    # ends autocast's region, then copies the outputs to fp32, all inside the model's forward):
    # a run's reading there is at most the blocks' left plus a with-left term, and at least any
    # without-left moment. So the reading less what is held bounds a without-left moment, and
    # joins the after part: the smallest such reading of the on-device choices (the head does not
    # depend on the last block's choice), an offload choice's own (its copies meet the head).
    without = {c: st.turn_forward_peak - before(c, n) for c, st in read.items()}
    on_device = [w for c, w in without.items() if c not in OFFLOADS]
    floor = {c: w if c in OFFLOADS or not on_device else min(on_device) for c, w in without.items()}
    turn_peaks = [st.turn_forward_peak - forward_before(c, n) - copies[c][2] for c, st in read.items()] or [0]
    after_peaks = [max(st.turn_after_peak - before(c, n), floor[c]) - copies[c][2]
                   for c, st in read.items()] or [0]
    # Per choice of the last block, its run's own turn: the head's start meets the last block's
    # copies, its peak (logits, the loss) need not, so adding both to the largest turn counted
    # a whole block twice (a CPU Llama of 8 layers: +32% over its measured offload run).
    turn_by = {c: max(0, st.turn_forward_peak - forward_before(c, n)) for c, st in read.items()}
    after_by = {c: max(0, st.turn_after_peak - before(c, n), floor[c]) for c, st in read.items()}
    measured = {c: {"step_ms": r.step.step_ms, "peak": r.step.peak} for c, r in runs.items()}
    plain_ms = ref.step.step_ms if not estimated_keep else ref.step.step_ms - sum(
        o["full"].recompute_ms for o in options)
    base = Profile(
        blocks=tuple(BlockProfile(name, f, g, opts, ps, w, a, si, so)
                     for name, f, g, opts, ps, w, a, si, so in zip(names, forward_ms, backward_ms, options, parts,
                                                                   waits, ahead, shared_in, shared_out)),
        plain_step_ms=plain_ms,
        plain_peak=0,
        turn_peak=max(0, max(turn_peaks)),
        turn_peaks=turn_by,
        after_turn_peak=max(0, max(after_peaks)),
        after_turn_peaks=after_by,
        forward_after_ms=ref.step.forward_after_ms,
        backward_before_ms=ref.step.backward_before_ms,
        outside_peak=max([r.step.outside_peak for r in runs.values() if cuda or r.step.memory] or [0]),
        head_peak=max([r.step.head_peak for r in runs.values() if cuda or r.step.memory] or [0]),
        d2h_gbps=d2h, h2d_gbps=h2d, largest_storage=largest_storage,
        window_storages=window_storages, device=device, measured=measured,
        notes=tuple(notes) + tuple(_memory_notes(runs, cuda)),
    )
    # Each choice's uniform run, beyond what the model predicts for it, is spread over its blocks
    # (copy and compute contending, hooks, kernels a checkpoint changes): uniform plans then
    # predict what was measured, and mixed plans interpolate.
    for c in usable:
        if c not in runs or c == "keep":
            continue
        extra = (runs[c].step.step_ms - predict(base, (c,) * n, 1)[0]) / n
        for b in range(n):
            o = options[b][c]
            options[b][c] = replace(o, extra_ms=o.recompute_ms + extra)
    for b in range(n):
        for c in list(options[b]):
            o = options[b][c]
            floor = 0.0 if c == "keep" else MIN_EXTRA_MS
            twin = COUNTERPART.get(c)
            if twin in options[b]:  # an offload never costs less than its on-device twin
                floor = max(floor, options[b][twin].extra_ms + MIN_EXTRA_MS)
            if o.extra_ms < floor:
                options[b][c] = replace(o, extra_ms=floor)
    out = Profile(
        blocks=tuple(BlockProfile(name, f, g, opts, ps, w, a, si, so)
                     for name, f, g, opts, ps, w, a, si, so in zip(names, forward_ms, backward_ms, options, parts,
                                                                   waits, ahead, shared_in, shared_out)),
        plain_step_ms=base.plain_step_ms, plain_peak=0, turn_peak=base.turn_peak,
        turn_peaks=base.turn_peaks, after_turn_peak=base.after_turn_peak,
        after_turn_peaks=base.after_turn_peaks,
        forward_after_ms=base.forward_after_ms, backward_before_ms=base.backward_before_ms,
        outside_peak=base.outside_peak, head_peak=base.head_peak,
        d2h_gbps=d2h, h2d_gbps=h2d, largest_storage=largest_storage,
        window_storages=window_storages, device=device, measured=measured, notes=base.notes,
    )
    plain_peak = int(runs["keep"].step.peak) if not estimated_keep and (cuda or runs["keep"].step.memory) \
        else predict(out, ("keep",) * n)[1]
    return Profile(blocks=out.blocks, plain_step_ms=out.plain_step_ms, plain_peak=plain_peak,
                   turn_peak=out.turn_peak, turn_peaks=out.turn_peaks,
                   after_turn_peak=out.after_turn_peak, after_turn_peaks=out.after_turn_peaks,
                   forward_after_ms=out.forward_after_ms,
                   backward_before_ms=out.backward_before_ms, outside_peak=out.outside_peak,
                   head_peak=out.head_peak,
                   d2h_gbps=d2h, h2d_gbps=h2d, largest_storage=largest_storage,
                   window_storages=window_storages, device=device, measured=measured, notes=out.notes)
