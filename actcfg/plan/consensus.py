"""One plan for every rank: the ranks' profiles reduced to one, and the plan checked to be the same.

Under torchrun each rank profiles its own step. Timing noise alone can make two ranks choose
differently, and then they hold different memory, a budget holds on one rank and not on the
next, and ranks that wait on each other (data, tensor and pipeline parallel all do) wait on the
slower plan. So before solving, the ranks exchange their profiles (plain data, `Profile.to_json`)
and every rank reduces the same list, in rank order, to the worst case of each figure:

* what a choice costs in time (each choice's recompute and extra, the plain step, each uniform
  run): the slowest rank's, since the ranks of a step finish together when the slowest does;
* the compute a copy hides behind (each block's forward and backward, the compute after and
  before the blocks): the shortest. The solver reads these only as windows: a copy longer than
  the next block's forward is still in flight, holding its memory, when the block after starts,
  and what a window does not cover is exposed time. A fast rank's copies outlast its own short
  forwards, so the longest window would promise it memory it does not have; the shortest is the
  worst case for both memory and time;
* bytes (what each choice holds and moves, every peak): the largest, so the budget holds on the
  rank that needs most;
* copy bandwidth: the lowest; and, where several ranks share a host, measured with all of them
  copying at once (`copy_together`: a barrier before each timed copy), since that is how they
  copy in training: they share the host's memory bandwidth and the PCIe switches
  (docs/multi-gpu-node.md);
* choices: those every rank could profile (one that ran out of memory on one rank is no choice).

The solver is a pure function of its input, so every rank solving the same reduced profile gets
the same plan; `agree` still compares the written plans across ranks and raises if any differ
(an unequal `memory_budget`, say), rather than let ranks train under different policies.

Without an initialised process group of more than one rank, every function here is the
identity: one process plans alone as before. torch is imported only when a group is up. With
one, planning is a collective: every rank of the group plans (as a training script that calls
`actcfg.apply` on each rank does). The ranks agree on success (`settle`) before the profile,
after it, and, for a sharded model, at each profiled forward's start and step's loss
(`actcfg.plan.sharded`): a rank that cannot plan makes
every rank raise its sentence instead of leaving the others waiting. A rank that plans alone
(never calls `apply`) still leaves the others waiting until the group's timeout.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actcfg.errors import PlanError
from actcfg.plan.model import CHOICES, BlockProfile, Option, Profile

__all__ = ["Together", "agree", "copy_together", "group_of_ranks", "one_profile", "reduce_profiles",
           "settle", "slowest_rank"]

COPY_BYTES = 1 << 29
"""Bytes of each timed copy in `copy_together`: 512 MiB, ~10 ms at an H200's ~55 GB/s, long
against the skew a barrier leaves between ranks (well under a millisecond)."""


def group_of_ranks(group: Any = None) -> Any:
    """The process group the ranks plan together in (`group`, or the default one), or None
    when there is none or it has one rank."""
    import sys

    if "torch" not in sys.modules:  # no torch loaded, so certainly no group: stay light
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


# --- the reduction: pure -----------------------------------------------------------------------


def _worst_option(options: Sequence[Option]) -> Option:
    # `moved_last` -1 means all of `moved` (not measured): read as that before the largest,
    # or a rank's -1 would lose to another's smaller measured share
    if any(o.moved_last >= 0 for o in options):
        options = [dataclasses.replace(o, moved_last=o.moved) if o.moved_last < 0 else o for o in options]
    worst = Option(**{f.name: max(getattr(o, f.name) for o in options)
                      for f in dataclasses.fields(Option)})
    # `reload_level` -1 is not measured (no term): the max keeps a rank's measured level.
    # `moved_first` -1 is not measured, bounded by the block's larger `reload_ahead`: a rank's -1
    # stays -1, not another's smaller measured bytes
    if any(o.moved_first < 0 for o in options):
        worst = dataclasses.replace(worst, moved_first=-1)
    return worst


def reduce_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile from the ranks' (in rank order): the slowest cost, the shortest window, the
    largest bytes and the lowest bandwidth of each figure, the choices every rank has (see the
    module docstring). PlanError when the ranks profiled different candidate blocks."""
    first = profiles[0]
    names = [b.name for b in first.blocks]
    for rank, p in enumerate(profiles):
        theirs = [b.name for b in p.blocks]
        if theirs != names or p.device != first.device:
            raise PlanError(
                f"rank {rank} profiled {len(theirs)} candidate modules on {p.device} "
                f"({', '.join(theirs[:4])}{', ...' if len(theirs) > 4 else ''}) and rank 0 "
                f"{len(names)} on {first.device} ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}): one plan for all ranks needs the same "
                "blocks on each. Plan each pipeline stage within its own group (pass `group=`), "
                "or give every rank the same model")
    if len(profiles) == 1:
        return first
    blocks = []
    for b, name in enumerate(names):
        mine = [p.blocks[b] for p in profiles]
        common = [c for c in CHOICES if all(c in m.options for m in mine)]
        blocks.append(BlockProfile(
            name,
            min(m.forward_ms for m in mine),
            min(m.backward_ms for m in mine),
            {c: _worst_option([m.options[c] for m in mine]) for c in common},
            mine[0].parts,
            # where every rank's engine waited: a rank that fell back had the reload taken off
            # its options, which the reload term counts back (a rank that waited: high, not low)
            all(m.reload_waits for m in mine),
            # the most any rank reloads ahead; unknown (0: the window alone) if any rank's is
            0 if not all(m.reload_ahead for m in mine) else max(m.reload_ahead for m in mine),
            # a storage shared on any rank is counted where it could stay (high, not low)
            max(m.shared_in for m in mine),
            max(m.shared_out for m in mine),
        ))
    measured = {
        c: {k: max(p.measured[c][k] for p in profiles) for k in first.measured[c]}
        for c in first.measured if all(c in p.measured for p in profiles)
    }
    notes = list(dict.fromkeys(n for p in profiles for n in p.notes))
    slowest = max(range(len(profiles)), key=lambda r: profiles[r].plain_step_ms)
    notes.append(f"reduced over {len(profiles)} ranks: the slowest cost, the shortest copy window, "
                 f"the largest bytes and the lowest copy bandwidth of each figure (the slowest "
                 f"plain step: rank {slowest})")
    return Profile(
        blocks=tuple(blocks),
        plain_step_ms=max(p.plain_step_ms for p in profiles),
        plain_peak=max(p.plain_peak for p in profiles),
        turn_peak=max(p.turn_peak for p in profiles),
        turn_peaks={c: max(p.turn_peaks[c] for p in profiles) for c in first.turn_peaks
                    if all(c in p.turn_peaks for p in profiles)},
        after_turn_peak=max(p.after_turn_peak for p in profiles),
        after_turn_peaks={c: max(p.after_turn_peaks[c] for p in profiles) for c in first.after_turn_peaks
                          if all(c in p.after_turn_peaks for p in profiles)},
        largest_storage=max(p.largest_storage for p in profiles),
        window_storages=max(p.window_storages for p in profiles),
        forward_after_ms=min(p.forward_after_ms for p in profiles),
        backward_before_ms=min(p.backward_before_ms for p in profiles),
        outside_peak=max(p.outside_peak for p in profiles),
        head_peak=max(p.head_peak for p in profiles),
        accumulated_grads=max(p.accumulated_grads for p in profiles),
        forward_grads=max(p.forward_grads for p in profiles),
        d2h_gbps=min(p.d2h_gbps for p in profiles),
        h2d_gbps=min(p.h2d_gbps for p in profiles),
        device=first.device,
        measured=measured,
        notes=tuple(notes),
    )


