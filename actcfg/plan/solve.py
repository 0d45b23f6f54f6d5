"""Choose per block among keep / selective / split (its parts checkpointed one by one) / full /
full + offload / offload: the least predicted step time whose predicted peak stays within the
budget. Pure: plain numbers in, a plan out.

The model, for blocks 0..n-1 in forward order with choices c (S_b: bytes blocks 0..b-1 hold,
the sum of their `held`; M_b: bytes block b copies each way; d_b, h_b: those copies' times):

* peak = the largest of what runs outside the blocks (`outside_peak`) and, for every block b,
  its forward (S_b + L_b + in flight + `forward_peak`, L_b: what blocks 0..b-1 left alive
  until the turn, the sum of their `left`) and
  its backward (S_b + reloads ahead of their use + `backward_peak`), and the turn (S_n + L_n +
  the turn the profile measured with the last block's choice, `turn_peaks`, + block n-2's copy
  if still in flight); under gradient accumulation, plus the gradients a later micro-batch
  starts with (`accumulated_grads`); where the previous step's gradients live until its
  backward (Lightning), plus those in every forward term, the head and the turn's part inside
  the forward (`forward_grads`). The copies follow the engine's schedule: every offloaded block but the
  last leaves storage by storage, at most W = `window_storages` x `largest_storage` x
  `max_inflight` bytes in flight; the last offloaded block (the group that stays for backward)
  holds its storages to its end (its forward peaks as its on-device twin's) and leaves whole,
  with at most one copy in flight under it; a choice on parts never does (each part is a group
  of its own: only its last part's, its inputs, leaves whole, at that part's end, as in its
  uniform run). In
  flight during b's forward: block b-1's copy (within W, or whole for the last offloaded
  block), and block b-2's if it is still running (its copy is longer than block b-1's forward,
  and nothing waited for it); a copy that takes no time (the host loopback's) is done at once.
  Reloads ahead during b's backward: block b-1's storages (of a choice on parts, its last
  part's only, `moved_last`: the engine reloads one group ahead; none where b recomputes and the
  engine reloads them only past its recompute's peak, `reload_waits`: measured per block in the
  uniform full_offload run), and b's own where it offloads without recompute, within `window_storages` x `largest_storage` (one prefetch)
  and, of each block, its `reload_ahead` (its two largest storages: the engine holds at most
  `RELOAD_STORAGES` storages reloaded ahead of their use; of the block below, its two newest,
  `moved_first`, which come back first). Where the reload of block b-1 begins part way
  through b's backward (`reload_waits`; a choice on parts), it meets the rest of that
  backward: S + `reload_level` + that reload. A profile
  without the window (W = 0) counts whole blocks (a profile from before the engine's window).
  A storage every block is given (a Llama's rotary cos/sin) counts to the first block that saves
  it; where that block offloads, the lowest block above it that keeps it in place holds it, in
  its forward, its backward and S of every term after (`PIN`).
* step time = the plain step + each block's `extra_ms` (recompute, and what its uniform run
  measured beyond this model) + the copy time nothing hides: a block's copy to the host hides
  behind the forward of the blocks up to the next launch that must wait for it (the next
  block's end when that block offloads too and `max_inflight` is 1; else the next two blocks,
  less the next one's own copy), its reload behind the next block's backward and recompute
  (the last block's: behind what runs after the blocks).

Every term depends on a block and its neighbours only, so an exact dynamic program over the
blocks finds the optimum: states are the last two choices, each holding the Pareto front of
(bytes held so far, bytes left until the turn so far, time so far); a front larger than `MAX_FRONT` is thinned to the fastest
entry per 1/MAX_FRONT of the budget, which keeps every plan within the budget (bytes are never
rounded) but may miss the optimum by that grain. Entries that cannot lead to the plan chosen
are dropped before the fronts are built (`_Reach`): those that some later block or the turn
cannot fit whatever the later blocks choose, and those that cannot finish as fast as a plan
already known to fit (the fastest uniform plan, a coarse search's plan, `max_inflight` 1's
optimum when 2 is tried). Ties go to fewer bytes copied: an offload
costs at least its on-device twin (the profile clamps it so), so a plan offloads a block only
where the twin would not fit, that is, where the offload lowers the peak.
"""

from __future__ import annotations

import bisect
import math
import time

from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from actcfg.errors import PlanError
from actcfg.plan.model import CHOICE_OF, COUNTERPART, OFFLOADS, Option, Profile
from actcfg.runtime.reports import PlanReport, memory_size

__all__ = ["MAX_FRONT", "Plan", "lowest_plan", "predict", "smallest_budget", "smallest_peak", "solve",
           "uniform_copies", "uniform_reloads_below"]

MAX_FRONT = 2048
"""Most entries one state of the dynamic program keeps (see the module docstring)."""

SKETCH = 4
"""The front a first, coarse search keeps: its plan (fast, not always the fastest) bounds the
exact search, which then drops every entry that cannot finish as fast."""

MIXED_HEADROOM = 1e-4
"""Share of the budget a plan that mixes choices leaves free. A uniform plan is a run the
profile measured, so its prediction is that measurement; a mix is composed from per-block
terms, and on the H200 (2026-12-01, the Llama stack) mixes that filled their budget to the
byte measured 4-12 KiB above it (allocations of a few hundred bytes the terms do not see).
0.01% of a budget of gigabytes is hundreds of KiB, and of a CPU test's KiB a few bytes."""


