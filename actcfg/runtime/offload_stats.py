"""What the offload engine did, counted and diagnosed away from its copy path.

The engine (actcfg.runtime.offload) calls one method here per event (a tensor packed, a storage copied
out or back, device bytes taken or given back); the counting, the per-group summary at the end
of a forward, and the sentence for a forward that offloaded nothing live here, so the engine's
code is only its schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from actcfg.units import decimal_size

__all__ = ["OffloadStats", "OffloadWarning", "no_effect_reason"]


class OffloadWarning(UserWarning):
    """The engine departed from the policy (pageable memory) or its offload had no effect."""


@dataclass
class OffloadStats:
    """What the engine did: the pool over its lifetime, the rest over the last step."""

    pinned_bytes: int = 0
    """Page-locked host memory the pool holds (never above `pin_budget`)."""
    pinned_allocations: int = 0
    """Pinned buffers ever allocated; it stops growing once the pool is warm."""
    pageable_bytes: int = 0
    """Pageable host memory the pool holds (with `pin: false`, or past `pin_budget`)."""
    pinned_fallbacks: int = 0
    """Buffers that should have been pinned but were pageable (budget reached or pinning failed)."""
    host_buffers_ahead: int = 0
    """Host buffers the pool prepared ahead of need on its background thread (pages touched, and
    pinned where pinned), off the critical path; counted in the bytes above when ordered."""
    host_buffers_on_demand: int = 0
    """Host buffers allocated on the engine's thread at the moment a copy needed them (a miss with
    nothing prepared): the pool's growth on the critical path."""
    host_wait_s: float = 0.0
    """Seconds the engine's thread spent allocating host buffers on demand or waiting for one being
    prepared, over the engine's lifetime: what growing the pool cost the steps that grew it."""
    steps: int = 0
    """Forward passes run under the engine."""
    groups: int = 0
    """Groups (blocks) the last step's forward was cut into."""
    packed_tensors: int = 0
    """Tensors autograd saved inside the last step's forward."""
    packed_bytes: int = 0
    """Their bytes (views counted at their own size)."""
    kept_bytes_by_reason: dict[str, int] | None = None
    """Bytes of saved tensors of `min_offload_bytes` or more that stayed in place in the last
    step, by reason: `parameter`, `leaf`, `buffer`, `input` (the caller's batch), `subclass`,
    `layout`, `device`, `view`, `shared` (a storage a tensor saved in place earlier in the step
    holds: moving it would free nothing)."""
    offloaded_bytes: int = 0
    """Bytes copied to the host in the last step."""
    offloaded_tensors: int = 0
    """Storages copied to the host in the last step (views of one storage travel together)."""
    kept_bytes: int = 0
    """Bytes of the groups marked for offload that stayed on the GPU at the forward/backward
    turn in the last step: the group open at the end, and the last `keep_last` ones."""
    kept_by_rule_bytes: int = 0
    """Bytes saved in the last step inside groups marked `offload=False` and in the gaps between
    groups: they stay on the device by the policy's choice."""
    group_offloaded_bytes: list[int] | None = None
    """Bytes each group of the last step moved to the host, by group index (0: the group open
    when the step began); 0 for a group that stayed on the device."""
    group_first_reload_bytes: list[int] | None = None
    """Per group, as `group_offloaded_bytes`: the bytes of its `RELOAD_STORAGES` newest storages
    moved, which backward reloads first (newest first) and holds ahead of their use while the
    group above runs its backward."""
    group_kept_bytes: list[int] | None = None
    """Bytes saved in each group of the last step that stayed on the device (kept by rule, at the
    turn, or under `min_offload_bytes` and the other rules of `stays`)."""
    reloaded_bytes: int = 0
    """Bytes copied back to the GPU in the last backward."""
    late_reloads: int = 0
    """Storages in the last backward whose reload was not prefetched (started only when needed)."""
    deferred_reloads: int = 0
    """Checkpointed groups in the last backward whose reload of the groups below waited until
    their module's backward was past its recompute's peak (half its parameters' gradients in),
    instead of starting as the recompute began."""
    deferred_groups: list[int] | None = None
    """Their indices (as in `group_offloaded_bytes`), in the order their reloads started: the
    planner reads from them which blocks' recomputes the reload below waits past."""
    missed_deferrals: int = 0
    """Checkpointed groups in the last backward whose module's gradients came too late to help:
    after the group below was needed (shared or replaced parameters, torch.autograd.grad), or
    only as the module's backward ended (less than a quarter of its parameter bytes still to
    come, as in a lone Linear). The module's later backwards reload at once, as without the
    signal."""
    kept_views: int = 0
    """Saved views of a storage over 4x their size, left on the GPU in the last step."""
    copy_waits: int = 0
    """Times the compute stream waited for a copy to the host in the last step (its window of
    copies in flight was full, or at the turn): copy time compute did not hide."""
    most_inflight: int = 0
    """Most copies to the host in flight at once in the last step: storages, within
    `max_inflight` windows of bytes (a whole group is one copy only where it leaves at once: the
    last offloaded group, under `keep_last` 0)."""
    device_bytes: int = 0
    """Bytes of offloadable storages the engine holds on the device now: those of groups marked
    for offload not yet released after their copy (the open group, copies in flight, groups kept
    at the turn) and the reloads backward has not finished with. Saved tensors that stay by
    rule are not the engine's and are not counted."""
    most_device_bytes: int = 0
    """High-water mark of `device_bytes` over the last step, forward and backward."""
    most_forward_device_bytes: int = 0
    """High-water mark of `device_bytes` in the last step's forward (to the turn)."""
    most_backward_device_bytes: int = 0
    """High-water mark of `device_bytes` from the last step's turn on: what backward held at
    once (for checkpointed blocks, their inputs: the group in use and the one being prefetched)."""
    most_recompute_device_bytes: int = 0
    """High-water mark of `device_bytes` as the last backward's checkpointed groups began their
    recompute, after the reloads each started then: what the engine held as the recompute began
    (for checkpointed blocks, the input being recomputed and the groups kept at the turn above
    it; the block below comes back on the block's gradient signal, past the recompute's peak,
    unless that signal came before the peak: then this reading understates)."""

    def as_dict(self) -> dict[str, Any]:
        """The counters as JSON-able data."""
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in vars(self).items() if not k.startswith("_")}

    def __post_init__(self) -> None:
        self._backward = False  # past the turn: device bytes count toward backward's mark

    # --- events, one call each from the engine ------------------------------------------------

    def begin_step(self) -> None:
        """A forward opens: the per-step counters start from zero (device bytes still held, from
        a step whose backward never ran, stay counted)."""
        self.steps += 1
        self.offloaded_bytes = self.offloaded_tensors = self.kept_bytes = self.kept_by_rule_bytes = 0
        self.reloaded_bytes = self.late_reloads = self.kept_views = self.copy_waits = 0
        self.deferred_reloads = self.missed_deferrals = self.most_recompute_device_bytes = 0
        self.most_inflight = self.packed_tensors = self.packed_bytes = self.groups = 0
        self.kept_bytes_by_reason = {}
        self.group_offloaded_bytes, self.group_kept_bytes, self.deferred_groups = [], [], []
        self.group_first_reload_bytes = []
        self.most_device_bytes = self.most_forward_device_bytes = self.device_bytes
        self.most_backward_device_bytes = 0
        self._backward = False

    def packed(self, nbytes: int) -> None:
        self.packed_tensors += 1
        self.packed_bytes += nbytes

    def kept_by_rule(self, nbytes: int) -> None:
        self.kept_by_rule_bytes += nbytes

    def kept_for(self, reason: str, nbytes: int) -> None:
        """A saved tensor of offloadable size stayed in place (`stays`'s reason, or `view`)."""
        reasons = self.kept_bytes_by_reason if self.kept_bytes_by_reason is not None else {}
        reasons[reason] = reasons.get(reason, 0) + nbytes
        self.kept_bytes_by_reason = reasons
        if reason == "view":
            self.kept_views += 1

    def copied_out(self, nbytes: int) -> None:
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1

    def copied_back(self, nbytes: int) -> None:
        self.reloaded_bytes += nbytes

    def in_flight(self, count: int) -> None:
        self.most_inflight = max(self.most_inflight, count)

    def hold(self, nbytes: int) -> None:
        """The engine now holds `nbytes` more on the device."""
        self.device_bytes += nbytes
        self.most_device_bytes = max(self.most_device_bytes, self.device_bytes)
        if self._backward:
            self.most_backward_device_bytes = max(self.most_backward_device_bytes, self.device_bytes)
        else:
            self.most_forward_device_bytes = max(self.most_forward_device_bytes, self.device_bytes)

    def recompute_began(self) -> None:
        """A checkpointed group's recompute begins, its reloads started."""
        self.most_recompute_device_bytes = max(self.most_recompute_device_bytes, self.device_bytes)

    def reload_deferred(self, group: int) -> None:
        """Group `group`'s reload of the groups below waited past its recompute's peak."""
        self.deferred_reloads += 1
        if self.deferred_groups is None:
            self.deferred_groups = []
        self.deferred_groups.append(group)

    def release(self, nbytes: int) -> None:
        """The engine gave `nbytes` of device memory back."""
        self.device_bytes -= nbytes

    def end_step(self, groups: Iterable[tuple[int, int, int, int] | None]) -> None:
        """The turn: per group (None for one already dead) its bytes moved, its bytes that stayed,
        of those the bytes marked for offload that stayed for backward, and the bytes of the
        moved storages backward reloads first. Backward's high-water mark starts here."""
        for group in groups:
            moved, stayed, kept_at_turn, first = group if group is not None else (0, 0, 0, 0)
            self.group_offloaded_bytes.append(moved)
            self.group_first_reload_bytes.append(first)
            self.group_kept_bytes.append(stayed)
            self.groups += 1
            self.kept_bytes += kept_at_turn
        self._backward = True
        self.most_backward_device_bytes = self.device_bytes


