"""The probe: where a training step spends time and memory, block by block.

Forward and backward hooks on each candidate block record CUDA events and `torch.cuda` memory
statistics at its boundaries (its forward; its backward, from the gradient of its output to the
gradient of its input; the turn between the last forward and the first backward); on the CPU,
wall-clock times and the bytes of live tensor storages (`LiveBytes`). Also the copy bandwidth
each way, pinned.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from actcfg.errors import PlanError

__all__ = ["Backward", "LiveBytes", "Meter", "Probe", "StepReading", "copy_bandwidth",
           "first_grad_tensor", "gradient_bytes"]


def first_grad_tensor(value: Any) -> torch.Tensor | None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return t
    return None


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the parameter gradients `model` holds now, each storage once (a DTensor's local
    shard): what a step that begins with them frees or reuses, read off its start."""
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            storage = getattr(p.grad, "_local_tensor", p.grad).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class Backward:
    """How a profiled step runs its backward: `loss.backward()`, as a training loop does, unless
    `apart` names parameters whose gradients are taken with `torch.autograd.grad` instead, so
    that no hook on their gradient accumulation sees the profile (DeepSpeed's ZeRO-1/2:
    `actcfg.plan.sharded.deepspeed_backward`); `buffers`: bytes allocated from the start of
    that backward to the step's end, in place of what those hooks would allocate."""

    apart: tuple[torch.Tensor, ...] = ()
    buffers: int = 0
    after: Callable[[], None] | None = None
    """Called once the backward has run (ZeRO-3: release what modules whose post-backward hook
    never fired still hold gathered, as the engine's backward epilogue does)."""
    taking: Callable[[Sequence[torch.Tensor]], AbstractContextManager[Any]] | None = None
    """Given `apart`, a context around the backward inside which each of their gradients is
    taken as the engine's hooks take it, and which allocates what those hooks allocate when
    they do (ZeRO-3, whose hooks move each gradient into its reduce bucket and free it:
    `actcfg.plan.sharded.Zero3Gradients`); None: every gradient is held whole until the step
    ends, as `.grad` would be."""
    loss_copies: int = 0
    """Tensors like the loss that the engine's backward makes before it runs autograd and holds
    through it, allocated here in their place (DeepSpeed's `engine.backward`: the loss divided by
    the gradient accumulation steps, then multiplied by the loss scale; 2)."""

    def run(self, loss: torch.Tensor) -> Any:
        """Run it; what it returns holds the gradients taken apart, the stand-in and the loss's
        copies until the caller lets it go at the step's end (as `.grad` lives to then)."""
        if not self.apart:
            loss.backward()
            return None
        held = torch.empty(self.buffers, dtype=torch.uint8, device=loss.device) if self.buffers else None
        copies = [torch.empty_like(loss) for _ in range(self.loss_copies)]
        taking = self.taking(self.apart) if self.taking is not None else contextlib.nullcontext()
        try:
            with taking:
                grads = torch.autograd.grad(loss, self.apart, allow_unused=True)
        except RuntimeError as e:
            # torch's words: "... use_reentrant=True, torch.utils.checkpoint is incompatible
            # with .grad() ..." (2.13), "Checkpointing is not compatible with .grad() ..." before
            if ".grad()" not in str(e) or "heckpoint" not in str(e):
                raise
            # A reentrant checkpoint runs its own backward, which would write `.grad` and
            # fire the hooks this backward keeps away.
            raise PlanError(
                "the model checkpoints reentrantly (torch.utils.checkpoint with "
                "use_reentrant=True, or Hugging Face gradient_checkpointing without "
                "use_reentrant=False), and under the DeepSpeed engine the profile's backward takes "
                "the gradients with torch.autograd.grad, which a reentrant checkpoint refuses; "
                "turn that checkpointing off (the plan checkpoints what it needs) or make it "
                "non-reentrant") from e
        if self.after is not None:
            self.after()
        return grads, held, copies


# --- clocks and memory: CUDA events and allocator statistics, or wall-clock on the CPU ----------