@dataclass(frozen=True)
class Plan:
    """The chosen choice per block, the engine's schedule, and what the model predicts."""

    blocks: tuple[str, ...]
    choices: tuple[str, ...]
    max_inflight: int
    step_ms: float
    """Predicted step time."""
    peak: int
    """Predicted peak bytes (at most `budget`)."""
    budget: int
    taken: tuple[tuple[str, ...], ...] = ()
    """Per block, the modules its rule takes: the block, or its parts for a choice on parts
    (`split`, `split_offload`) (empty: every block itself, as in a plan over whole blocks)."""
    solve_ms: float = 0.0
    """Wall time `solve` took to choose it (on the host, after the profile)."""

    def modules(self) -> tuple[str, ...]:
        """Every module the plan's rules take, in block order."""
        return tuple(n for named in (self.taken or tuple((b,) for b in self.blocks)) for n in named)

    @property
    def kept_at_turn(self) -> int:
        """Blocks after the last offloaded one, which stay on the GPU at the forward/backward
        turn (where nothing hides a copy); 0 when the plan offloads nothing."""
        offloaded = [i for i, c in enumerate(self.choices) if c in OFFLOADS]
        return len(self.choices) - 1 - offloaded[-1] if offloaded else 0

    def report(self, profile: Profile, policy_yaml: str) -> PlanReport:
        """What this plan says to the user and the applied policy's report, with the `profile`
        it was solved from and its written policy."""
        return PlanReport(
            memory_budget=self.budget,
            choices=tuple(zip(self.blocks, self.choices)),
            predicted_step_time_ms=self.step_ms,
            predicted_peak=self.peak,
            plain_step_time_ms=profile.plain_step_ms,
            plain_peak=profile.plain_peak,
            max_inflight=self.max_inflight,
            kept_at_turn=self.kept_at_turn,
            policy_yaml=policy_yaml,
            device=profile.device,
            compiled=profile.compiled or None,
            profile_ms=profile.profile_ms,
            compile_ms=profile.compile_ms,
            parts_ms=dict(profile.parts_ms),
            solve_ms=self.solve_ms,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"blocks": [{"module": b, "choice": c} for b, c in zip(self.blocks, self.choices)],
                "max_inflight": self.max_inflight, "kept_at_turn": self.kept_at_turn,
                "step_ms": self.step_ms, "peak": self.peak, "budget": self.budget}


PENDING = 4
"""A bit of the dynamic program's phase (`_Terms.labelled`): storages moved wait for a block
that keeps them in place (`PIN`)."""

LAST = "!"
"""Marks, inside the model, an offload choice on the last block that offloads (`full_offload!`):
the engine copies that block whole at its end (it opens as the group that stays for backward)
and every earlier offloaded block storage by storage, so the copy terms differ. Never on a
choice on parts (`split_offload`): its parts are groups of their own, all but the last leave
storage by storage, and the last (its inputs) leaves whole at that part's end, inside the
block, as every block's last part does in the choice's uniform run. Never in a plan's
choices."""


PIN = "^"
"""Marks, inside the model, an on-device choice (`keep^`) on the lowest block that saves in place
a storage an earlier block moved (`BlockProfile.shared_in`): a Llama gives every layer the
rotary cos/sin, and the keep count holds them in layer 0's bytes alone. Where layer 0 offloads
them, the engine moves layer 0's copy, but a later layer that keeps them in place holds the
storage on the device from the turn through its backward (the engine's copy frees nothing,
and layer 0 reloads it beside it once that layer's backward is done). Neither block's `held`
counts it: the marked block adds its `shared_in` to its held bytes, forward and backward.
Never in a plan's choices."""


def _base(c: str | None) -> str | None:
    try:
        return _BASES[c]
    except KeyError:
        base = c[:-len(LAST)] if c is not None and c.endswith(LAST) else \
            c[:-len(PIN)] if c is not None and c.endswith(PIN) else c
        _BASES[c] = base
        return base


def _pinned(c: str | None) -> bool:
    return c is not None and c.endswith(PIN)


def _last(c: str | None) -> bool:
    return c is not None and c.endswith(LAST)


_BASES: dict[str | None, str | None] = {}  # label -> choice: the solver asks for it per term


