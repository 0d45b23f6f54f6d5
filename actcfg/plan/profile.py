"""Profile one training step per candidate block under each choice, on the real model.

For each choice (keep, selective, split into parts, full, full + offload, split + offload,
offload) the candidates get that choice uniformly, through `actcfg.apply` with a
`checkpoint.mode: rules` policy (removed after), and a few steps run under a probe: forward
and backward hooks on each candidate record CUDA events and `torch.cuda` memory statistics at its boundaries (its forward;
its backward, from the gradient of its output to the gradient of its input; the turn between the
last forward and the first backward). What each block keeps is counted with saved-tensor hooks (storages saved inside
its forward; for selective, also the outputs of its saved ops) and, for offload choices, with the
offload engine's own per-group counts. Copy bandwidth each way is measured pinned. Everything
is put back after: gradients, buffers, training mode and RNG state. Under DeepSpeed's ZeRO
each step's backward takes the gradients with `torch.autograd.grad`, out of reach of ZeRO's
hooks, and stands in for the buffers those hooks allocate (ZeRO-1/2), or follows what they hold
gradient by gradient (ZeRO-3) (`actcfg.plan.sharded.deepspeed_backward`).

The jobs live apart: the probe (`actcfg.plan.probe`), the byte counts (`actcfg.plan.saved`), and
the cost model that turns both into a `Profile` (`actcfg.plan.cost`); this module runs them.

With a policy's `compile:` every run (keep included) is applied compiled, as the plan will run:
the byte counts are then the compiled graphs' saved tensors, and each run is warmed up until its
graphs are built; the time that takes is reported apart (`Profile.compile_ms`), and a profile in
which dynamo built no graph is refused.

What the profile costs is said part by part (`Profile.parts_ms`): the counting forwards, each
run, the runs' first steps, the host pool, the copy bandwidth. The offload runs share one host
pool (`actcfg.runtime.offload_pool.shared_host_pool`), whose buffers are made on its thread
from the keep count's sizes while the runs before them compute, and unpinned at the end.

On the CPU (tests, or `apply` of a CPU model) the same runs happen, timed with wall-clock hooks;
memory is the bytes of live tensor storages (`actcfg.plan.probe.LiveBytes`), offload choices on
the host loopback included (their "host" copies go into the engine's pool buffers, made on the
pool's thread or in the warm-up step, which the meter does not count); compiled runs are estimated from the counted
bytes (see `Profile.notes`). Offload choices are profiled only where offloading runs (CUDA, or
the host loopback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from actcfg.runtime.torch_applier import resolve_ops
from actcfg.runtime.wrap import select_modules
from actcfg.errors import ActcfgError, PlanError
from actcfg.runtime.offload import (MIN_OFFLOAD_BYTES, RELOAD_STORAGES, WINDOW_STORAGES, OffloadWarning,
                                    loopback_enabled)
from actcfg.runtime.offload_pool import HostPool, shared_host_pool
from actcfg.plan.cost import Run, assemble
from actcfg.plan.parts import find_parts, input_storages
from actcfg.plan.model import CHOICE_OF, CHOICES, OFFLOADS, Profile
from actcfg.plan.probe import Backward, Meter, Probe, copy_bandwidth
from actcfg.plan.sharded import deepspeed_backward
from actcfg.plan.saved import saved_bytes
from actcfg.plan.trial import Apply
from actcfg.policy.schema import DEFAULT_SAVE_OPS, Compile, Policy, RulesCheckpoint
from actcfg.plan.write import exact_pattern
from actcfg.runtime.step import default_loss, split_inputs

__all__ = ["copy_bandwidth", "measure_steps", "profile", "saved_bytes"]


def _split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`verify`'s reading of example inputs (the same contract), refused as a PlanError."""
    try:
        return split_inputs(inputs)
    except ActcfgError as e:
        raise PlanError(str(e)) from e


# --- the profile --------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The profiling runs' own log lines and offload warnings are about the runs, not about the
    user's policy: one line for the plan is logged after (`PlanReport.summary`)."""
    logger = logging.getLogger("actcfg")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Gradients, buffers, training mode and RNG state as they were, whatever happens inside."""
    training = {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            for p in grads:
                p.grad = None
            yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, flag in training.items():
            m.training = flag


def _uniform(names: Sequence[str], choice: str, pin: bool, pin_budget: int | None,
             compile: Compile | None = None) -> Policy:
    # Names as exact patterns: a ModuleDict key `r[!a]` as a pattern matches `rb`, not itself.
    # With `compile`, the trial is compiled as the plan will be (keep too: a `mode: none` rule).
    chosen = CHOICE_OF[choice]
    rule = chosen.rule(tuple(exact_pattern(n) for n in names))
    if not chosen.offload:
        return Policy(version=1, checkpoint=RulesCheckpoint(mode="rules", rules=(rule,)),
                      compile=compile)
    return Policy(version=1, checkpoint=RulesCheckpoint(mode="rules", rules=(rule,), keep_last=0,
                                                        max_inflight=1),
                  pin=pin, pin_budget=pin_budget, compile=compile)


def _graphs_built() -> int:
    """How many graphs dynamo has built in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_events() -> tuple[int, int]:
    """What torch.compile has done so far in this process: the graphs dynamo built, and the
    phases it timed (`dynamo_timed`: tracing, AOTAutograd, a backward compiled lazily at its
    first call, which builds no new graph, inductor's autotuning at a kernel's first launch).
    A step that changes neither compiled nothing: it ran what was built."""
    from torch._dynamo.utils import compilation_time_metrics

    return _graphs_built(), sum(len(v) for v in compilation_time_metrics.values())


