"""Profile one training step per candidate block under each choice, on the real model.

For each choice (keep, selective, split into parts, full, full + offload, split + offload,
offload) the candidates get that choice uniformly, through `actcfg.apply` with a
`checkpoint.mode: rules` policy (removed after), and a few steps run under a probe: forward
and backward hooks on each candidate record CUDA events and `torch.cuda` memory statistics at its boundaries (its forward;
its backward, from the gradient of its output to the gradient of its input; the turn between the
last forward and the first backward). What each block keeps is counted with saved-tensor hooks (storages saved inside
its forward; for selective, also the outputs of its saved ops) and, for offload choices, with the
offload engine's own per-group counts. Copy bandwidth each way is measured pinned. Everything
is put back after: gradients, buffers, training mode and RNG state. Under DeepSpeed's ZeRO-1/2
each step's backward takes the gradients with `torch.autograd.grad`, out of reach of ZeRO's
hooks, and stands in for the buffers those hooks allocate (`actcfg.plan.sharded.deepspeed_backward`).

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
from actcfg.runtime.compiling import warm_up
from actcfg.runtime.offload import MIN_OFFLOAD_BYTES, WINDOW_STORAGES, OffloadWarning, loopback_enabled
from actcfg.runtime.offload_pool import HostPool, shared_host_pool
from actcfg.plan.cost import Run, assemble
from actcfg.plan.parts import find_parts
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


@dataclasses.dataclass
class _Warmed:
    """A uniform run's warm-up step: its wall time, and what of it was compiling and growing the
    host pool (reported as parts of their own)."""

    wall_ms: float = 0.0
    compile_ms: float = 0.0
    pool_ms: float = 0.0

    @property
    def rest_ms(self) -> float:
        return max(0.0, self.wall_ms - self.compile_ms - self.pool_ms)


@contextlib.contextmanager
def _warming(warmed: _Warmed | None, spent: list[float], handle: Any) -> Iterator[None]:
    """Fills `warmed` with the wall time inside (which ends in a step's own synchronize)."""
    if warmed is None:
        yield
        return
    engine = getattr(handle, "engine", None)
    waited = engine.stats.host_wait_s if engine is not None else 0.0
    compiled = sum(spent)
    start = time.perf_counter()
    try:
        yield
    finally:
        warmed.wall_ms = (time.perf_counter() - start) * 1000.0
        warmed.compile_ms = sum(spent) - compiled
        warmed.pool_ms = (engine.stats.host_wait_s - waited) * 1000.0 if engine is not None else 0.0


class _Timing:
    """The profile's wall time by part (ms), its compiles left out (see `Profile.parts_ms`).

    Timed with `time.perf_counter` around parts that end in a synchronize of their own (a step's
    end, a copy measurement, the pool's close): no part adds one. Growing the host pool happens
    inside the offload runs' first steps; the pool's own clock (`OffloadStats.host_wait_s`, the
    time its engine's thread waited for buffers) takes it out of them."""

    def __init__(self, spent: list[float]) -> None:
        self.ms: dict[str, float] = {}
        self._spent = spent

    def add(self, name: str, ms: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms

    def begin(self) -> tuple[float, float]:
        """A mark for `end` (for a part that spans several statements)."""
        return time.perf_counter(), sum(self._spent)

    def end(self, name: str, mark: tuple[float, float]) -> None:
        """Add the wall time since `mark` to `name`, less what was compiled meanwhile."""
        start, compiled = mark
        self.add(name, (time.perf_counter() - start) * 1000.0 - (sum(self._spent) - compiled))

    @contextlib.contextmanager
    def timed(self, name: str, pool: HostPool | None = None) -> Iterator[None]:
        compiled = sum(self._spent)
        waited = pool.stats.host_wait_s if pool is not None else 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            wall = (time.perf_counter() - start) * 1000.0
            grown = (pool.stats.host_wait_s - waited) * 1000.0 if pool is not None else 0.0
            if grown:
                self.add("host_pool", grown)
            self.add(name, wall - (sum(self._spent) - compiled) - grown)

    def warmed(self, name: str, warmed: _Warmed) -> None:
        """Move a run's warm-up step (less its compiling and pool growth) to `warm_ups`."""
        self.ms[name] = self.ms.get(name, 0.0) - warmed.rest_ms
        self.add("warm_ups", warmed.rest_ms)

    def result(self, total_ms: float, compile_ms: float) -> dict[str, float]:
        """The parts in the report's order, with `rest` what none of them timed."""
        order = ["counts", *CHOICES, "warm_ups", "host_pool", "copy_bandwidth"]
        out = {k: max(0.0, self.ms[k]) for k in order if k in self.ms}
        out["rest"] = max(0.0, total_ms - compile_ms - sum(out.values()))
        return out


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


def _run(model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str], choice: str,
         args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor],
         apply: Apply, meter: Meter, steps: int, pin: bool,
         pin_budget: int | None, taken: Sequence[str], compile: Compile | None = None,
         spent: list[float] | None = None, warmed: _Warmed | None = None,
         outputs_held: bool = True, strict: bool = False, backward: Backward = Backward()) -> Run:
    # `taken`: the modules the choice's rule names (the blocks, or their parts for `split` and
    # `split_offload`); the probe and the byte counts stay on the blocks either way. Keep too
    # runs as applied (a `mode: none` rule), as the plan will: applying any policy turns a
    # Hugging Face model's `use_cache` off (`prepare_hf_model`), and a bare keep run built a KV
    # cache no plan builds (a tiny GPT-2: every keep term two block-sized tensors per layer
    # over its plan's step).
    handle = apply(model, _uniform(taken, choice, pin, pin_budget, compile))
    probe = Probe(modules, meter, backward)
    spent = [] if spent is None else spent
    compiled = compile is not None
    try:
        # warm-up: pinned pools, allocator, kernels; compiled, until the graphs are all built.
        # Every run, the on-device ones after keep too: without it, one probed step per choice
        # was that policy's first step, and on an H200 plan_bench's mixed plans then measured
        # up to 17% off their predicted step time (within 5% with it).
        with _warming(warmed, spent, handle):
            if compiled:
                spent.append(warm_up(lambda: probe.step(model, args, kwargs, loss_fn, outputs_held)))
            else:
                probe.step(model, args, kwargs, loss_fn, outputs_held)
        measured = [probe.step(model, args, kwargs, loss_fn, outputs_held) for _ in range(steps)]
        probe.remove()
        # The probe's per-block hooks and events cost time of their own, which dominates small
        # blocks (on an H200, 8 blocks of d_model 1024 timed 27 ms probed, 17 ms unprobed): the
        # same steps unprobed scale every time the probe read. Compiled whole (`scope: model`),
        # the probe's hooks break the model's graph at the blocks; without them it is one graph
        # again, compiled here before the unprobed steps are timed (each warm-up call one step:
        # `warm_up` itself repeats until the time settles). Per block (`scope: blocks`) the hooks
        # run around the compiled forwards, so their removal changes no graph: no warm-up here,
        # which was four steps or more per choice, the most of a compiled profile's time; should
        # a graph still be built in the unprobed steps, they are warmed up and timed again below.
        whole = compiled and compile.scope == "model"
        if whole:
            spent.append(warm_up(lambda: measure_steps(model, kwargs if kwargs else tuple(args),
                                                       loss_fn=loss_fn, steps=1, warm=True,
                                                       count=meter.memory, outputs_held=outputs_held,
                                                       backward=backward)))
        # No warm-up step of their own: the probed steps just ran this policy on these inputs
        # (allocator, host pool and kernels warm; compiled, `warm_up` above rebuilt the graph),
        # and a step without the probe's hooks runs the same kernels and copies. It was one
        # discarded step per choice: on an H200 GPT-2 (126 ms plain), ~1 s of a profile. And
        # one unprobed step where the probed ones agreed within SETTLED: the step time has
        # settled, and a second unprobed step would repeat the first within that noise.
        # Not on several ranks (`strict`): this is each rank's own timing, and ranks that ran
        # different step counts would pair their sharded collectives wrongly (gloo: "Received
        # data size doesn't match expected size" in the two-rank test).
        times = [m.step_ms for m in measured]
        settled = not strict and len(times) > 1 and min(times) > 0 and max(times) <= (1 + SETTLED) * min(times)

        def unprobed_steps() -> float:
            return measure_steps(model, kwargs if kwargs else tuple(args), loss_fn=loss_fn,
                                 steps=1 if settled else steps, count=meter.memory, warm=True,
                                 outputs_held=outputs_held, backward=backward)[0]
        graphs = _graphs_built() if compiled else 0  # dynamo is not imported for an eager profile
        started = time.perf_counter()
        unprobed = unprobed_steps()
        if compiled and not whole and _graphs_built() != graphs:  # it compiled: not a timing
            spent.append((time.perf_counter() - started) * 1000.0)  # that call's time was compiling
            spent.append(warm_up(unprobed_steps))
            unprobed = unprobed_steps()
        moved = [0] * len(names)
        moved_last = [0] * len(names)
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
            # The blocks whose recompute the reload below waited past, in the last step (the
            # first may differ: a lone Linear's signal misses once, then it reloads at once).
            for index in handle.engine.stats.deferred_groups or ():
                b = _block_of(handle.offload_group_names.get(index, ""), block_of)
                if b is not None:
                    waits[b] = True
    finally:
        probe.remove()
        handle.remove()
    last = measured[-1]
    last.step_ms = min(s.step_ms for s in measured)
    if last.step_ms > 0 and unprobed > 0:
        scale = min(1.0, unprobed / last.step_ms)  # the probe only ever adds time
        last.forward_ms = [t * scale for t in last.forward_ms]
        last.backward_ms = [t * scale for t in last.backward_ms]
        last.forward_after_ms *= scale
        last.backward_before_ms *= scale
        last.step_ms *= scale
    return Run(last, moved, waits, moved_last)


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