class _Terms:
    """The model's terms for one profile and one `max_inflight`. Choices may carry `LAST`."""

    def __init__(self, profile: Profile, max_inflight: int) -> None:
        self.p = profile
        self.m = max_inflight
        self.n = len(profile.blocks)
        self.f = [b.forward_ms for b in profile.blocks]
        self.g = [b.backward_ms for b in profile.blocks]
        # The engine's windows in bytes (0: unknown, whole blocks in flight): copies in flight
        # in forward, per max_inflight; reloads ahead of their use in backward (prefetch 1).
        self.largest = profile.largest_storage if profile.window_storages else 0
        self.back_window = profile.window_storages * self.largest
        self.window = max_inflight * self.back_window
        # The previous step's gradients, alive until the forward returns (Lightning), and what
        # runs outside the blocks with them: the head meets them, the tail does not.
        self.grads = profile.forward_grads
        self.outside = max(profile.outside_peak, profile.head_peak + self.grads) if self.grads \
            else profile.outside_peak
        # Storages a block saves that an earlier one's bytes count, and the other way (`PIN`).
        self.shared_in = [b.shared_in for b in profile.blocks]
        self.shared_out = [b.shared_out for b in profile.blocks]
        # The dynamic program asks for the same terms from every phase and every search
        # (`solve`'s coarse one, then the exact one): each is worked out once.
        self._needs: dict[tuple[int, str | None, str | None, str], tuple[int, int]] = {}
        self._exposed: dict[tuple[int, str, str | None], float] = {}

    def opt(self, b: int, c: str) -> Any:
        return self.p.blocks[b].options[_base(c)]

    def offloads(self, c: str | None) -> bool:
        return _base(c) in OFFLOADS

    def pin(self, b: int, c: str | None) -> int:
        """Bytes block b (label c) holds in place for an earlier block that moved them (`PIN`)."""
        return self.shared_in[b] if _pinned(c) else 0

    def held(self, b: int, c: str) -> int:
        """What block b (label c) holds from its forward through its backward."""
        return self.opt(b, c).held + self.pin(b, c)

    def labels(self, choices: tuple[str, ...] | list[str]) -> list[str]:
        """`choices` labelled as the model reads them: the last offloaded block (`LAST`) and the
        block that holds in place what an earlier one moved (`PIN`), as `labelled` takes them
        block by block."""
        offloaded = [b for b, c in enumerate(choices) if c in OFFLOADS]
        out, phase = [], 0
        for b, c in enumerate(choices):
            options = self.labelled(b, c, phase)  # an offload: (not the last, the last)
            label, phase = options[-1] if offloaded and b == offloaded[-1] else options[0]
            out.append(label)
        return out

    def moved(self, b: int, c: str | None) -> int:
        return self.opt(b, c).moved if self.offloads(c) else 0

    def moved_last(self, b: int, c: str | None) -> int:
        """Bytes of block b's copy (choice c) in its last group, the one the engine reloads
        while the block above runs its backward (one group ahead): a choice on parts moves each
        part as a group of its own (`Option.moved_last`); any other, one group."""
        if not self.offloads(c):
            return 0
        o = self.opt(b, c)
        return o.moved if o.moved_last < 0 else min(o.moved_last, o.moved)

    def d2h(self, b: int, c: str | None) -> float:
        return self.p.copy_ms(self.moved(b, c), to_host=True)

    def h2d(self, b: int, c: str | None) -> float:
        return self.p.copy_ms(self.moved(b, c), to_host=False)

    def running(self, b: int, c: str | None, after_ms: float) -> int:
        """Bytes of block b's copy (choice c) still on the device `after_ms` of compute after its
        launch: all of them while it runs (the peak may come anywhere in that compute). A copy
        that takes no time (the host loopback's are synchronous) gives its memory back at the
        next saved tensor: storage by storage that is the block's own newest storage, which its
        measured forward holds; the last offloaded block's whole copy, launched at its end, is
        still there while the next op makes its output."""
        t = self.d2h(b, c)
        if t > after_ms or (after_ms == 0 and (_last(c) or not self.window)):
            return self.moved(b, c)
        return 0

    def inflight(self, b: int, p2: str | None, p1: str | None, c: str | None = None) -> int:
        """Copies still on the device while block b (choice c) runs forward (b = n: at the turn).

        Block b-1's copy was launched as block b began (the last one of its storages, or, for
        the last offloaded block, all of it); block b-2's is still there if it outlasts block
        b-1's forward and nothing waited for it. Storage by storage, the engine keeps at most
        its window in flight (`window_storages` of the largest storage, per max_inflight), and
        under the last offloaded block, which holds its own storages to its end, one copy."""
        one = self.running(b - 1, p1, 0.0) if b >= 1 else 0
        two = self.running(b - 2, p2, self.f[b - 1]) if b >= 2 else 0
        if not self.window:  # whole blocks (a profile without the engine's window)
            return one + (two if self.m >= 2 or not self.offloads(p1) else 0)
        if _last(p1):  # launched whole; at most max_inflight - 1 earlier copies beside it
            return one + (min(two, self.largest) if self.m >= 2 else 0)
        if _last(p2) and not self.offloads(p1):
            return two
        out = min(one + two, self.window)
        return min(out, self.largest) if _last(c) else out

    def reload_ahead(self, b: int, p1: str | None, c: str | None = None) -> int:
        """Reloads on the device ahead of their use while block b (choice c) runs backward
        (b = n: at the turn, as the head's backward unpacks what it saved). Whole blocks: block
        b-1's, started as block b's backward does (its last group's: `moved_last`). Storage by
        storage, the engine reloads the storages of the block in use and of the one below (its
        last group: one group ahead), newest first, within its backward
        window (`window_storages` of the largest storage), which block b's own storages share
        with block b-1's until they are used: an offload without recompute uses its storages
        one by one through its backward, a checkpoint's inputs are all used as its recompute
        begins (then they are the block's own activations, in its `backward_peak`). Where block
        b recomputes whole and the engine waits past its recompute's peak to reload block b-1
        (`reload_waits`), none of block b-1's is ahead at that peak; the rest of the backward
        meets it (`Option.reload_level`, taken in `need`)."""
        base = _base(c)
        below = self.moved_last(b - 1, p1) if b >= 1 else 0
        if base is not None and b < self.n and CHOICE_OF[base].parts:
            # Its parts are groups of their own: the group below the part in use is the block's
            # own earlier part (its reload is in the measured `backward_peak`), and block b-1's
            # reload starts only under its first part, after the larger recomputes (a CPU stack
            # of attention and MLP parts: counting it there put a split_offload last block 2 MiB
            # under what it measured, beside split blocks).
            below = 0
        elif base is not None and b < self.n and CHOICE_OF[base].mode != "none" \
                and self.p.blocks[b].reload_waits:
            # The engine reloads block b-1 once half of block b's parameter bytes have their
            # gradient, past its recompute's peak: the uniform full_offload run measured no
            # reload at that peak, so none is taken off it (`uniform_copies`) nor added here.
            # Counted, a full_offload block above a kept one came out a block input under what
            # it measured (CPU blocks stack: 94.78 predicted against 95.78 block inputs). Where
            # the engine falls back (a lone Linear, compiled regions) the reload starts with the
            # recompute, the run measured it there, and it stays counted.
            below = 0
        if not self.back_window:
            return below
        own = self.moved(b, c) if b < self.n and base is not None and CHOICE_OF[base].mode == "none" else 0
        # At most RELOAD_STORAGES storages of each ahead (the engine counts them): a kept block
        # above an offloaded one meets the two newest of its storages, not its bytes up to the
        # window (the CPU uneven stack: 8 block inputs over, 11%, where the window is a wide
        # MLP's and the block below a narrow one's).
        if below:  # of the block below, its newest storages: they come back first
            below = self.below_reload(b, p1)
        # An offload without recompute: its own storages and the block below's share the
        # engine's RELOAD_STORAGES, its own first (newest first), the block below's as its
        # own run out, at the end of its backward. Its uniform run's peak may come there
        # (the first op's backward beside two of the storages below), and its option is
        # that peak less both terms; counted with less below it (a block below that moves
        # less, or nothing), the peak it measured mid-backward, its own storages ahead,
        # came out under (the CPU uneven stack: split, keep, full_offload, split, keep,
        # offload measured 48392 bytes, 0.72%, over; its last block's backward 412416).
        # So it counts at least what its uniform run had below it: safe, not exact; `need`
        # takes the smaller of that and the bound keep's run gives. (A profile that did not
        # count the engine's storages, `reload_ahead` 0, keeps the terms it was made with.)
        if own and b >= 1 and self.p.blocks[b].reload_ahead and base in self.p.blocks[b - 1].options:
            below = max(below, self.below_reload(b, base))
        if b < self.n and self.p.blocks[b].reload_ahead:
            own = min(own, self.p.blocks[b].reload_ahead)
        return min(below + own, self.back_window)

    def below_reload(self, b: int, p1: str | None) -> int:
        """Bytes of block b-1's (choice p1) storages the engine holds reloaded ahead of their use
        once it begins reloading them during block b's backward, however late that begins: its
        last group's (`moved_last`): its newest storages, which come back first (`moved_first`,
        else at most its `reload_ahead`), within the backward window."""
        if b < 1:
            return 0
        below = self.moved_last(b - 1, p1)
        if self.back_window and below:
            first = self.opt(b - 1, p1).moved_first
            ahead = first if first >= 0 else self.p.blocks[b - 1].reload_ahead
            if ahead:
                below = min(below, ahead)
            below = min(below, self.back_window)
        return below

    def forward_peak(self, b: int, c: str) -> int:
        """Block b's own forward peak. The last offloaded block leaves only at its end, so in its
        forward it holds what its on-device twin holds (keep's activations, full's input); every
        other offloaded block's storages leave as they are saved, as its uniform run measured."""
        twin = COUNTERPART.get(_base(c) or "")
        if self.window and _last(c) and twin in self.p.blocks[b].options:
            return self.p.blocks[b].options[twin].forward_peak
        return self.opt(b, c).forward_peak

    def need(self, b: int, p2: str | None, p1: str | None, c: str) -> tuple[int, int]:
        """Bytes block b needs in its forward above S + L (what the blocks before it hold and
        left) and in its backward above S (what they left is gone by then)."""
        key = (b, p2, p1, c)
        known = self._needs.get(key)
        if known is None:
            pin = self.pin(b, c)
            forward = self.inflight(b, p2, p1, c) + self.forward_peak(b, c) + self.grads + pin
            o = self.opt(b, c)
            backward = self.reload_ahead(b, p1, c) + o.backward_peak + pin
            below = self.below_reload(b, p1) if o.reload_level >= 0 else 0
            if below:  # the reload below, begun late, meets the rest of the backward
                backward = max(backward, o.reload_level + below + pin)
            keep = self.p.blocks[b].options.get("keep")
            if b >= 1 and self.moved(b, c) and CHOICE_OF[_base(c)].mode == "none" and keep is not None \
                    and self.p.blocks[b].reload_ahead:
                # An offload without recompute holds in its backward a part of what keep holds
                # in its own (the storages used and reloaded are keep's, the rest not back yet),
                # plus the reloads of the block below and a second copy of a storage an earlier
                # block moved (`shared_in`): where its uniform run's peak came with more below
                # it than it has here, this bounds it closer (a narrow offload block above a
                # kept wide one on the uneven stack: 15.5% over without it, 1.7% with).
                backward = min(backward, self.below_reload(b, p1) + keep.backward_peak + self.shared_in[b])
            known = self._needs[key] = (forward, backward)
        return known

    def left(self, b: int, c: str) -> int:
        return self.opt(b, c).left

    def turn(self, p2: str | None, p1: str | None, left: int = 0) -> int:
        """Bytes needed above S_n at the forward/backward turn, `left` being what the blocks
        left until the forward's end: where the profile measured a turn for the last block's
        choice, that turn and the copies of block n-2 still in flight beside it
        (`turn_copies(..., own=False)`); else the largest turn with the copies. The turn is
        the larger of its part until the model's forward returns (with `left` and the previous
        step's gradients, `forward_grads`) and after."""
        base = _base(p1) if p1 is not None else None
        measured = self.p.turn_peaks.get(base) if base is not None else None
        after = self.p.after_turn_peaks.get(base, self.p.after_turn_peak) if base is not None \
            else self.p.after_turn_peak
        if measured is None:
            return self.turn_copies(p2, p1) + max(left + self.grads + self.p.turn_peak,
                                                  self.p.after_turn_peak)
        return self.turn_copies(p2, p1, own=False) + max(left + self.grads + measured, after)

    def turn_copies(self, p2: str | None, p1: str | None, own: bool = True) -> int:
        """Copies on the device at the turn: in flight, or, with the engine's window, the larger
        of those and the reloads ahead of the last block's backward (they start as the head's
        backward unpacks what it saved). `own=False`: only block n-2's copy, which the last
        block's uniform run did not have beside its own."""
        if not own:
            if self.offloads(p1):  # the last offloaded block: at most max_inflight - 1 beside it
                two = self.running(self.n - 2, p2, self.f[self.n - 1]) if self.n >= 2 else 0
                return min(two, self.largest or two) if self.m >= 2 else 0
            return self.inflight(self.n, p2, p1)
        ahead = self.reload_ahead(self.n, p1) if self.back_window else 0
        return max(self.inflight(self.n, p2, p1), ahead)

    def exposed(self, b: int, c: str, after: str | None) -> float:
        """Copy time of block b (choice c) that nothing hides, given the next block's choice."""
        if not self.offloads(c):
            return 0.0
        key = (b, c, after)
        known = self._exposed.get(key)
        if known is None:
            known = self._exposed[key] = self._exposed_time(b, c, after)
        return known

    def _exposed_time(self, b: int, c: str, after: str | None) -> float:
        n = self.n
        if b + 1 < n:
            f1 = self.f[b + 1]
            window_back = self.g[b + 1] + self.opt(b + 1, after).recompute_ms
        else:
            f1 = self.p.forward_after_ms
            window_back = self.p.backward_before_ms
        window = f1
        if b + 1 < n:
            # The next launch that waits for this copy: at the end of the next block if it
            # offloads (with max_inflight 1), else no earlier than the end of the one after.
            f2 = self.f[b + 2] if b + 2 < n else self.p.forward_after_ms
            if not self.offloads(after):
                window = f1 + f2
            elif self.m >= 2:
                window = max(f1, f1 + f2 - self.d2h(b + 1, after))
        return max(0.0, self.d2h(b, c) - window) + max(0.0, self.h2d(b, c) - window_back)

    def cost(self, b: int, c: str) -> float:
        return self.opt(b, c).extra_ms

    def as_before_last(self, c: str | None) -> str | None:
        """The choice of block b-2 as the terms read it: only an offload's copy reaches two blocks
        on, so every other choice is one state of the dynamic program (None)."""
        return c if self.offloads(c) else None

    def as_last(self, b: int, c: str) -> str | None:
        """Block b's choice as the next block's terms read it: only an offload's copy and reload
        reach the block after, so every other choice is one state (None), but the last block's,
        whose choice names the turn the profile measured. Seven choices (a block's parts) made
        the states 7 x 7 x phases, and a 12-block GPT-2 took 0.54 s to solve on an H200's host."""
        return c if b == self.n - 1 or self.offloads(c) else None

    def labelled(self, b: int, c: str, phase: int) -> list[tuple[str, int]]:
        """The labels choice c of block b may take after `phase`, each with the phase after it.
        Phases: 0 nothing offloaded yet, 1 offloaded and the last offloaded block still to come,
        2 the last offloaded block placed (no offload after it); plus `PENDING` while a block
        that moved storages later blocks save (`shared_out`) has none above it that keeps
        them in place yet (the first that does is labelled `PIN`)."""
        pending, phase = phase & PENDING, phase & ~PENDING
        if c not in OFFLOADS:
            if pending and self.shared_in[b]:
                return [(c + PIN, phase)]
            return [(c, phase | pending)]
        if phase == 2:
            return []
        if self.shared_out[b]:
            pending = PENDING
        return [(c, 1 | pending), (c if CHOICE_OF[c].parts else c + LAST, 2 | pending)]