STEADY_MOST = 8
"""At most this many calls of a compiled run until one compiles nothing (dynamo's own
recompile limit is 8 per frame); the last is then taken as steady all the same."""


def _steady(step: Callable[[], Any], spent: list[float], warmed: _Warmed | None = None) -> tuple[Any, float]:
    """Call `step` until a call compiles nothing (`_compile_events`), and return that call's
    result and wall ms: the compiled run's steady state, ready to be read. Each call before it
    compiled; of its wall time, what it took beyond the steady call is compile time (added to
    `spent`), and the steady call's time is a step's, the planning's (in `warmed`, when given,
    as a warm-up). A step after the last one that compiled runs the same graphs, so it needs no
    comparison with the one before: where `warm_up` ran at least two steps to see the time stop
    falling, one compiling step and the steady one read are two, where they were three."""
    walls: list[float] = []
    while True:
        before = _compile_events()
        start = time.perf_counter()
        out = step()
        wall = (time.perf_counter() - start) * 1000.0
        # Open: a run whose graphs were all cached compiles nothing in its first step, which is
        # then the one read though it is the policy's first (on the H200, full_offload after
        # full: 3 warm-ups for 4 runs); the eager runs warm up every policy once.
        if _compile_events() == before or len(walls) + 1 >= STEADY_MOST:
            break
        walls.append(wall)
    steady = min([wall, *walls])
    compiling = sum(w - steady for w in walls)
    spent.append(compiling)
    if warmed is not None:
        warmed.wall_ms += sum(walls)
        warmed.compile_ms += compiling
        warmed.calls += len(walls)
    return out, wall


@dataclasses.dataclass
class _Warmed:
    """A uniform run's warm-up steps: their wall time, and what of it was compiling and growing
    the host pool (reported as parts of their own). `steady_ms`: a step inside the warm-up's
    span that is read, not warm-up (compiled, the first steady probed step: `_steady`)."""

    wall_ms: float = 0.0
    compile_ms: float = 0.0
    pool_ms: float = 0.0
    steady_ms: float = 0.0
    calls: int = 0
    """Model calls (steps) of the warm-up, the steady one read left out."""
    counter: Callable[[], int] = lambda: 0
    """The model calls so far (`_Timing.calls`)."""

    @property
    def rest_ms(self) -> float:
        return max(0.0, self.wall_ms - self.compile_ms - self.pool_ms)


@contextlib.contextmanager
def _warming(warmed: _Warmed | None, spent: list[float], handle: Any) -> Iterator[_Warmed]:
    """Fills `warmed` with the wall time inside (which ends in a step's own synchronize), less
    the `steady_ms` set inside."""
    if warmed is None:
        yield _Warmed()
        return
    engine = getattr(handle, "engine", None)
    waited = engine.stats.host_wait_s if engine is not None else 0.0
    compiled = sum(spent)
    calls = warmed.counter()
    start = time.perf_counter()
    try:
        yield warmed
    finally:
        warmed.wall_ms = (time.perf_counter() - start) * 1000.0 - warmed.steady_ms
        warmed.calls = warmed.counter() - calls - (1 if warmed.steady_ms else 0)
        warmed.compile_ms = sum(spent) - compiled
        warmed.pool_ms = (engine.stats.host_wait_s - waited) * 1000.0 if engine is not None else 0.0


