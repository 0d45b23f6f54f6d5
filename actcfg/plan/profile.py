"""Profile one training step per candidate block under each choice, on the real model.

For each choice (keep, selective, full, full + offload, offload) the candidates get that choice
uniformly, through `actcfg.apply` with a `checkpoint.mode: rules` policy (removed after), and a
few steps run under a probe: forward and backward hooks on each candidate record CUDA events
and `torch.cuda` memory statistics at its boundaries (its forward; its backward, from the
gradient of its output to the gradient of its input; the turn between the last forward and the
first backward). What each block keeps is counted with saved-tensor hooks (storages saved inside
its forward; for selective, also the outputs of its saved ops) and, for offload choices, with the
offload engine's own per-group counts. Copy bandwidth each way is measured pinned. Everything
is put back after: gradients, buffers, training mode and RNG state.

On the CPU (tests, or `apply` of a CPU model) the same runs happen, timed with wall-clock hooks;
memory is not measured there, and its peaks are estimated from the counted bytes (see
`Profile.notes`). Offload choices are profiled only where offloading runs (CUDA, or the host
loopback).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from actcfg._apply_torch import resolve_ops
from actcfg._wrap import select_modules
from actcfg.errors import PlanError, VerifyError
from actcfg.offload import OffloadWarning, loopback_enabled
from actcfg.plan.model import CHOICES, COUNTERPART, OFFLOADS, RULE_OF, BlockProfile, Option, Profile
from actcfg.plan.solve import predict
from actcfg.schema import DEFAULT_SAVE_OPS
from actcfg.verify.factory import split_inputs

__all__ = ["copy_bandwidth", "default_loss", "measure_steps", "profile", "saved_bytes"]

_MIN_EXTRA_MS = 1e-6
"""Every choice but keep costs at least this: a measured recompute of 0 (noise) must not make
checkpointing look free, or a plan would checkpoint what fits anyway."""


def default_loss(output: Any) -> torch.Tensor:
    """The output's `loss` (Hugging Face models given labels), else the mean square of its
    first tensor, in fp32."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise PlanError("the model returned no tensor to take a loss of: pass loss_fn=")
    return tensors[0].float().square().mean()


def _split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`verify`'s reading of example inputs (the same contract), refused as a PlanError."""
    try:
        return split_inputs(inputs)
    except VerifyError as e:
        raise PlanError(str(e)) from e


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return t
    return None


# --- clocks and memory: CUDA events and allocator statistics, or wall-clock on the CPU ----------