def uniform_copies(profile: Profile, choice: str) -> tuple[list[int], list[int], int]:
    """The model's copy terms when every block takes `choice`, with max_inflight 1 (the
    profile's uniform runs): per block, the copies in flight during its forward and the reloads
    ahead of their use during its backward, and the copies at the turn. `predict` adds exactly
    these above what the blocks hold; the cost model (`actcfg.plan.cost`) takes them off what
    a uniform run measured. One model, used both ways. Needs only each option's `moved`."""
    t = _Terms(profile, 1)
    labels: list[str | None] = [None, None, *t.labels([choice] * t.n)]  # labels[b + 2]: block b's
    forward = [t.inflight(b, labels[b], labels[b + 1], labels[b + 2]) for b in range(t.n)]
    backward = [t.reload_ahead(b, labels[b + 1], labels[b + 2]) for b in range(t.n)]
    return forward, backward, t.turn_copies(labels[t.n], labels[t.n + 1])


def uniform_reloads_below(profile: Profile, choice: str) -> list[int]:
    """Per block, the bytes of the block below that every block taking `choice` (as
    `uniform_copies`) holds reloaded once the reload of that block begins during its backward
    (`_Terms.below_reload`): what a uniform run's `StepReading.below_peak` holds of it."""
    t = _Terms(profile, 1)
    labels: list[str | None] = [None, *t.labels([choice] * t.n)]  # labels[b]: block b-1's
    return [t.below_reload(b, labels[b]) for b in range(t.n)]