class _Timing:
    """The profile's wall time by part (ms), its compiles left out (see `Profile.parts_ms`), and
    the model calls each part made (`Profile.parts_steps`, counted by `counting`).

    Timed with `time.perf_counter` around parts that end in a synchronize of their own (a step's
    end, a copy measurement, the pool's close): no part adds one. Growing the host pool happens
    inside the offload runs' first steps; the pool's own clock (`OffloadStats.host_wait_s`, the
    time its engine's thread waited for buffers) takes it out of them."""

    def __init__(self, spent: list[float]) -> None:
        self.ms: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.calls = 0
        self._spent = spent

    @contextlib.contextmanager
    def counting(self, model: nn.Module) -> Iterator[None]:
        """Count the model's calls (each a training step's forward, or a counting forward)."""
        def called(module: nn.Module, args: Any) -> None:
            self.calls += 1
        hook = model.register_forward_pre_hook(called)
        try:
            yield
        finally:
            hook.remove()

    def add(self, name: str, ms: float, calls: int = 0) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms
        if calls:
            self.steps[name] = self.steps.get(name, 0) + calls

    def begin(self) -> tuple[float, float, int]:
        """A mark for `end` (for a part that spans several statements)."""
        return time.perf_counter(), sum(self._spent), self.calls

    def end(self, name: str, mark: tuple[float, float, int]) -> None:
        """Add the wall time since `mark` to `name`, less what was compiled meanwhile."""
        start, compiled, calls = mark
        self.add(name, (time.perf_counter() - start) * 1000.0 - (sum(self._spent) - compiled),
                 self.calls - calls)

    @contextlib.contextmanager
    def timed(self, name: str, pool: HostPool | None = None) -> Iterator[None]:
        compiled = sum(self._spent)
        waited = pool.stats.host_wait_s if pool is not None else 0.0
        calls = self.calls
        start = time.perf_counter()
        try:
            yield
        finally:
            wall = (time.perf_counter() - start) * 1000.0
            grown = (pool.stats.host_wait_s - waited) * 1000.0 if pool is not None else 0.0
            if grown:
                self.add("host_pool", grown)
            self.add(name, wall - (sum(self._spent) - compiled) - grown, self.calls - calls)

    def warmed(self, name: str, warmed: _Warmed) -> None:
        """Move a run's warm-up steps (less their compiling and pool growth) to `warm_ups`."""
        self.ms[name] = self.ms.get(name, 0.0) - warmed.rest_ms
        self.add("warm_ups", warmed.rest_ms)
        if warmed.calls:
            self.steps[name] = self.steps.get(name, 0) - warmed.calls
            self.steps["warm_ups"] = self.steps.get("warm_ups", 0) + warmed.calls

    def result(self, total_ms: float, compile_ms: float) -> dict[str, float]:
        """The parts in the report's order, with `rest` what none of them timed."""
        order = ["counts", *CHOICES, "warm_ups", "host_pool", "copy_bandwidth"]
        out = {k: max(0.0, self.ms[k]) for k in order if k in self.ms}
        out["rest"] = max(0.0, total_ms - compile_ms - sum(out.values()))
        return out

    def move_calls(self, source: str, to: str, calls: int) -> None:
        """`calls` model calls made inside `source`'s span that are `to`'s."""
        if calls:
            self.steps[source] = self.steps.get(source, 0) - calls
            self.steps[to] = self.steps.get(to, 0) + calls

    def step_counts(self) -> dict[str, int]:
        """The model calls by part, in `result`'s order."""
        order = ["counts", *CHOICES, "warm_ups"]
        return {k: self.steps[k] for k in order if self.steps.get(k)}


@contextlib.contextmanager
def _compiling(spent: list[float], compiled: bool) -> Iterator[None]:
    """Adds the wall time inside to `spent` when the model is compiled: a run's first call
    compiles its graphs (the counting forwards', the warm-up steps')."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if compiled:
            spent.append((time.perf_counter() - start) * 1000.0)


SETTLED = 0.02
"""Probed steps within this fraction of each other have settled: one unprobed step scales them."""

PROBE_CHEAP = 0.02
"""On CUDA, where keep's probed step is within this fraction of its unprobed one, the probe's
cost is negligible: the runs after keep take keep's scale instead of an unprobed step each."""