class _Meter:
    """Times and memory of one device: CUDA events and `torch.cuda` statistics, or, on the CPU,
    wall-clock times and no memory (every reading 0)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.base = 0
        self.step_peak = 0

    def tick(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.step_peak = 0

    def now(self) -> int:
        return torch.cuda.memory_allocated() - self.base if self.cuda else 0

    def peak_and_reset(self) -> int:
        """The peak since the last reset (above the step's start); starts a new span."""
        if not self.cuda:
            return 0
        peak = torch.cuda.max_memory_allocated() - self.base
        self.step_peak = max(self.step_peak, peak)
        torch.cuda.reset_peak_memory_stats()
        return peak

    def end(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class _Step:
    """What one step measured, per candidate block (times in ms, bytes above the step's start)."""

    n: int
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    forward_peak: list[int] = field(default_factory=list)
    backward_peak: list[int] = field(default_factory=list)
    step_ms: float = 0.0
    peak: int = 0
    turn_peak: int = 0
    outside_peak: int = 0
    forward_after_ms: float = 0.0
    backward_before_ms: float = 0.0


class _Probe:
    """Hooks on the candidate blocks that mark their forward and backward in time and memory.

    A block's backward runs from the gradient of its output to the gradient of its input; where
    one block's input is the block before's output, both marks are one tensor hook, which ends
    the block above before it starts the one below. A block whose input needs no gradient (the
    first, fed the raw batch) ends when the next backward mark or the step's end comes.
    """

    def __init__(self, modules: Sequence[nn.Module], meter: _Meter) -> None:
        self.meter = meter
        self.n = len(modules)
        self.recording = False
        self.handles = []
        for i, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(i)))
        self._reset()

    def _reset(self) -> None:
        n = self.n
        self.fwd_start: list[Any] = [None] * n
        self.fwd_end: list[Any] = [None] * n
        self.bwd_start: list[Any] = [None] * n
        self.bwd_end: list[Any] = [None] * n
        self.fwd_peak = [0] * n
        self.bwd_peak = [0] * n
        self.turn_peak = 0
        self.head_peak = 0
        self.open: int | None = None  # block whose backward is running
        self.marks: dict[int, tuple[list[int], list[int], weakref.ref[torch.Tensor]]] = {}
        self.turn_open = False

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _boundary(self, tensor: torch.Tensor) -> tuple[list[int], list[int]]:
        key = id(tensor)
        mark = self.marks.get(key)
        if mark is None or mark[2]() is not tensor:  # new, or an id a dead tensor left behind
            ends: list[int] = []
            starts: list[int] = []
            # Weakly: holding the block inputs would keep on the GPU what an offload choice
            # moves, and its measured peaks would not be its own (on an H200 the probe made
            # checkpoint + offload look one block input per block above checkpointing alone).
            mark = self.marks[key] = (ends, starts, weakref.ref(tensor))
            tensor.register_hook(lambda grad, e=ends, s=starts: self._backward_mark(e, s))
        return mark[0], mark[1]

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.recording or self.fwd_start[i] is not None:
                return
            before = self.meter.peak_and_reset()
            if i == 0:
                self.head_peak = before  # what ran before the first block
            self.fwd_start[i] = self.meter.tick()
            t = _first_grad_tensor((args, kwargs))
            if t is not None:
                self._boundary(t)[0].append(i)
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.recording or self.fwd_end[i] is not None:
                return
            self.fwd_end[i] = self.meter.tick()
            self.fwd_peak[i] = self.meter.peak_and_reset()
            self.turn_open = i == self.n - 1  # from here to the first backward mark: the turn
            t = _first_grad_tensor(output)
            if t is not None:
                self._boundary(t)[1].append(i)
        return hook

    def _end(self, i: int) -> None:
        if self.bwd_start[i] is None or self.bwd_end[i] is not None:
            return
        self.bwd_end[i] = self.meter.tick()
        self.bwd_peak[i] = self.meter.peak_and_reset()
        if self.open == i:
            self.open = None

    def _backward_mark(self, ends: list[int], starts: list[int]) -> None:
        if not self.recording:
            return
        for i in ends:
            self._end(i)
        for i in starts:
            if self.bwd_start[i] is not None:
                continue
            if self.open is not None:
                self._end(self.open)  # its input needed no gradient: it ends where the next begins
            if self.turn_open:
                self.turn_peak = self.meter.peak_and_reset()
                self.turn_open = False
            else:
                self.meter.peak_and_reset()
            self.bwd_start[i] = self.meter.tick()
            self.open = i

    def step(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             loss_fn: Callable[[Any], torch.Tensor]) -> _Step:
        meter = self.meter
        model.zero_grad(set_to_none=True)
        self._reset()
        meter.begin()
        self.recording = True
        try:
            start = meter.tick()
            output = model(*args, **kwargs)
            loss = loss_fn(output)
            after = meter.tick()
            backward = meter.tick()
            loss.backward()
            if self.open is not None:
                self._end(self.open)
            done = meter.tick()
            tail = meter.peak_and_reset()  # after the last backward mark: the rest of backward
        finally:
            self.recording = False
        del output, loss
        meter.end()
        self.marks.clear()
        missing = [i for i in range(self.n) if self.fwd_start[i] is None or self.bwd_start[i] is None]
        if missing:
            raise PlanError(f"candidate module {missing[0]} (in forward order) was not called in a "
                            "training step, or its output needed no gradient: the profile cannot "
                            "measure it; plan over modules the forward calls")
        last = self.n - 1
        return _Step(
            n=self.n,
            forward_ms=[meter.ms(a, b) for a, b in zip(self.fwd_start, self.fwd_end)],
            backward_ms=[meter.ms(a, b) for a, b in zip(self.bwd_start, self.bwd_end)],
            forward_peak=list(self.fwd_peak),
            backward_peak=list(self.bwd_peak),
            step_ms=meter.ms(start, done),
            peak=meter.step_peak,
            turn_peak=self.turn_peak,
            outside_peak=max(self.head_peak, tail),
            forward_after_ms=meter.ms(self.fwd_end[last], after),
            backward_before_ms=meter.ms(backward, self.bwd_start[last]),
        )


# --- bytes kept: saved-tensor hooks, and the outputs of selective's saved ops -----------------