def predict(profile: Profile, choices: tuple[str, ...] | list[str], max_inflight: int = 1) -> tuple[float, int]:
    """(step ms, peak bytes) the model predicts for `choices` (one per block)."""
    t = _Terms(profile, max_inflight)
    if len(choices) != t.n:
        raise ValueError(f"{len(choices)} choices for {t.n} blocks")
    step = profile.plain_step_ms
    peak = 0
    held = left = 0
    p2: str | None = None
    p1: str | None = None
    for b, c in enumerate(t.labels(choices)):
        forward, backward = t.need(b, p2, p1, c)
        peak = max(peak, held + left + forward, held + backward)
        held += t.held(b, c)
        left += t.left(b, c)
        step += t.cost(b, c)
        if b >= 1:
            step += t.exposed(b - 1, p1, c)
        p2, p1 = p1, c
    if t.n:
        step += t.exposed(t.n - 1, p1, None)
    peak = max(peak, held + t.turn(p2, p1, left), t.outside)
    return step, peak + profile.accumulated_grads


def _dominant(entries: list[tuple[Any, ...]], width: int) -> list[tuple[Any, ...]]:
    """The Pareto front of entries (held, left, key...), the key being the `width` fields after
    held and left (compared as a tuple): none kept has both bytes and key no better than another
    kept one's. Sorted by held (then left, then key); of equal entries the first is kept."""
    fields = itemgetter(*range(2 + width))
    key = itemgetter(*range(2, 2 + width)) if width > 1 else itemgetter(2)
    entries.sort(key=fields)
    front: list[tuple[Any, ...]] = []
    if len({e[1] for e in entries}) <= 1:  # left the same everywhere (no autocast): a staircase
        best = None
        for e in entries:
            k = key(e)
            if best is None or k < best:
                front.append(e)
                best = k
        return front
    # With autocast, `left` varies too. Entries come sorted by held, so each is checked against
    # the kept ones as a staircase of (left, key): lefts rising, keys falling, each the best key
    # at that left or below. An entry is dominated when the step at or below its left has a key
    # no worse; else it joins the front and hides the steps above it that it beats. A scan of
    # the whole front per entry took seconds on a 12-block GPT-2 under bf16 (issue 18).
    lefts: list[int] = []
    keys: list[Any] = []
    for e in entries:
        k, lf = key(e), e[1]
        i = bisect.bisect_right(lefts, lf)
        if i and keys[i - 1] <= k:
            continue
        front.append(e)
        j = i
        while j < len(keys) and keys[j] >= k:
            j += 1
        if i and lefts[i - 1] == lf:  # same left, worse key: this entry's step replaces it
            i -= 1
        lefts[i:j], keys[i:j] = [lf], [k]
    return front