def _run(model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str], choice: str,
         args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor],
         apply: Apply, meter: Meter, steps: int, pin: bool,
         pin_budget: int | None, taken: Sequence[str], compile: Compile | None = None,
         spent: list[float] | None = None, warmed: _Warmed | None = None,
         outputs_held: bool = True, strict: bool = False, backward: Backward = Backward(),
         before: Callable[[], None] | None = None, probe_scale: float | None = None,
         scales: dict[str, float] | None = None) -> Run:
    # `taken`: the modules the choice's rule names (the blocks, or their parts for `split` and
    # `split_offload`); the probe and the byte counts stay on the blocks either way. Keep too
    # runs as applied (a `mode: none` rule), as the plan will: applying any policy turns a
    # Hugging Face model's `use_cache` off (`prepare_hf_model`), and a bare keep run built a KV
    # cache no plan builds (a tiny GPT-2: every keep term two block-sized tensors per layer
    # over its plan's step). `before`: called under the policy before its steps (the counting
    # forward of a compiled profile). `probe_scale`: what scales the probed times, given
    # (keep's, where the probe costs next to nothing: `PROBE_CHEAP`), so no unprobed step is
    # run; else the scale the unprobed step measured goes to `scales[choice]`.
    handle = apply(model, _uniform(taken, choice, pin, pin_budget, compile))
    probe: Probe | None = None
    spent = [] if spent is None else spent
    compiled = compile is not None
    try:
        if before is not None:
            before()
        probe = Probe(modules, meter, backward)
        if handle.engine is not None:
            # Where each block's backward begins reloading the blocks below: the probe reads the
            # rest of that backward too (`StepReading.below_peak`).
            block_of = {n: b for b, n in enumerate(names)}

            def reloads_below(index: int, below: int, probe: Probe = probe) -> None:
                groups = handle.offload_group_names
                b = _block_of(groups.get(index, ""), block_of)
                # not a block's later part reloading its own earlier part (split_offload's)
                if b is not None and _block_of(groups.get(below, ""), block_of) != b:
                    probe.reload_began(b)
            handle.engine.reloads_below = reloads_below
        # warm-up: pinned pools, allocator, kernels. Every run, the on-device ones after keep
        # too: without it, one probed step per choice was that policy's first step, and on an
        # H200 plan_bench's mixed plans then measured up to 17% off their predicted step time
        # (within 5% with it). Compiled, the warm-up is the steps that compile (`_steady`): the
        # first probed step that compiles nothing is steady, and is the one read.
        with _warming(warmed, spent, handle) as steady:
            if compiled:
                first, steady.steady_ms = _steady(
                    lambda: probe.step(model, args, kwargs, loss_fn, outputs_held), spent)
            else:
                probe.step(model, args, kwargs, loss_fn, outputs_held)
        measured = ([first] if compiled else []) + [
            probe.step(model, args, kwargs, loss_fn, outputs_held)
            for _ in range(steps - (1 if compiled else 0))]
        probe.remove()
        # The probe's per-block hooks and events cost time of their own, which dominates small
        # blocks (on an H200, 8 blocks of d_model 1024 timed 27 ms probed, 17 ms unprobed): the
        # same steps unprobed scale every time the probe read. Per block (`scope: blocks`) the
        # hooks run around the compiled forwards, so their removal changes no graph: the first
        # unprobed step is the timing. Compiled whole (`scope: model`), the probe's hooks break
        # the model's graph at the blocks, and dynamo does not guard on module hooks
        # (`skip_nnmodule_hook_guards`, on by default): the unprobed steps run the graphs the
        # probed ones built (torch 2.13 on the CPU: no graph, no compile phase after the probe
        # came off), so their time is the broken graph's too; `_measured_whole` measures the
        # plan compiled whole. Should a step after the probe compile all the same, `_steady`
        # counts it as compiling and times the next.
        # No warm-up step of their own: the probed steps just ran this policy on these inputs
        # (allocator, host pool and kernels warm), and a step without the probe's hooks runs the
        # same kernels and copies. It was one discarded step per choice: on an H200 GPT-2
        # (126 ms plain), ~1 s of a profile. And one unprobed step where the probed ones agreed
        # within SETTLED: the step time has settled, and a second unprobed step would repeat
        # the first within that noise.
        # Not on several ranks (`strict`): this is each rank's own timing, and ranks that ran
        # different step counts would pair their sharded collectives wrongly (gloo: "Received
        # data size doesn't match expected size" in the two-rank test).
        times = [m.step_ms for m in measured]
        settled = not strict and len(times) > 1 and min(times) > 0 and max(times) <= (1 + SETTLED) * min(times)

        def unprobed_steps() -> float:
            return measure_steps(model, kwargs if kwargs else tuple(args), loss_fn=loss_fn,
                                 steps=1 if settled else steps, count=meter.memory, warm=True,
                                 outputs_held=outputs_held, backward=backward)[0]
        if probe_scale is not None:
            unprobed = 0.0
        elif compiled:
            unprobed, _ = _steady(unprobed_steps, spent, warmed)
        else:
            unprobed = unprobed_steps()
        moved = [0] * len(names)
        moved_last = [0] * len(names)
        moved_first = [0] * len(names)
        waits = [False] * len(names)
        if handle.engine is not None:
            # Groups open at the modules the rule takes: a choice on parts (`split_offload`)
            # moves its bytes in groups named after the parts, which count to their block; its
            # last part's group is the one reloaded while the block above runs its backward.
            block_of = {n: b for b, n in enumerate(names)}
            for g in handle.offload_groups():  # in group order
                b = _block_of(g["module"], block_of)
                if b is not None:
                    moved[b] += g["offloaded_bytes"]
                    moved_last[b] = g["offloaded_bytes"]
                    moved_first[b] = g["first_reload_bytes"]
            # The blocks whose recompute the reload below waited past, in the last step (the
            # first may differ: a lone Linear's signal misses once, then it reloads at once).
            for index in handle.engine.stats.deferred_groups or ():
                b = _block_of(handle.offload_group_names.get(index, ""), block_of)
                if b is not None:
                    waits[b] = True
    finally:
        if probe is not None:
            probe.remove()
        handle.remove()
    last = measured[-1]
    last.step_ms = min(s.step_ms for s in measured)
    scale = probe_scale
    if scale is None and last.step_ms > 0 and unprobed > 0:
        scale = min(1.0, unprobed / last.step_ms)  # the probe only ever adds time
        if scales is not None:
            scales[choice] = scale
    if scale is not None:
        last.forward_ms = [t * scale for t in last.forward_ms]
        last.backward_ms = [t * scale for t in last.backward_ms]
        last.forward_after_ms *= scale
        last.backward_before_ms *= scale
        last.step_ms *= scale
    return Run(last, moved, waits, moved_last, moved_first)


def _block_of(module: str, block_of: dict[str, int]) -> int | None:
    """The index of the block `module` is (or is inside), by its qualified name; None for a
    module outside every block."""
    name = module
    while name not in block_of and "." in name:
        name = name.rsplit(".", 1)[0]
    return block_of.get(name)


OUTRUN = 1.1
"""An offload run is left out where its copies alone take this much longer than full_offload's
measured step on every block (a margin over that step's noise)."""