class LiveBytes:
    """The CPU's stand-in for the CUDA allocator's statistics: bytes of the tensor storages ops
    create while it is started, each counted until it is freed (its weak reference expires).
    Frees are seen at the next op, so a peak is read where an allocator's would be: after an
    op's outputs exist, before its inputs can go. Storages made before `start` are not counted
    (as `memory_allocated() - base` leaves them out); those of `start(held=...)` are the base
    too, and their frees count, down below 0, as they lower `memory_allocated()` below a base."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                live = meter._live
                swept = False
                # A storage one of the op's inputs already has (a view, an op that wrote in
                # place or into `out=`) is nothing new, even if it was made before `start`:
                # a parameter's `.t()` in every Linear would otherwise count the weights as
                # activations, held until the step ends (3 block inputs per Llama layer of
                # hidden 128, on top of the 1 a checkpointed layer keeps).
                given: set[int] | None = None  # the inputs' storages, read only when needed
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        storage = t.untyped_storage()
                        key = storage.data_ptr()
                        known = live.get(key)
                        if known is not None and not meter._expired(known[0].cdata):
                            continue  # a view, or an op that wrote in place: nothing new
                        if given is None:
                            given = {a.untyped_storage().data_ptr() for a in
                                     tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
                        if key in given:
                            continue
                        if not swept:  # frees matter only when something new is counted
                            meter._sweep()
                            swept = True
                        if storage.nbytes():
                            live[key] = (StorageWeakRef(storage), storage.nbytes())
                            meter.now += storage.nbytes()
                meter.peak = max(meter.peak, meter.now)
                return out

        self._expired = torch.UntypedStorage._expired  # type: ignore[attr-defined]
        self._mode: TorchDispatchMode | None = None
        self._make = _Count
        self._live: dict[int, tuple[Any, int]] = {}
        self.now = 0
        self.peak = 0

    def _sweep(self) -> None:
        expired = self._expired
        revive = torch.UntypedStorage._new_with_weak_ptr  # type: ignore[attr-defined]
        # A storage is also gone when it still exists but no longer holds the bytes counted
        # under its address: FSDP2 frees a gathered (unsharded) parameter by resizing its storage
        # to 0 and gathers it again into the same storage at a new address (`free_storage`,
        # `alloc_storage` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
        gone = [k for k, (ref, _) in self._live.items()
                if expired(ref.cdata) or revive(ref.cdata).data_ptr() != k]
        for key in gone:
            self.now -= self._live.pop(key)[1]

    def start(self, held: Sequence[torch.Tensor] = ()) -> None:
        """Count from now; `held`: tensors alive now that the counted span may free (the
        previous step's gradients, which Lightning sets to None inside a step)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        self.stop()
        self._live.clear()
        self.now = self.peak = 0
        for t in held:
            storage = t.untyped_storage()
            if storage.nbytes():  # in the base (now stays 0): only its free is counted
                self._live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self._mode = self._make()
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)