def _counted(tensor: torch.Tensor) -> bool:
    """A saved tensor that is an activation (what the offload engine would consider moving)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return False
    if tensor.is_leaf and tensor.requires_grad:
        return False
    base = tensor._base
    return not (base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)))


class _Attribution:
    """Which candidate's forward is running (first call only), for the byte counts."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.current: int | None = None
        self.seen: set[int] = set()
        self.handles = []
        for i, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(self._enter(i)))
            self.handles.append(module.register_forward_hook(self._leave(i)))

    def _enter(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if i not in self.seen:
                self.seen.add(i)
                self.current = i
        return hook

    def _leave(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.current == i:
                self.current = None
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _OpOutputs(TorchDispatchMode):
    """Adds the storage bytes of every output of `ops` to the running candidate's count."""

    def __init__(self, ops: set[Any], where: _Attribution, out: list[int], seen: set[int]) -> None:
        super().__init__()
        self.ops, self.where, self.out, self.seen = ops, where, out, seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        i = self.where.current
        if i is not None and (func in self.ops or getattr(func, "overloadpacket", None) in self.ops):
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.nbytes() and storage.data_ptr() not in self.seen:
                        self.seen.add(storage.data_ptr())
                        self.out[i] += storage.nbytes()
        return result


def saved_bytes(model: nn.Module, modules: Sequence[nn.Module], args: tuple[Any, ...],
                kwargs: dict[str, Any], save_ops: Sequence[Any] = ()) -> list[int]:
    """Bytes of the storages autograd saves inside each module's forward (its first call; each
    storage counted once, parameters and leaves that require grad left out); with `save_ops`,
    the bytes of those ops' outputs there instead (what selective checkpointing keeps besides
    the inputs: up to torch 2.13 they bypass saved-tensor hooks). One forward, graph dropped."""
    where = _Attribution(modules)
    out = [0] * len(modules)
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        i = where.current
        if i is not None and not save_ops and _counted(t):
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[i] += storage.nbytes()
        # Never `t` itself: an op that saves its own output (tanh, gelu, sdpa) would then hold
        # that output through its own grad_fn, a cycle inside autograd's C++ that gc cannot
        # see, and this forward (never followed by backward) would keep everything it saved.
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mode = _OpOutputs(set(save_ops), where, out, seen) if save_ops else contextlib.nullcontext()
            with mode:
                result = model(*args, **kwargs)
        del result
    finally:
        where.remove()
    return out


# --- bandwidth --------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> tuple[float, float]:
    """(to host, to device) GB/s of one pinned copy of `nbytes`, the median of `repeats` after
    one warm-up, on the current CUDA device."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for dst, src in ((host, gpu), (gpu, host)):
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out.append(nbytes / (statistics.median(times[1:]) * 1e6))
    del gpu, host
    return out[0], out[1]


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


def _uniform(names: Sequence[str], choice: str, pin: bool, pin_budget: int | None) -> dict[str, Any]:
    section: dict[str, Any] = {"mode": "rules", "rules": [{"modules": list(names), **RULE_OF[choice]}]}
    data: dict[str, Any] = {"version": 1, "checkpoint": section}
    if choice in OFFLOADS:
        section.update(keep_last=0, max_inflight=1)
        data["pin"] = pin
        if pin_budget is not None:
            data["pin_budget"] = pin_budget
    return data


@dataclass
class _Run:
    step: _Step
    moved: list[int]


def _run(model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str], choice: str,
         args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor],
         apply: Callable[..., Any], meter: _Meter, steps: int, pin: bool,
         pin_budget: int | None) -> _Run:
    handle = None if choice == "keep" else apply(model, _uniform(names, choice, pin, pin_budget))
    probe = _Probe(modules, meter)
    try:
        probe.step(model, args, kwargs, loss_fn)  # warm-up: pinned pools, allocator, kernels
        measured = [probe.step(model, args, kwargs, loss_fn) for _ in range(steps)]
        probe.remove()
        # The probe's per-block hooks and events cost time of their own, which dominates small
        # blocks (on an H200, 8 blocks of d_model 1024 timed 27 ms probed, 17 ms unprobed): the
        # same steps unprobed scale every time the probe read.
        unprobed, _ = measure_steps(model, kwargs if kwargs else tuple(args), loss_fn=loss_fn,
                                    steps=steps)
        moved = [0] * len(names)
        if handle is not None and handle.engine is not None:
            by_name = {}
            for g in handle.offload_groups():
                by_name[g["module"]] = by_name.get(g["module"], 0) + g["offloaded_bytes"]
            moved = [by_name.get(n, 0) for n in names]
    finally:
        probe.remove()
        if handle is not None:
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
    return _Run(last, moved)


def profile(
    model: nn.Module,
    modules: Sequence[str],
    inputs: Any,
    *,
    apply: Callable[..., Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    pin: bool = True,
    pin_budget: int | None = None,
    steps: int = 2,
    choices: Sequence[str] | None = None,
) -> Profile:
    """Profile one training step of `model` on `inputs` per candidate (`modules`: fnmatch
    patterns) under each choice; `apply` is `actcfg.runtime.apply`. Everything the runs change
    is put back; PlanError when a candidate is never called or the plain step cannot be run."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    meter = _Meter(device)
    can_offload = device.type == "cuda" or (device.type == "cpu" and loopback_enabled())
    wanted = tuple(c for c in (choices or CHOICES) if can_offload or c not in OFFLOADS)
    selected = select_modules(model, tuple(modules), 1)
    names = [n for n, _ in selected]
    blocks = [m for _, m in selected]
    args, kwargs = _split(inputs)
    loss = loss_fn or default_loss
    notes: list[str] = []
    runs: dict[str, _Run] = {}
    with _restored(model), _quiet():
        model.train()
        with torch.enable_grad():
            try:
                held = {"keep": saved_bytes(model, blocks, args, kwargs)}
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
            for choice in ("full", "selective"):
                if choice in wanted:
                    handle = apply(model, _uniform(names, choice, pin, pin_budget))
                    try:
                        held[choice] = saved_bytes(model, blocks, args, kwargs)
                    finally:
                        handle.remove()
            if "selective" in wanted:  # its inputs (counted above) and its saved ops' outputs
                outputs = saved_bytes(model, blocks, args, kwargs, save_ops=resolve_ops(DEFAULT_SAVE_OPS))
                held["selective"] = [s + o for s, o in zip(held["selective"], outputs)]
            for choice in wanted:
                try:
                    runs[choice] = _run(model, blocks, names, choice, args, kwargs, loss, apply,
                                        meter, steps, pin, pin_budget)
                except torch.cuda.OutOfMemoryError:
                    notes.append(f"{choice}: out of GPU memory in its uniform run; "
                                 + ("estimated from full" if choice == "keep" else "not a choice"))
                    # the failed step's tensors die with the exception, here: give them back
                    gc.collect()
                    torch.cuda.empty_cache()
        d2h = h2d = 0.0
        if device.type == "cuda" and any(c in runs for c in OFFLOADS):
            d2h, h2d = copy_bandwidth()
    for c in OFFLOADS:
        if c in runs and not any(runs[c].moved):
            del runs[c]  # it cannot lower any peak: every block's share is under min_offload_bytes
            notes.append(f"{c}: moved nothing (what it would offload is under the engine's "
                         "min_offload_bytes in every block); not a choice")
    if "keep" not in runs and "full" not in runs:
        raise PlanError("neither a plain step nor one with every candidate checkpointed fits in "
                        "GPU memory: the profile cannot measure this model; reduce the batch, or "
                        "plan over more modules")
    return _assemble(names, held, runs, device.type, d2h, h2d, notes)


def _assemble(names: list[str], held: dict[str, list[int]], runs: dict[str, _Run], device: str,
              d2h: float, h2d: float, notes: list[str]) -> Profile:
    """The profile from the byte counts and the uniform runs (see `Option` for each term)."""
    n = len(names)
    cuda = device == "cuda"
    estimated_keep = "keep" not in runs
    ref = runs["keep"] if not estimated_keep else runs["full"]
    forward_ms = list(ref.step.forward_ms)
    backward_ms = list(ref.step.backward_ms)
    if estimated_keep:  # a full recompute is one forward: the plain backward is the rest
        backward_ms = [max(0.0, g - f) for g, f in zip(backward_ms, forward_ms)]
    moved = {c: runs[c].moved if c in runs else [0] * n for c in CHOICES}
    hold: dict[str, list[int]] = {"keep": held["keep"]}
    for c in ("full", "selective"):
        if c in held:
            hold[c] = held[c]
    if "full" in hold:
        hold["full_offload"] = [max(0, h - m) for h, m in zip(hold["full"], moved["full_offload"])]
    hold["offload"] = [max(0, h - m) for h, m in zip(hold["keep"], moved["offload"])]
    usable = [c for c in CHOICES if c in hold and (c in runs or (c == "keep" and estimated_keep))]

    def before(c: str, b: int) -> int:
        return sum(hold[c][:b])

    def prefetched(c: str, b: int) -> int:
        return moved[c][b - 1] if c in OFFLOADS and b >= 1 else 0

    options: list[dict[str, Option]] = [{} for _ in range(n)]
    for c in usable:
        ran = c if c in runs else "full"  # keep, estimated from full when it did not fit
        source = runs[ran]
        for b in range(n):
            if cuda:
                fwd = source.step.forward_peak[b] - before(ran, b) - prefetched(ran, b)
                bwd = source.step.backward_peak[b] - before(ran, b) - prefetched(ran, b)
                if ran != c:
                    fwd += hold["keep"][b] - hold["full"][b]
            else:  # counted, not measured: a block's activations while it runs, and again in backward
                fwd = hold["keep"][b]
                bwd = hold["keep"][b] + hold[c][b] + moved[c][b]
            if c in ("full", "selective", "full_offload"):
                rec_run = runs.get("full" if c == "full_offload" else c)
                recompute = max(0.0, rec_run.step.backward_ms[b] - backward_ms[b]) if rec_run else 0.0
            else:
                recompute = 0.0
            options[b][c] = Option(held=hold[c][b], moved=moved[c][b], forward_peak=max(0, fwd),
                                   backward_peak=max(0, bwd), recompute_ms=recompute, extra_ms=recompute)
    turn_peaks = [r.step.turn_peak - sum(hold[c]) - (moved[c][-1] if c in OFFLOADS else 0)
                  for c, r in runs.items() if c in hold] if cuda else [0]
    measured = {c: {"step_ms": r.step.step_ms, "peak": r.step.peak} for c, r in runs.items()}
    plain_ms = ref.step.step_ms if not estimated_keep else ref.step.step_ms - sum(
        o["full"].recompute_ms for o in options)
    base = Profile(
        blocks=tuple(BlockProfile(name, f, g, opts)
                     for name, f, g, opts in zip(names, forward_ms, backward_ms, options)),
        plain_step_ms=plain_ms,
        plain_peak=0,
        turn_peak=max(0, max(turn_peaks)),
        forward_after_ms=ref.step.forward_after_ms,
        backward_before_ms=ref.step.backward_before_ms,
        outside_peak=max(r.step.outside_peak for r in runs.values()) if cuda else 0,
        d2h_gbps=d2h, h2d_gbps=h2d, device=device, measured=measured,
        notes=tuple(notes) + (() if cuda else (
            "memory on the CPU is counted from saved tensors, not measured: peaks are estimates",)),
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
            options[b][c] = Option(o.held, o.moved, o.forward_peak, o.backward_peak, o.recompute_ms,
                                   o.recompute_ms + extra)
    for b in range(n):
        for c in list(options[b]):
            o = options[b][c]
            floor = 0.0 if c == "keep" else _MIN_EXTRA_MS
            twin = COUNTERPART.get(c)
            if twin in options[b]:  # an offload never costs less than its on-device twin
                floor = max(floor, options[b][twin].extra_ms + _MIN_EXTRA_MS)
            if o.extra_ms < floor:
                options[b][c] = Option(o.held, o.moved, o.forward_peak, o.backward_peak, o.recompute_ms, floor)
    out = Profile(
        blocks=tuple(BlockProfile(name, f, g, opts)
                     for name, f, g, opts in zip(names, forward_ms, backward_ms, options)),
        plain_step_ms=base.plain_step_ms, plain_peak=0, turn_peak=base.turn_peak,
        forward_after_ms=base.forward_after_ms, backward_before_ms=base.backward_before_ms,
        outside_peak=base.outside_peak,
        d2h_gbps=d2h, h2d_gbps=h2d, device=device, measured=measured, notes=base.notes,
    )
    plain_peak = int(runs["keep"].step.peak) if not estimated_keep and cuda else predict(out, ("keep",) * n)[1]
    return Profile(blocks=out.blocks, plain_step_ms=out.plain_step_ms, plain_peak=plain_peak,
                   turn_peak=out.turn_peak, forward_after_ms=out.forward_after_ms,
                   backward_before_ms=out.backward_before_ms, outside_peak=out.outside_peak,
                   d2h_gbps=d2h, h2d_gbps=h2d,
                   device=device, measured=measured, notes=out.notes)


def measure_steps(model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  steps: int = 3) -> tuple[float, int]:
    """(median step ms, peak bytes of the last step above its start) of `steps` training steps
    after one warm-up, as the profile measures them (gradients set to None before each)."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    meter = _Meter(device)
    args, kwargs = _split(inputs)
    loss = loss_fn or default_loss
    times = []
    peak = 0
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        meter.begin()
        start = meter.tick()
        output = model(*args, **kwargs)
        value = loss(output)
        value.backward()
        end = meter.tick()
        del output, value
        meter.peak_and_reset()
        meter.end()
        if i:
            times.append(meter.ms(start, end))
            peak = meter.step_peak
    return statistics.median(times), peak