def _slower_and_not_needed(runs: dict[str, Run], sizes: Sequence[Sequence[int]],
                           bandwidth: tuple[float, float] | None, strict: bool,
                           budget: int | None, grads: int) -> bool:
    """True when the offload run is slower than full_offload on every block (`_offload_outrun`'s
    time test, without its test of what offload holds) and `budget` (the policy's
    `memory_budget`) fits a run already measured with `grads` (the trainable parameters'
    bytes) to spare, so a plan fits without it (a uniform run fits to the byte; the spare
    covers the gradients a plan's terms may add: a previous step's through the forward, a
    later micro-batch's). Offload could still lower a block's backward below its recompute (see
    `_offload_outrun`) and so let another block keep instead of recompute; that is a plan not
    looked for, not one over its budget, and the run it would take is several plain steps (an
    H200 GPT-2: about 13; issue 18's planning is held to 20). Not on several ranks."""
    if budget is None or strict or not any(r.step.peak + grads <= budget for r in runs.values()):
        return False
    return _offload_outrun(runs, sizes, bandwidth, strict, held_tested=False)


def _offload_outrun(runs: dict[str, Run], sizes: Sequence[Sequence[int]],
                    bandwidth: tuple[float, float] | None, strict: bool,
                    held_tested: bool = True) -> bool:
    """True when no plan would choose `offload` for any block, so its run is left out: on every
    block, offloading what it saves takes longer than full_offload's step, even with the copies
    wholly hidden behind keep's compute at the measured bandwidth; and full_offload holds no more
    (the block's input at most, in flight; `offload` every storage it saves, in flight). In
    backward `offload` holds the storages its ops use and `RELOAD_STORAGES` more, where
    full_offload's recompute brings the whole block back: so no block (the last aside) may save
    more than `RELOAD_STORAGES` + 1 storages of offloadable size, or offload could hold less
    there, and the run is needed.

    Each block's floor is keep's forward or the copy of what it saves to the host, whichever is
    longer, plus keep's backward or the copy back. Against full_offload's measured step once it
    ran; before (whether to pin the offload run's buffers ahead), against what it cannot
    exceed: keep's step with its forward once more (a full recompute), its input's copy hidden.
    The last block offloads nothing (its group stays on the device for backward): keep's
    memory, no faster than keep.

    Not judged (False) without a measured bandwidth and keep run, on several ranks (each would
    judge from its own timing, and the ranks must run the same steps: `strict`). Compiled, the
    sizes are the compiled graphs' saved storages (the keep count runs compiled), which the
    engine's hooks see as they do eager ones, and the times are the compiled runs': judged
    alike (it was not, and the offload run, at ~3 plain steps a step on the blocks stack, was
    a third of a compiled profile's steps there). An H200 GPT-2 (n_embd 1536, batch
    8 x 1024, bf16): about 700 MB saved per block, 14 ms each way at ~50 GB/s, against a
    full_offload block of ~13 ms: the offload run was 13 plain steps and its pinning 4-8.5 s.
    On the blocks stack (d_model 2048) offloading every block ran at 2.9x checkpointing's step."""
    keep = runs.get("keep")
    if strict or bandwidth is None or keep is None or min(bandwidth) <= 0:
        return False
    if held_tested and any(sum(n >= MIN_OFFLOAD_BYTES for n in per) > RELOAD_STORAGES + 1
                           for per in sizes[:-1]):
        # Its backward may hold less than full_offload's: the engine reloads at most
        # RELOAD_STORAGES storages ahead of their use, each freed as its op is done, where the
        # recompute brings the whole block back; slower, offload may still be the only choice
        # under a budget below the recompute's peak (issue 17's blocks stack: block 0's
        # backward, with every block's gradients allocated, is the step's peak under
        # checkpointing; offloading block 0 holds 5 block inputs less there on the CPU).
        return False
    twin = runs.get("full_offload")
    d2h, h2d = bandwidth
    k, f = keep.step, twin.step if twin is not None else None
    for b, per in enumerate(sizes[:-1]):
        moved = sum(n for n in per if n >= MIN_OFFLOAD_BYTES)
        if not moved:
            continue  # keep's memory, no faster than keep
        floor = max(k.forward_ms[b], moved / (d2h * 1e6)) + max(k.backward_ms[b], moved / (h2d * 1e6))
        ceiling = f.forward_ms[b] + f.backward_ms[b] if f is not None \
            else 2 * k.forward_ms[b] + k.backward_ms[b]
        if floor < OUTRUN * ceiling:
            return False
    return True