class Meter:
    """Times and memory of one device: CUDA events and `torch.cuda` statistics, or, on the CPU,
    wall-clock times and the bytes `LiveBytes` counts (every reading 0 with `count=False`:
    the host loopback's "host" copies are CPU tensors too, and would count as device memory)."""

    def __init__(self, device: torch.device, count: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.live = LiveBytes() if not self.cuda and count else None
        self.base = 0
        self.step_peak = 0

    @property
    def memory(self) -> bool:
        """True when the readings are memory (CUDA, or counted on the CPU)."""
        return self.cuda or self.live is not None

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
        elif self.live is not None:
            self.live.start()
        self.step_peak = 0

    def now(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated() - self.base
        if self.live is None:
            return 0
        self.live._sweep()
        return self.live.now

    def peak_and_reset(self) -> int:
        """The peak since the last reset (above the step's start); starts a new span."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() - self.base
            torch.cuda.reset_peak_memory_stats()
        elif self.live is not None:
            peak = self.live.peak
            self.live._sweep()
            self.live.peak = self.live.now
        else:
            return 0
        self.step_peak = max(self.step_peak, peak)
        return peak

    def end(self) -> None:
        """The step's end; safe to call twice (callers call it in `finally`)."""
        if self.cuda:
            torch.cuda.synchronize()
        elif self.live is not None:
            self.live.stop()


@dataclass
class StepReading:
    """What one step measured, per candidate block (times in ms, bytes above the step's start)."""

    n: int
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    forward_peak: list[int] = field(default_factory=list)
    backward_peak: list[int] = field(default_factory=list)
    step_ms: float = 0.0
    peak: int = 0
    turn_peak: int = 0
    """Peak from the last block's forward end to the first backward mark (the whole turn)."""
    turn_forward_peak: int = 0
    """The turn's peak until the model's forward returns (the head, a loss computed inside it)."""
    turn_after_peak: int = 0
    """The turn's peak after the model's forward returned (the loss outside it, the start of
    backward): what the blocks left until the forward's end (`Option.left`) is gone by then."""
    outside_peak: int = 0
    head_peak: int = 0
    """The part of `outside_peak` before the first block (inside the model's forward)."""
    forward_after_ms: float = 0.0
    backward_before_ms: float = 0.0
    below_peak: list[int] = field(default_factory=list)
    """Per block, its backward's peak from the moment the offload engine began reloading the
    block below (`Probe.reload_began`) to its end; -1 where no reload of the block below began
    during its backward (or no engine ran)."""
    memory: bool = False
    """True when the peaks are readings (CUDA, or counted on the CPU), not zeros."""


class Probe:
    """Hooks on the candidate blocks that mark their forward and backward in time and memory.

    A block's backward runs from the gradient of its output to the gradient of its input; where
    one block's input is the block before's output, both marks are one tensor hook, which ends
    the block above before it starts the one below. A block whose input needs no gradient (the
    first, fed the raw batch) ends when the next backward mark or the step's end comes.
    """

    def __init__(self, modules: Sequence[nn.Module], meter: Meter, backward: Backward = Backward()) -> None:
        self.meter = meter
        self.backward = backward
        self.n = len(modules)
        self.recording = False
        self.handles = []
        # Never traced: inside a model compiled whole, dynamo would fold the clock reads into its
        # graph; disabled, each hook breaks the graph at the block boundary and runs as written.
        for i, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(
                torch.compiler.disable(self._pre(i)), with_kwargs=True))
            self.handles.append(module.register_forward_hook(torch.compiler.disable(self._post(i))))
        self._reset()

    def _reset(self) -> None:
        n = self.n
        self.fwd_start: list[Any] = [None] * n
        self.fwd_end: list[Any] = [None] * n
        self.bwd_start: list[Any] = [None] * n
        self.bwd_end: list[Any] = [None] * n
        self.fwd_peak = [0] * n
        self.bwd_peak = [0] * n
        self.bwd_before_below = [-1] * n  # the backward's peak until the reload below began
        self.below_peak = [-1] * n
        self.turn_peak = 0
        self.turn_forward_peak = 0
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
            t = first_grad_tensor((args, kwargs))
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
            t = first_grad_tensor(output)
            if t is not None:
                self._boundary(t)[1].append(i)
        return hook

    def _end(self, i: int) -> None:
        if self.bwd_start[i] is None or self.bwd_end[i] is not None:
            return
        self.bwd_end[i] = self.meter.tick()
        peak = self.meter.peak_and_reset()
        if self.bwd_before_below[i] >= 0:  # split where the reload of the block below began
            self.below_peak[i] = peak
            peak = max(peak, self.bwd_before_below[i])
        self.bwd_peak[i] = peak
        if self.open == i:
            self.open = None

    def reload_began(self, block: int) -> None:
        """Block `block`'s backward begins reloading the blocks below it (the offload engine's
        `reloads_below`): its backward is read in two spans from here, and the second
        (`StepReading.below_peak`) is what a larger reload below would add to. Where the engine
        waits past the recompute's peak to reload the block below (`GradProgress`), or a block
        on parts reloads it under its first part, the larger reload meets a lower level than
        the whole backward's peak, but one that is not the recompute's either: on an H200 the attention's backward after that
        signal, with two of an offloaded block's wide storages reloaded, was 41 MiB above the
        block's recompute peak, which an `offload` block's own reload had never been read at."""
        if not self.recording or self.open != block or self.bwd_before_below[block] >= 0:
            return
        self.bwd_before_below[block] = self.meter.peak_and_reset()

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
             loss_fn: Callable[[Any], torch.Tensor], outputs_held: bool = True) -> StepReading:
        """One training step, read; `outputs_held=False`: the model's outputs are let go once
        the loss is taken, before backward (as `transformers.Trainer.compute_loss` returns only
        the loss), else they live through backward (as a loop that keeps them)."""
        meter = self.meter
        model.zero_grad(set_to_none=True)
        self._reset()
        meter.begin()
        self.recording = True
        try:
            start = meter.tick()
            output = model(*args, **kwargs)
            if self.turn_open:  # the turn so far, while the forward still ran
                self.turn_forward_peak = meter.peak_and_reset()
            loss = loss_fn(output)
            if not outputs_held:
                output = None
            after = meter.tick()
            backward = meter.tick()
            grads = self.backward.run(loss)
            if self.open is not None:
                self._end(self.open)
            done = meter.tick()
            tail = meter.peak_and_reset()  # after the last backward mark: the rest of backward
            del output, loss, grads
        finally:
            self.recording = False
            meter.end()
        self.marks.clear()
        missing = [i for i in range(self.n) if self.fwd_start[i] is None or self.bwd_start[i] is None]
        if missing:
            raise PlanError(f"candidate module {missing[0]} (in forward order) was not called in a "
                            "training step, or its output needed no gradient: the profile cannot "
                            "measure it; plan over modules the forward calls")
        last = self.n - 1
        return StepReading(
            n=self.n,
            forward_ms=[meter.ms(a, b) for a, b in zip(self.fwd_start, self.fwd_end)],
            backward_ms=[meter.ms(a, b) for a, b in zip(self.bwd_start, self.bwd_end)],
            forward_peak=list(self.fwd_peak),
            backward_peak=list(self.bwd_peak),
            step_ms=meter.ms(start, done),
            peak=meter.step_peak,
            turn_peak=max(self.turn_forward_peak, self.turn_peak),
            turn_forward_peak=self.turn_forward_peak,
            turn_after_peak=self.turn_peak,
            outside_peak=max(self.head_peak, tail),
            head_peak=self.head_peak,
            forward_after_ms=meter.ms(self.fwd_end[last], after),
            backward_before_ms=meter.ms(backward, self.bwd_start[last]),
            below_peak=list(self.below_peak),
            memory=meter.memory,
        )


# --- bandwidth --------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 26, repeats: int = 3) -> tuple[float, float]:
    """(to host, to device) GB/s of one pinned copy of `nbytes`, the median of `repeats` after
    one warm-up, on the current CUDA device. 64 MiB: over a millisecond a copy on PCIe 5, far
    above a launch's microseconds; 256 MiB and 5 repeats were 1.3 plain steps of an H200
    GPT-2's planning, most of it pinning the buffer."""
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