def _offload_outrun(runs: dict[str, Run], sizes: Sequence[Sequence[int]],
                    bandwidth: tuple[float, float] | None, strict: bool, compiled: bool) -> bool:
    """True when no plan would choose `offload` for any block, so its run is left out: on every
    block, offloading what it saves takes longer than full_offload's step, even with the copies
    wholly hidden behind keep's compute at the measured bandwidth; and full_offload holds no more
    (the block's input at most, in flight; `offload` every storage it saves, in flight, and
    reloads a whole block in backward where full_offload recomputes it).

    Each block's floor is keep's forward or the copy of what it saves to the host, whichever is
    longer, plus keep's backward or the copy back. Against full_offload's measured step once it
    ran; before (whether to pin the offload run's buffers ahead), against what it cannot
    exceed: keep's step with its forward once more (a full recompute), its input's copy hidden.
    The last block offloads nothing (its group stays on the device for backward): keep's
    memory, no faster than keep.

    Not judged (False) without a measured bandwidth and keep run, on several ranks (each would
    judge from its own timing, and the ranks must run the same steps: `strict`), nor compiled
    (the sizes are eager's saved storages, not the graphs'). An H200 GPT-2 (n_embd 1536, batch
    8 x 1024, bf16): about 700 MB saved per block, 14 ms each way at ~50 GB/s, against a
    full_offload block of ~13 ms: the offload run was 13 plain steps and its pinning 4-8.5 s.
    On the blocks stack (d_model 2048) offloading every block ran at 2.9x checkpointing's step."""
    keep = runs.get("keep")
    if strict or compiled or bandwidth is None or keep is None or min(bandwidth) <= 0:
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
    followed by as many unprobed ones (one where the probed ones settled: `SETTLED`). One by
    default: a plan should cost no more than 20 plain steps (issue 18), and the memory a probed
    step reads is the same in the next; its time is the unprobed step's, whose noise on an
    H200 is about 1%. Without `choices`, the offload run is left out where it cannot be chosen
    (`_offload_outrun`); choices named are all run."""
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
    with _restored(model), _quiet():
        model.train()
        with torch.enable_grad():
            counting = timing.begin()
            try:
                with _compiling(spent, compiled), _trial(model, names, compile, pin, pin_budget, apply):
                    largest = [0] * len(blocks)
                    sizes: list[list[int]] = [[] for _ in blocks]
                    left["keep"] = [0] * len(blocks)
                    held = {"keep": saved_bytes(model, blocks, args, kwargs, largest=largest, sizes=sizes,
                                                left=None if compiled else left["keep"])}
            except torch.cuda.OutOfMemoryError:
                oom = True
            else:
                oom = False
            if oom:
                gc.collect()
                torch.cuda.empty_cache()
                raise PlanError(
                    "the model's forward alone does not fit in GPU memory without a policy, so the "
                    "profile cannot count what each candidate keeps; profile it with a smaller "
                    "batch (the plan's choices scale with it), or on a GPU with more memory")
            # The counting forwards (one per choice that recomputes, one for selective's saved
            # ops' outputs) stay: a forward without backward is cheap (~1/3 of a step), and the
            # counts are exact where a run's peaks are not (they mix held bytes with transients).
            inputs: list[list[int]] = [[] for _ in blocks]  # what full keeps: each block's input
            for choice in ("full", "selective", "split"):
                if choice in wanted:
                    handle = apply(model, _uniform(taken(choice), choice, pin, pin_budget, compile))
                    try:
                        left[choice] = [0] * len(blocks)
                        apart = resolve_ops(DEFAULT_SAVE_OPS) if choice == "selective" else ()
                        with _compiling(spent, compiled):
                            held[choice] = saved_bytes(model, blocks, args, kwargs,
                                                       left=None if compiled else left[choice],
                                                       kept_apart=apart,
                                                       sizes=inputs if choice == "full" else None)
                    finally:
                        handle.remove()
            # Eager, its inputs (counted above) and its saved ops' outputs, which bypass the
            # hooks; compiled, the graph saves those outputs itself and the hooks counted them.
            if "selective" in wanted and not compiled:
                outputs = saved_bytes(model, blocks, args, kwargs, save_ops=resolve_ops(DEFAULT_SAVE_OPS))
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
            with pooling as pool:
                for choice in wanted:
                    if choice == "offload" and judged and "full_offload" in runs \
                            and _offload_outrun(runs, sizes, bandwidth, strict, compiled):
                        notes.append(
                            "offload: not run: on every block its copies alone take longer than the "
                            "measured step of full_offload, which holds no more; not a choice")
                        continue
                    warmed = _Warmed()
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
                                                backward)
                    except torch.cuda.OutOfMemoryError:
                        if strict:
                            raise
                        notes.append(f"{choice}: out of GPU memory in its uniform run; "
                                     + ("estimated from full" if choice == "keep" else "not a choice"))
                        # the failed step's tensors die with the exception, here: give them back
                        gc.collect()
                        torch.cuda.empty_cache()
                    timing.warmed(choice, warmed)
                    if choice != "keep":
                        continue
                    if device.type == "cuda" and offloading:
                        # Before the runs after keep: whether the offload run is worth its host
                        # memory is judged from it (`_offload_outrun`).
                        with timing.timed("copy_bandwidth"):
                            bandwidth = copy_bandwidth()
                    if pool is not None and not compiled:
                        # What the offload runs will copy, made on the pool's thread while the
                        # runs between compute (their steps wait on the GPU, with the GIL
                        # released): made in their first step, on demand and as spares, pinning
                        # (a few GB/s) was most of that step, ahead of every block's copy. The
                        # storages each block keeps, but the last block's (its group stays on
                        # the device) and those under the engine's threshold; full + offload's
                        # block inputs are among them. Only those inputs where the offload run
                        # will be left out: pinning what no run copies was most of the host
                        # pool's part of a profile (an H200 GPT-2: 4-8.5 s of 11.9). Compiled,
                        # the graphs save other storages: left on demand.
                        outrun = "offload" not in wanted or (
                            judged and "full_offload" in wanted
                            and _offload_outrun(runs, sizes, bandwidth, strict, compiled))
                        copied = inputs if outrun else sizes
                        pool.prepare(n for per in copied[:-1] for n in per if n >= MIN_OFFLOAD_BYTES)
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
                        largest_storage=max(largest, default=0) if offloaded else 0,
                        window_storages=WINDOW_STORAGES if offloaded else 0)
    compile_ms = sum(spent)
    total_ms = (time.perf_counter() - started) * 1000.0
    return dataclasses.replace(
        profiled, compiled=f"{compile.scope} with {compile.backend}" if compile else "",
        compile_ms=compile_ms, profile_ms=max(0.0, total_ms - compile_ms),
        parts_ms=timing.result(total_ms, compile_ms))


@contextlib.contextmanager
def _trial(model: nn.Module, names: Sequence[str], compile: Compile | None, pin: bool,
           pin_budget: int | None, apply: Apply) -> Iterator[None]:
    """The plain model for the keep count, with a `mode: none` rule (compiled with `compile`):
    as the plan runs it (a Hugging Face model's `use_cache` off, see `_run`)."""
    handle = apply(model, _uniform(names, "keep", pin, pin_budget, compile))
    try:
        yield
    finally:
        handle.remove()


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