def profile(
    model: nn.Module,
    modules: Sequence[str],
    inputs: Any,
    *,
    apply: Apply,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    pin: bool = True,
    pin_budget: int | None = None,
    steps: int = 1,
    choices: Sequence[str] | None = None,
    compile: Compile | None = None,
    submodules: str | Sequence[str] = "none",
    strict: bool = False,
    outputs_held: bool = True,
    budget: int | None = None,
) -> Profile:
    """Profile one training step of `model` on `inputs` per candidate (`modules`: fnmatch
    patterns) under each choice; `apply` applies a concrete policy (`actcfg.api` passes it).
    `submodules` (`checkpoint.submodules`) names each candidate's parts, which add the `split`
    choice (the parts checkpointed one by one) and `split_offload` (each part's input offloaded
    too). Everything the runs change is put back; PlanError when a candidate is never called or
    the plain step cannot be run.

    With `compile` every run is compiled as the plan will be (`apply` compiles each uniform
    policy, keep included), and the time spent compiling is kept apart (`Profile.compile_ms`).
    `strict`: a run out of memory ends the profile instead of being left out (a sharded model on
    several ranks, whose steps must match one for one: `actcfg.plan.sharded`). `outputs_held`:
    whether the training loop holds the model's outputs through backward (a Trainer that
    keeps only the loss does not: see `Probe.step`). `steps`: probed steps per choice, each
    followed by as many unprobed ones (one where the probed ones settled: `SETTLED`; none after
    keep's on CUDA where the probe cost keep under `PROBE_CHEAP`). One by
    default: a plan should cost no more than 20 plain steps (issue 18), and the memory a probed
    step reads is the same in the next; its time is the unprobed step's, whose noise on an
    H200 is about 1%. Without `choices`, the offload run is left out where it cannot be chosen
    (`_offload_outrun`), and, given `budget` (the policy's `memory_budget`), where it is
    slower than full_offload on every block and a run already measured fits the budget
    (`_slower_and_not_needed`); choices named are all run."""
    started = time.perf_counter()
    spent: list[float] = []
    compiled = compile is not None
    graphs = _graphs_built()
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    can_offload = device.type == "cuda" or (device.type == "cpu" and loopback_enabled())
    wanted = tuple(c for c in (choices or CHOICES) if can_offload or c not in OFFLOADS)
    selected = select_modules(model, tuple(modules), 1)
    names = [n for n, _ in selected]
    blocks = [m for _, m in selected]
    parts = find_parts(selected, submodules)
    part_names = [tuple(n for n, _ in ps) for ps in parts]
    if not any(part_names):
        wanted = tuple(c for c in wanted if not CHOICE_OF[c].parts)

    def taken(choice: str) -> list[str]:
        return [n for ps in part_names for n in ps] if CHOICE_OF[choice].parts else names
    args, kwargs = _split(inputs)
    loss = loss_fn or default_loss
    backward = deepspeed_backward(model)  # under DeepSpeed's ZeRO-1/2, gradients taken apart
    notes: list[str] = []
    runs: dict[str, Run] = {}
    timing = _Timing(spent)
    offloading = any(c in OFFLOADS for c in wanted)
    left: dict[str, list[int]] = {}  # per choice, what each block leaves alive until the turn
    with _restored(model), _quiet(), timing.counting(model):
        model.train()
        with torch.enable_grad():
            largest = [0] * len(blocks)
            sizes: list[list[int]] = [[] for _ in blocks]
            inputs: list[list[int]] = [[] for _ in blocks]  # what full keeps: each block's input
            # storages a block saves that an earlier block's keep count holds, and the other way
            shared_in, shared_out = [0] * len(blocks), [0] * len(blocks)
            held: dict[str, list[int]] = {}
            # The counting forwards (one per choice that recomputes, one for selective's saved
            # ops' outputs) stay: a forward without backward is cheap (~1/3 of a step), and the
            # counts are exact where a run's peaks are not (they mix held bytes with transients).
            counted = ("keep", *(c for c in ("full", "selective", "split") if c in wanted))
            # Compiled, each count runs in its choice's run, under the same compiled policy
            # (`_run`'s `before`): the run's first step then builds only the backward graph, where
            # a handle of its own compiled the forward once more for the count. Keep is counted
            # whatever `choices` says: apart where it is not run.
            # Per block only: compiled whole, dynamo does not guard on module hooks, so a graph
            # built by the count, before the probe's hooks are on, runs without them (the H200,
            # inductor: the probe saw no block called); the count gets a handle of its own.
            in_runs = tuple(c for c in counted if compiled and compile.scope == "blocks" and c in wanted)

            def count(choice: str) -> None:
                """`choice`'s counting forward, under its uniform policy applied now. Compiled,
                its time is compiling (the forward's graph is built in it)."""
                left[choice] = [0] * len(blocks)
                apart = resolve_ops(DEFAULT_SAVE_OPS) if choice == "selective" else ()
                try:
                    with _compiling(spent, compiled):
                        held[choice] = saved_bytes(
                            model, blocks, args, kwargs, left=None if compiled else left[choice],
                            kept_apart=apart, largest=largest if choice == "keep" else None,
                            sizes=sizes if choice == "keep" else inputs if choice == "full" else None,
                            shared_in=shared_in if choice == "keep" else None,
                            shared_out=shared_out if choice == "keep" else None)
                except torch.cuda.OutOfMemoryError:
                    if choice != "keep":
                        raise
                    oom = True
                else:
                    oom = False
                if oom:  # outside the except: the failed forward's tensors are gone
                    gc.collect()
                    torch.cuda.empty_cache()
                    raise PlanError(
                        "the model's forward alone does not fit in GPU memory without a policy, so "
                        "the profile cannot count what each candidate keeps; profile it with a "
                        "smaller batch (the plan's choices scale with it), or on a GPU with more "
                        "memory")

            counting = timing.begin()
            part_inputs: list[int] = []  # what split_offload will copy: its parts' inputs
            for choice in counted:
                if choice not in in_runs:
                    handle = apply(model, _uniform(taken(choice), choice, pin, pin_budget, compile))
                    reading = input_storages(parts, part_inputs) \
                        if choice == "keep" and "split_offload" in wanted and not compiled \
                        else contextlib.nullcontext()
                    try:
                        with reading:
                            count(choice)
                    finally:
                        handle.remove()
            # Eager, selective keeps its inputs (counted above) and its saved ops' outputs,
            # which bypass the hooks; compiled, the graph saves those outputs itself and the
            # hooks counted them.
            twice: dict[str, list[int]] = {}
            if "selective" in wanted and not compiled:
                twice["selective"] = [0] * len(blocks)
                outputs = saved_bytes(model, blocks, args, kwargs, save_ops=resolve_ops(DEFAULT_SAVE_OPS),
                                      passed_on=twice["selective"])
                held["selective"] = [s + o for s, o in zip(held["selective"], outputs)]
            timing.end("counts", counting)
            # One host pool for every offload run (see `shared_host_pool`): closed (unpinned)
            # when they are done, before the plan is applied. Not handed on to the applied plan:
            # it holds what the offload-everything run moved, far more than most plans move, and
            # would keep that pinned (and counted against pin_budget) for the whole training run.
            pooling = shared_host_pool(pin, pin_budget, register=device.type == "cuda") \
                if offloading else contextlib.nullcontext()
            bandwidth: tuple[float, float] | None = None
            judged = choices is None  # choices named by the caller are all run
            prepared_after = "full" if compiled and "full" in wanted else "keep"
            # Each run's unprobed step takes the probe's own cost out of its times. The probe is
            # the same hooks on the same blocks whatever the choice, and no choice's step is
            # shorter than keep's, so where it cost keep under PROBE_CHEAP it costs every run at
            # most that: keep's scale stands for theirs (on CUDA, whose events time it; not on
            # several ranks, which must run the same steps).
            scales: dict[str, float] = {}

            def probe_scale(choice: str) -> float | None:
                keep_scale = scales.get("keep")
                if choice == "keep" or keep_scale is None or device.type != "cuda" or strict:
                    return None
                return keep_scale if keep_scale >= 1 - PROBE_CHEAP else None
            with pooling as pool:
                for choice in wanted:
                    if choice == "offload" and judged and "full_offload" in runs \
                            and _offload_outrun(runs, sizes, bandwidth, strict):
                        notes.append(
                            "offload: not run: on every block its copies alone take longer than the "
                            "measured step of full_offload, which holds no more (no block saves more "
                            "storages than its backward holds reloaded); not a choice")
                        continue
                    if choice == "offload" and judged and _slower_and_not_needed(
                            runs, sizes, bandwidth, strict, budget,
                            sum(getattr(p, "ds_numel", p.numel()) * p.element_size()  # ZeRO-3: whole
                                for p in model.parameters() if p.requires_grad)):
                        notes.append(
                            "offload: not run: on every block its copies alone take longer than the "
                            "measured step of full_offload, and memory_budget fits a run already "
                            "measured; it could only lower a block's backward, at the cost of a "
                            "profiled step that is several plain ones")
                        continue
                    warmed = _Warmed(counter=lambda: timing.calls)

                    def counted_first(choice: str = choice) -> None:
                        calls = timing.calls
                        count(choice)
                        timing.move_calls(choice, "counts", timing.calls - calls)
                    try:
                        # On the host loopback an offload's "host" copies are CPU tensors too, but
                        # they go into the engine's pool buffers, made before the meter starts (on
                        # the pool's thread, or in the warm-up step) and written in place after,
                        # which `LiveBytes` (its dispatch mode is this thread's) does not
                        # count: what it counts is what the device side holds. Compiled graphs run
                        # below the Python dispatch mode that counts live bytes, so a compiled CPU
                        # run is estimated from its counted bytes (CUDA measures either way).
                        meter = Meter(device, count=not compiled)
                        with timing.timed(choice, pool):
                            runs[choice] = _run(model, blocks, names, choice, args, kwargs, loss,
                                                apply, meter, steps, pin, pin_budget, taken(choice),
                                                compile, spent, warmed, outputs_held, strict,
                                                backward, counted_first if choice in in_runs else None,
                                                probe_scale(choice), scales)
                    except torch.cuda.OutOfMemoryError:
                        if strict:
                            raise
                        notes.append(f"{choice}: out of GPU memory in its uniform run; "
                                     + ("estimated from full" if choice == "keep" else "not a choice"))
                        # the failed step's tensors die with the exception, here: give them back
                        gc.collect()
                        torch.cuda.empty_cache()
                    timing.warmed(choice, warmed)
                    if choice == "keep" and device.type == "cuda" and offloading:
                        # Before the runs after keep: whether the offload run is worth its host
                        # memory is judged from it (`_offload_outrun`).
                        with timing.timed("copy_bandwidth"):
                            bandwidth = copy_bandwidth()
                    if pool is not None and choice == prepared_after:
                        # What the offload runs will copy, made on the pool's thread while the
                        # runs between compute (their steps wait on the GPU, with the GIL
                        # released): made in their first step, on demand and as spares, pinning
                        # (a few GB/s) was most of that step, ahead of every block's copy. The
                        # storages each block keeps, but the last block's (its group stays on
                        # the device) and those under the engine's threshold; full + offload's
                        # block inputs are among them. Only those inputs where the offload run
                        # will be left out: pinning what no run copies was most of the host
                        # pool's part of a profile (an H200 GPT-2: 4-8.5 s of 11.9). Compiled
                        # too: the counts ran compiled, so these are the graphs' storages; the
                        # block inputs are known after full's run then (its count is in it).
                        outrun = "offload" not in wanted or (
                            judged and "full_offload" in wanted
                            and (_offload_outrun(runs, sizes, bandwidth, strict)
                                 or (budget is not None and not strict)))
                        copied = inputs if outrun else sizes
                        # And what split_offload copies, where keep's sizes are not prepared:
                        # every part's inputs, the last block's too (what stays on the device
                        # is the group after its last part).
                        ahead = [n for per in copied[:-1] for n in per] + (part_inputs if outrun else [])
                        pool.prepare(n for n in ahead if n >= MIN_OFFLOAD_BYTES)
                closing = time.perf_counter()
            if pool is not None:
                timing.add("host_pool", (time.perf_counter() - closing) * 1000.0)
        d2h, h2d = bandwidth if bandwidth is not None and any(c in runs for c in OFFLOADS) else (0.0, 0.0)
    for c in OFFLOADS:
        if c in runs and not any(runs[c].moved):
            del runs[c]  # it cannot lower any peak: every block's share is under min_offload_bytes
            notes.append(f"{c}: moved nothing (what it would offload is under the engine's "
                         "min_offload_bytes in every block); not a choice")
    if "keep" not in runs and "full" not in runs:
        raise PlanError("neither a plain step nor one with every candidate checkpointed fits in "
                        "GPU memory: the profile cannot measure this model; reduce the batch, or "
                        "plan over more modules")
    if compiled and _graphs_built() == graphs:
        # dynamo gives up quietly (a recompile limit, a frame it skips) and runs eager
        raise PlanError(
            f"compile: {{scope: {compile.scope}, backend: {compile.backend}}} asks for a profile "
            "under torch.compile, and torch.compile built no graph in it (dynamo ran the model "
            "eagerly): the plan would say nothing about the compiled run; run with "
            "TORCH_LOGS=recompiles,graph_breaks to see why, or remove `compile`")
    offloaded = any(c in runs for c in OFFLOADS)
    profiled = assemble(names, held, runs, device.type, d2h, h2d, notes, parts=part_names, left=left,
                        twice=twice,
                        largest_storage=max(largest, default=0) if offloaded else 0,
                        window_storages=WINDOW_STORAGES if offloaded else 0,
                        reload_ahead=[sum(sorted(per, reverse=True)[:RELOAD_STORAGES]) for per in sizes]
                        if offloaded else None,
                        shared=(shared_in, shared_out) if offloaded else None)
    compile_ms = sum(spent)
    total_ms = (time.perf_counter() - started) * 1000.0
    return dataclasses.replace(
        profiled, compiled=f"{compile.scope} with {compile.backend}" if compile else "",
        compile_ms=compile_ms, profile_ms=max(0.0, total_ms - compile_ms),
        parts_ms=timing.result(total_ms, compile_ms), parts_steps=timing.step_counts())