def no_effect_reason(st: OffloadStats, min_offload_bytes: int) -> str | None:
    """Why a training forward offloaded nothing, as a sentence; None if it offloaded bytes."""
    if st.offloaded_bytes:
        return None
    if st.packed_tensors == 0:
        return ("no saved activation reached the offload hooks: autograd saved nothing inside "
                "the scope (a compiled region that bypassed the hooks, frozen weights with "
                "an input that needs no grad, or a forward outside the model)")
    if st.kept_bytes >= min_offload_bytes and st.groups <= 1:
        return (f"all {decimal_size(st.kept_bytes)} of offloadable activations fell into one group, the "
                "last, which stays on the GPU for backward: no block boundary was seen during "
                "the forward (are the checkpointed or grouped modules ever called?)")
    if st.kept_bytes >= min_offload_bytes:
        return (f"the only offloadable activations ({decimal_size(st.kept_bytes)}) were saved in the last "
                "group, which stays on the GPU for backward")
    if st.kept_by_rule_bytes and st.kept_by_rule_bytes >= st.packed_bytes - st.kept_bytes:
        return (f"{decimal_size(st.kept_by_rule_bytes)} of saved activations stayed in groups the policy "
                "keeps on the device, and the groups marked for offload saved nothing to move "
                "(are the modules whose rule offloads ever called?)")
    if st.kept_bytes_by_reason:
        reasons = ", ".join(f"{decimal_size(n)} as {r}" for r, n in sorted(st.kept_bytes_by_reason.items()))
        return f"every large saved tensor stays in place by rule ({reasons})"
    return (f"every saved tensor was under min_offload_bytes ({decimal_size(min_offload_bytes)}): "
            f"{st.packed_tensors} tensors, {decimal_size(st.packed_bytes)} in all")