def _prune(entries: list[tuple[Any, ...]], grain: float,
           most: int = MAX_FRONT) -> list[tuple[Any, ...]]:
    """The Pareto front of (held, left, (time, bytes)); thinned to one entry per `grain` of
    held bytes when larger than `most`."""
    front = _dominant(entries, 2)
    if len(front) > most:
        thin: dict[int, tuple[Any, ...]] = {}
        for e in front:
            bucket = int((e[0] + e[1]) // grain)
            if bucket not in thin or (e[2], e[3]) < (thin[bucket][2], thin[bucket][3]):
                thin[bucket] = e
        front = sorted(thin.values(), key=lambda e: e[0])
    return front


@dataclass(frozen=True)
class _Reach:
    """What the blocks after block b need at the least, whatever they choose, as caps on an
    entry after block b (`_fastest`): an entry above a cap cannot fit some later block or the
    turn (held and left only grow, each later block adds at least its smallest option), and
    `least_ms` is the least time the later blocks add (a copy's exposed time is never negative).
    Per block, from lower bounds over every option, so the caps never drop a plan that fits."""

    held: list[int]
    """The most an entry after block b may hold."""
    held_left: list[int]
    """The most it may hold and leave together."""
    least_ms: list[float]
    """The least the blocks after b add to the step time."""

    @classmethod
    def of(cls, profile: Profile, budget: int) -> _Reach:
        n = len(profile.blocks)
        held, held_left, least_ms = [0] * n, [0] * n, [0.0] * n
        grads = profile.forward_grads  # in every forward term and the turn's with-left part
        # At the turn: S_n + what it needs (the turn with `left`, or after the forward returned).
        h = budget - min([profile.after_turn_peak, *profile.after_turn_peaks.values()])
        hl = budget - grads - min([profile.turn_peak, *profile.turn_peaks.values()])
        ms = 0.0
        for b in range(n - 1, -1, -1):
            held[b], held_left[b], least_ms[b] = h, hl, ms
            options = profile.blocks[b].options.values()
            forward = min(o.forward_peak for o in options) + grads
            backward = min(o.backward_peak for o in options)
            # block b as the next block of an entry after block b-1: its forward and backward
            # need at least its smallest peaks, and it adds at least its smallest bytes
            h = min(h - min(o.held for o in options), budget - max(forward, backward))
            hl = min(hl - min(o.held + o.left for o in options), budget - forward)
            ms += min(o.extra_ms for o in options)
        return cls(held, held_left, least_ms)


def _fastest(t: _Terms, budget: int, choices: tuple[str, ...], within: float = math.inf,
             most: int = MAX_FRONT) -> tuple[float, int, tuple[str, ...]] | None:
    """(time, bytes copied, choices) of the fastest plan within `budget` whose time is at most
    `within` (a plan known to fit: entries that cannot finish as fast are dropped), or None.
    `most`: the largest front kept (see `MAX_FRONT`); a small one gives a fast plan quickly,
    not the fastest."""
    profile = t.p
    if t.outside > budget:
        return None
    grain = max(1.0, budget / most)
    reach = _Reach.of(profile, budget)
    # Float sums in another order may differ in the last bits: a plan as fast as `within` stays.
    slow = within + 1e-9 * max(1.0, abs(within)) if within != math.inf else math.inf
    # state: (choice of block b-2, of block b-1, phase; see `_Terms.labelled`)
    # entry: (held, left, time, bytes copied, parent entry, choice)
    fronts: dict[tuple[str | None, str | None, int], list[tuple[Any, ...]]] = {
        (None, None, 0): [(0, 0, profile.plain_step_ms, 0, None, None)]}
    for b in range(t.n):
        new: dict[tuple[str | None, str | None, int], list[tuple[Any, ...]]] = {}
        cap_held, cap_held_left, later_ms = reach.held[b], reach.held_left[b], reach.least_ms[b]
        terms: dict[tuple[str | None, str | None, str], tuple[int, int, int, Option, float]] = {}
        for (p2, p1, phase), entries in fronts.items():
            for choice in choices:
                for c, after in t.labelled(b, choice, phase):
                    known = terms.get((p2, p1, c))
                    if known is None:  # the same for every phase
                        forward, backward = t.need(b, p2, p1, c)
                        known = terms[p2, p1, c] = (
                            forward, backward, budget - max(forward, backward), t.opt(b, c),
                            t.cost(b, c) + (t.exposed(b - 1, p1, c) if b >= 1 else 0.0))
                    forward, backward, room, o, dt = known
                    if room < 0:
                        continue
                    held, left, moved = t.held(b, c), o.left, o.moved
                    room = min(room, cap_held - held)
                    room_left = min(budget - forward, cap_held_left - held - left)
                    too_slow = slow - dt - later_ms
                    out = new.setdefault((t.as_before_last(p1), t.as_last(b, c), after), [])
                    for e in entries:  # sorted by held: past `room`, none fits
                        if e[0] > room:
                            break
                        if e[0] + e[1] > room_left or e[2] > too_slow:
                            continue
                        out.append((e[0] + held, e[1] + left, e[2] + dt, e[3] + moved, e, choice))
        fronts = {k: _prune(v, grain, most) for k, v in new.items() if v}
        if not fronts:
            return None
    best: tuple[Any, ...] | None = None
    for (p2, p1, phase), entries in fronts.items():
        if phase & ~PENDING == 1:  # an offloaded block was taken for not the last, and none came after
            continue
        room = budget - t.turn(p2, p1)
        tail = t.exposed(t.n - 1, p1, None) if t.n else 0.0
        for e in entries:
            if e[0] > room:
                break
            if e[0] + t.turn(p2, p1, e[1]) > budget:
                continue
            cand = (e[2] + tail, e[3], e)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return None
    picked: list[str] = []
    e = best[2]
    while e[4] is not None:
        picked.append(e[5])
        e = e[4]
    return best[0], best[1], tuple(reversed(picked))


def lowest_plan(profile: Profile, max_inflight: int = 1) -> tuple[int, tuple[str, ...]]:
    """(the smallest peak the model predicts for any choices, the choices that reach it): a
    Pareto front of held bytes and peak so far, per state of the last two choices and phase."""
    t = _Terms(profile, max_inflight)
    choices = profile.choices()
    # entry: (held so far, left so far, peak so far, choices so far)
    fronts: dict[tuple[str | None, str | None, int], list[tuple[int, int, int, tuple[str, ...]]]] = {
        (None, None, 0): [(0, 0, 0, ())]}
    for b in range(t.n):
        new: dict[tuple[str | None, str | None, int], list[tuple[int, int, int, tuple[str, ...]]]] = {}
        for (p2, p1, phase), entries in fronts.items():
            for choice in choices:
                for c, after in t.labelled(b, choice, phase):
                    (forward, backward), o = t.need(b, p2, p1, c), t.opt(b, c)
                    held = t.held(b, c)
                    new.setdefault((t.as_before_last(p1), c, after), []).extend(
                        (s + held, lf + o.left, max(pk, s + lf + forward, s + backward), cs + (choice,))
                        for s, lf, pk, cs in entries)
        fronts = {k: _dominant(v, 1) for k, v in new.items()}
    peak, picked = min(((max(pk, s + t.turn(p2, p1, lf)), cs)
                        for (p2, p1, phase), v in fronts.items() if phase & ~PENDING != 1
                        for s, lf, pk, cs in v), key=lambda e: e[0])
    return max(t.outside, peak) + profile.accumulated_grads, picked


def _accepted(peak: int) -> int:
    """The smallest budget whose share for a mix (less `MIXED_HEADROOM`, as `solve` takes it)
    holds `peak`."""
    budget = peak + int(peak * MIXED_HEADROOM)  # none below: the headroom of a budget >= peak
    while budget - int(budget * MIXED_HEADROOM) < peak:
        budget += 1
    return budget


def smallest_budget(profile: Profile, max_inflight: int = 1) -> tuple[int, tuple[str, ...]]:
    """(the smallest budget `solve` accepts, the choices that fit it): `lowest_plan`'s peak
    where every block takes one choice (a uniform run fits to the byte), else that peak with the
    headroom `solve` leaves a mix, or a uniform plan's peak if one fits below that."""
    peak, picked = lowest_plan(profile, max_inflight)
    if len(set(picked)) <= 1:
        return peak, picked
    n = len(profile.blocks)
    uniform = min(((predict(profile, (c,) * n, max_inflight)[1], (c,) * n) for c in profile.choices()),
                  key=lambda e: e[0])
    mixed = (_accepted(peak), picked)
    return uniform if uniform[0] <= mixed[0] else mixed


def smallest_peak(profile: Profile, max_inflight: int = 1) -> int:
    """The smallest budget `solve` accepts (`smallest_budget`): the smallest peak the model
    predicts for any choices (`lowest_plan`), with a mix's headroom where only a mix reaches it.
    Without it, a mix's peak as the budget was refused (the CPU chain of test_profile: 14680072,
    the peak of full, full_offload, full, full, left the mix 1468 bytes short)."""
    return smallest_budget(profile, max_inflight)[0]


def _said(blocks: tuple[str, ...], choices: tuple[str, ...]) -> str:
    """`choices` per block in few words: `split on blocks.0; full on 7 modules (blocks.1, ...)`."""
    by: dict[str, list[str]] = {}
    for name, c in zip(blocks, choices):
        by.setdefault(c, []).append(name)
    said = []
    for c, names in by.items():
        where = ", ".join(names) if len(names) <= 3 else f"{len(names)} modules ({names[0]}, ...)"
        said.append(f"{c} on {where}")
    return "; ".join(said)


def solve(profile: Profile, budget: int, *, max_inflight: tuple[int, ...] = (1, 2)) -> Plan:
    """The fastest plan whose predicted peak fits `budget` (bytes); PlanError, with the smallest
    budget it accepts (`smallest_peak`), when none does. `max_inflight` 2 is tried only where a block can
    offload; the faster wins, 1 on a tie (it holds less)."""
    started = time.perf_counter()
    choices = profile.choices()
    if not profile.blocks:
        raise PlanError("the profile has no candidate module to plan for", smallest_peak=None)
    tries = max_inflight if any(c in OFFLOADS for c in choices) else max_inflight[:1]
    found: tuple[float, int, int, tuple[str, ...]] | None = None
    mixed_budget = budget - int(budget * MIXED_HEADROOM)
    n = len(profile.blocks)
    uniforms = {(m, c): predict(profile, (c,) * n, m) for m in tries for c in choices}
    # The fastest uniform plan that fits, and then the best plan found, bound each search: a
    # plan slower than one already known is never taken (only the searches' work changes).
    within = min((step for step, peak in uniforms.values() if peak <= budget), default=math.inf)
    terms = {m: _Terms(profile, m) for m in tries}
    # the gradients a later micro-batch starts with come on top of every term
    room = mixed_budget - profile.accumulated_grads
    sketch = _fastest(terms[tries[0]], room, choices, within, SKETCH)
    if sketch is not None:
        within = min(within, sketch[0])
    for m in tries:
        got = _fastest(terms[m], room, choices, within if found is None else min(within, found[0]))
        if got is not None and (found is None or (got[0], got[1], m) < found[:3]):
            found = (got[0], got[1], m, got[2])
        for c in choices:  # a measured run fits to the byte: no headroom
            uniform = (c,) * n
            step, peak = uniforms[m, c]
            moved = sum(b.options[c].moved for b in profile.blocks)
            if peak <= budget and (found is None or (step, moved, m) < found[:3]):
                found = (step, moved, m, uniform)
    if found is None:
        lowest, reached = min((smallest_budget(profile, m) for m in tries), key=lambda e: e[0])
        names = tuple(b.name for b in profile.blocks)
        finer = "" if any(CHOICE_OF[c].parts for c in choices) \
            else " or their parts, `checkpoint.submodules`"
        raise PlanError(
            f"no plan fits memory_budget {memory_size(budget)}: the smallest peak any choice of "
            f"{', '.join(choices)} per module reaches is {memory_size(lowest)} (plain: "
            f"{memory_size(profile.plain_peak)}), with {_said(names, reached)}. Raise memory_budget "
            f"to at least {memory_size(lowest)}, or plan over more or finer modules "
            f"(`checkpoint.modules`{finer})", smallest_peak=lowest)
    _, _, m, picked = found
    step, peak = predict(profile, picked, m)
    return Plan(tuple(b.name for b in profile.blocks), picked, m, step, peak, budget,
                tuple(b.taken(c) for b, c in zip(profile.blocks, picked)),
                solve_ms=(time.perf_counter() - started) * 1000.0)