def measure_steps(model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  steps: int = 3, count: bool = True, warm: bool = False,
                  outputs_held: bool = True, backward: Backward | None = None) -> tuple[float, int]:
    """(median step ms, peak bytes of the last step above its start) of `steps` training steps
    after one warm-up, as the profile measures them (gradients set to None before each; on the
    CPU the bytes `LiveBytes` counts, or 0 with `count=False`). `warm`: the model has just run
    these steps with this policy (the profile's probed steps), so no warm-up step.
    `outputs_held` as in `Probe.step`; `backward` as the profile runs it (by default read off the
    model: `actcfg.plan.sharded.deepspeed_backward`)."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    meter = Meter(device, count=count)
    args, kwargs = _split(inputs)
    loss = loss_fn or default_loss
    backward = deepspeed_backward(model) if backward is None else backward
    times = []
    peak = 0
    first = 0 if warm else 1
    for i in range(steps + first):
        model.zero_grad(set_to_none=True)
        meter.begin()
        try:
            start = meter.tick()
            output = model(*args, **kwargs)
            value = loss(output)
            if not outputs_held:
                output = None
            grads = backward.run(value)
            end = meter.tick()
            del output, value, grads
            meter.peak_and_reset()
        finally:
            meter.end()
        if i >= first:
            times.append(meter.ms(start, end))
            peak = meter.step_peak
    return statistics.median(times), peak