# --- across ranks ---------------------------------------------------------------------------------


def _gather(value: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


@dataclass(frozen=True)
class Together:
    """Copy bandwidth measured with every rank of the group copying at once."""

    d2h_gbps: float
    """To the host, GB/s: the lowest rank's median."""
    h2d_gbps: float
    """Back to the device, GB/s: the lowest rank's median."""
    ranks: int
    """Ranks that copied at once."""
    device: str
    """`cuda`: pinned host buffers and the GPU; `cpu`: one host buffer into another (the host
    loopback, which contends for the same memory bandwidth)."""
    arrived: float
    """This rank's wall clock (time.time) when it reached the first barrier."""
    started: float
    """This rank's wall clock when its first timed copy began (after that barrier)."""


def copy_together(group: Any = None, nbytes: int = COPY_BYTES, repeats: int = 3) -> Together | None:
    """Every rank of `group` times `repeats` copies each way after one warm-up, each copy begun
    on a barrier, so that they all copy at once as they do in training. On CUDA a pinned host
    buffer and the current GPU, as the offload engine copies; else one host buffer into
    another. None without a group, or when a rank could not pin its buffer."""
    group = group_of_ranks(group)
    if group is None:
        return None
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        # Pinned as the offload engine pins: registered at its exact size and unregistered after.
        # (pin_memory=True would leave the buffer in torch's pinned cache, locked, after the
        # measurement, outside every budget.)
        host = torch.empty(nbytes, dtype=torch.uint8)
        pinned = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0
    else:
        device_buffer = torch.ones(nbytes, dtype=torch.uint8)
        host = torch.empty(nbytes, dtype=torch.uint8)
        pinned = True
    # Every rank learns whether every rank could pin before any waits on a barrier: one that
    # could not must not leave the others waiting, nor time a pageable copy as a pinned one.
    if not all(_gather(pinned, group)):
        if cuda and pinned:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        return None
    arrived = started = 0.0
    figures = []
    for dst, src in ((host, device_buffer), (device_buffer, host)):
        times = []
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            if not arrived:
                arrived = time.time()
            dist.barrier(group)
            if not started:
                started = time.time()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                ms = (time.perf_counter() - t0) * 1e3
            if i:  # the first is a warm-up
                times.append(ms)
        figures.append(nbytes / (statistics.median(times) * 1e6))
    if cuda:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    del device_buffer, host
    everyone = _gather(figures, group)
    return Together(d2h_gbps=min(f[0] for f in everyone), h2d_gbps=min(f[1] for f in everyone),
                    ranks=len(everyone), device="cuda" if cuda else "cpu", arrived=arrived,
                    started=started)


def one_profile(profile: Profile, group: Any = None, *, contended: bool = True,
                copy_bytes: int = COPY_BYTES) -> Profile:
    """The profile every rank of `group` plans from: the ranks' profiles reduced
    (`reduce_profiles`); where it has a copy bandwidth and several ranks share this host, the
    lower of that and the bandwidth with all ranks copying at once (`copy_together`). The
    identity without a group."""
    from actcfg.runtime.host_budget import local_ranks

    group = group_of_ranks(group)
    if group is None:
        return profile
    reduced = reduce_profiles([Profile.from_json(p) for p in _gather(profile.to_json(), group)])
    # Every rank takes the same branch: the reduced profile and the environment are the same.
    measure = contended and reduced.d2h_gbps > 0 and local_ranks()[1] > 1
    together = copy_together(group, copy_bytes) if measure else None
    if together is not None:
        d2h, h2d = min(reduced.d2h_gbps, together.d2h_gbps), min(reduced.h2d_gbps, together.h2d_gbps)
        note = (f"copy bandwidth with {together.ranks} ranks copying at once: to the host "
                f"{together.d2h_gbps:.1f} GB/s, back {together.h2d_gbps:.1f} GB/s (alone "
                f"{reduced.d2h_gbps:.1f} and {reduced.h2d_gbps:.1f}); the plan uses the lower")
        reduced = dataclasses.replace(reduced, d2h_gbps=d2h, h2d_gbps=h2d,
                                      notes=(*reduced.notes, note))
    elif measure:
        reduced = dataclasses.replace(reduced, notes=(
            *reduced.notes, "copy bandwidth with every rank copying at once: not measured (a rank "
            "could not pin its buffer); the plan uses the bandwidth alone"))
    return reduced


def agree(text: str, group: Any = None) -> None:
    """Raise PlanError unless every rank of `group` wrote the same plan `text`."""
    group = group_of_ranks(group)
    if group is None:
        return
    texts = _gather(text, group)
    differ = [r for r, t in enumerate(texts) if t != texts[0]]
    if differ:
        raise PlanError(
            f"the ranks planned differently (rank {differ[0]}'s plan is not rank 0's), although "
            "they planned from one reduced profile: their policies differ (each rank must load "
            "the same policy file, with the same memory_budget)")


def settle(error: BaseException | None, group: Any = None, *, where: str = "") -> None:
    """Every rank of `group` learns whether every rank got here without an error (a collective:
    each calls it at the same point). PlanError on every rank, naming the lowest rank that
    failed and its message, when any did; `where` says at which point. The failing rank's own
    error is raised from. Nothing without a group, except re-raising `error`."""
    group = group_of_ranks(group)
    if group is None:
        if error is not None:
            raise error
        return
    said = None if error is None else (str(error) or type(error).__name__)
    everyone = _gather(said, group)
    failed = [r for r, s in enumerate(everyone) if s is not None]
    if not failed:
        return
    first = failed[0]
    also = f" (and on rank{'s' if len(failed) > 2 else ''} {', '.join(map(str, failed[1:]))})" \
        if len(failed) > 1 else ""
    raise PlanError(
        f"planning failed on rank {first} of {len(everyone)}{also}{where}: {everyone[first]}; "
        "every rank stops here, since the ranks apply one plan made from all their profiles"
    ) from error


def slowest_rank(step_ms: float, peak: int, group: Any = None) -> tuple[float, int]:
    """(slowest step, largest peak) over the ranks of `group`: what a plan is judged by."""
    group = group_of_ranks(group)
    if group is None:
        return step_ms, peak
    everyone = _gather((step_ms, peak), group)
    return max(s for s, _ in everyone), max(p for _, p in everyone)
