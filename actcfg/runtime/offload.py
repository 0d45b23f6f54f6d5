"""The offload engine: saved-tensor hooks that move activations to host memory off the compute stream.

What torch's `save_on_cpu` does per tensor, this does per group of tensors (a block), the way the
fastest offload runtimes do (../shared/reference/BACKENDS.md section 3):

* Forward. A packed tensor joins the open group. In the first step (the engine does not yet
  know which groups stay for backward), when the next group opens (`mark_group`, called at each
  block boundary), the previous group is copied to the host on a side stream, ordered after its
  producers by an event, storage by storage within a window of `max_inflight` times two of the
  largest storage met so far: past that the compute stream waits for the oldest copy. From the
  second step on, a group that does not stay for backward leaves storage by storage: each
  storage is copied as soon as its first view is saved (ordered after its producer; the views
  saved of it later ride on that copy), within a window of `max_inflight` times two of the
  largest storage the step before moved; past it the compute stream waits for the oldest
  copy. A copy that has finished gives its device memory back at once: the engine polls
  its copies each time autograd saves a tensor and at each boundary, and a copy waited for is
  released as the wait is queued. The group still open at the end of a forward never leaves the
  GPU (backward needs it first), nor do the last `keep_last` groups marked for offload (known
  from the step before; in the first step, the storages whose copies are still in flight at
  the end);
  under the group that stays, at most one copy is left in flight, so the turn holds that group
  and one copy. The other copies are waited for at the end of forward. What the engine holds is
  counted (`OffloadStats.device_bytes` and its high-water marks, forward and backward); the
  counting and the diagnosis live in `actcfg.runtime.offload_stats`, the host pool in
  `actcfg.runtime.offload_pool`.
* Per-module choices (`checkpoint.mode: rules`): `mark_group(offload=False)` opens a group whose
  tensors stay on the device (they are counted), and `end_group()` closes a group at a module's
  exit, so that what the modules between two groups save stays on the device too.
* Backward. Unpacking a saved tensor starts the reloads of the storages saved before it, newest
  first (the order backward uses them), on a second side stream, while the bytes on the device
  ahead of their use (reloaded, or kept at the turn, and no view unpacked yet) stay within a
  window of `prefetch` times two of the largest storage moved, and are at most `prefetch`
  times two storages (`RELOAD_STORAGES`: a block's small storages do not all come back while
  its wide ones are in use, so its backward holds what its ops use and two storages more, as
  a per-tensor reload like torch's `save_on_cpu` does, plus the prefetch); only storages of
  the `prefetch` groups just below qualify (the gaps `end_group` opens between groups do not
  count). The
  compute stream waits for a reload before the first view of it is used, and frees it when its
  last view is done: no `record_stream`, whose deferred frees kept reloaded block inputs
  allocated while backward's host thread ran ahead of the GPU.
* A checkpointed module's group (`mark_group(recomputed=module)`): its backward begins with the
  recompute, the block's peak. The groups below it are reloaded only once half the module's
  parameter bytes have their gradient in that backward (`GradProgress`), past the peak and with
  the rest of the block's backward to hide the copy; so through a recompute the engine holds
  the input being recomputed alone (and the groups kept at the turn above it), and checkpoint +
  cpu_checkpointing saves n - 2 block inputs against checkpointing alone at the first recompute's
  peak, not n - 3 (the peak of a step whose gradients stay allocated from the step before; with
  them freed at its start, both peak in the lowest block's backward, where no offloaded input is
  left). Where the gradients cannot say it in time (a compiled region's backward, no plain
  parameters of its own that require grad, FSDP2's DTensors among them, a lone Linear whose
  gradients come as its backward ends) the reload starts with the recompute, as for any other
  group. A storage several groups save (the rotary cos/sin a Llama gives every layer) belongs to
  the group that saved it first; a group above that needs it gets it reloaded on its own, which
  neither settles the waits above nor moves the reload cursor down.
* Host memory comes from a pool (`actcfg.runtime.offload_pool`) reused across steps: page-locked
  (pinned) buffers registered with `cudaHostRegister` at their exact size (torch's pinned
  allocator rounds every request up to a power of two), never more than `pin_budget` in total,
  nor more than this process's part of `pin_budget_per_node` (a ledger the node's ranks share:
  `actcfg.runtime.host_budget`); past either, or if pinning fails, pageable buffers with one
  warning. The pool grows ahead of need on its own thread (see `HostPool`).
* A saved view travels with its whole storage (q, k and v of one projection are one copy; a
  view saved after its storage's copy was done and released is served from that copy, if the
  storage is the same and unchanged: a compiled graph saves its tensors in one burst), and
  is rebuilt on the reloaded storage with its own strides and offset: `unpack(pack(t))` equals
  `t` in value, size, dtype and device, as torch's hook contract asks, and in layout too. That
  last part is not cosmetic: on an H200 (torch 2.11), bf16 transformer blocks whose saved q/k/v
  views came back contiguous got gradients 14% off the plain run's, every step (this engine's
  first version); torch's `save_on_cpu`, which also returns them contiguous, was 17% off in one
  run of several. With the layout kept, the error is the plain run's own run-to-run noise.
* What stays where it is is decided per tensor when autograd saves it, never from a list built
  beforehand (FSDP2 swaps parameters for sharded ones and frees their storage between forward
  and backward): parameters and views of them, leaves that require grad (their owner holds them
  anyway), the module's buffers, tensor subclasses (DTensor, ...), non-strided layouts, tensors
  on another device, tensors under `min_offload_bytes`, and views of a storage that a tensor
  saved in place earlier in the step holds (`shared`: a gap between groups saved it first, as a
  block checkpointed part by part saves its attention's output between its parts, and the next
  part saves it again as its input; moved, it would free nothing, and its reload would be a
  second device copy beside it). Not the other order: a storage a group moved, saved in place
  later, was moved for nothing. Each is version-checked on unpack,
  as autograd would: an in-place change after saving raises instead of giving wrong gradients An
  offloaded storage is checked when its copy starts and when its device memory is released; a
  change queued after that release runs after the copy, which keeps the values saved (the right
  ones for the gradient) where autograd would have raised.
* Every step is counted (`OffloadStats`). A training forward that saved activations inside the
  engine's scope and offloaded none of them warns once (`OffloadWarning`) with the reason: an
  offload that does nothing is never silent.
* The hooks run outside torch.compile's graphs (`torch.compiler.disable`): dynamo must neither
  trace them once and replay nothing, nor recompile them per tensor.

The engine runs on CUDA. `host_loopback()` lets it run on the CPU, "offloading" CPU tensors into
separate host buffers with synchronous copies: every decision, count and check is the same, so
CPU-only CI exercises the real engine; `actcfg.apply` never offloads CPU models otherwise. With
`pin`, its buffers count as pinned (within both budgets) without being registered.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterator
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointFunction
from torch.utils._pytree import tree_flatten

from actcfg.errors import OffloadError
from actcfg.runtime.host_budget import NodeBudget
from actcfg.runtime.offload_pool import HostPool, borrow_shared_pool
from actcfg.runtime.offload_stats import OffloadStats, OffloadWarning, no_effect_reason

__all__ = ["MIN_OFFLOAD_BYTES", "RELOAD_STORAGES", "WINDOW_STORAGES", "OffloadEngine", "OffloadStats", "OffloadWarning", "host_loopback", "loopback_enabled"]

_LOOPBACK = threading.local()


@contextlib.contextmanager
def host_loopback() -> Iterator[None]:
    """Within this block, engines may be built for the CPU (copies are synchronous), and
    `actcfg.apply` offloads CPU models: for tests and CI without a GPU."""
    before = getattr(_LOOPBACK, "on", False)
    _LOOPBACK.on = True
    try:
        yield
    finally:
        _LOOPBACK.on = before


def loopback_enabled() -> bool:
    """True inside `host_loopback()`."""
    return getattr(_LOOPBACK, "on", False)


# --- copies: CUDA streams, or synchronous copies on the host ------------------------------------


class _DoneEvent:
    """A host-loopback event: the copy it stands for finished before it was made."""

    def query(self) -> bool:
        return True


class _HostStream:
    """A host-loopback stream: copies run synchronously on the calling thread."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self) -> _DoneEvent:
        return _DoneEvent()


class _Copies:
    """The three streams the engine orders its copies with, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.d2h: Any = torch.cuda.Stream(device)
            self.h2d: Any = torch.cuda.Stream(device)
        else:
            self.d2h = self.h2d = _HostStream()

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else _HostStream()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()


# --- what autograd keeps ------------------------------------------------------------------------


def _version(tensor: torch.Tensor) -> int | None:
    # Inference tensors have no version counter; nothing can change them in place anyway.
    return None if tensor.is_inference() else tensor._version


class _Kept:
    """A saved tensor that stays where it is, checked for in-place changes on unpack; its group
    (None outside a step) tells backward which reload to start when it is unpacked."""

    __slots__ = ("tensor", "version", "group", "seq")

    def __init__(self, tensor: torch.Tensor, group: _Group | None = None, seq: int = 0) -> None:
        # detach(): holding the tensor with its grad_fn would make a reference cycle through
        # the graph that saved it. It shares the version counter, so changes still show.
        self.tensor = tensor.detach()
        self.version = _version(tensor)
        self.group = group
        self.seq = seq  # storages offloaded in this step before it was saved


class _Step:
    """One forward pass: its groups in order (weakly: a group dies with its saved tensors)."""

    def __init__(self) -> None:
        self.groups: list[weakref.ref[_Group]] = []
        self.gaps: list[bool] = []  # whether each group is a gap, known after it dies too
        self.open_groups: list[_Group] = []  # strong while the forward runs (empty ones count)
        # Every storage of the step, in the order it was saved (weakly): backward reloads them
        # from the newest down, as far as `window` allows, from `cursor` (the next to consider).
        self.chunks: list[weakref.ref[_Chunk]] = []
        self.cursor = -1
        self.window = 0  # bytes reloaded ahead of use that backward may hold at once
        self.ahead = 0  # bytes reloaded and not yet used (none of their views unpacked)
        self.ahead_storages = 0  # ... and how many storages they are


class _Group:
    """The storages saved between two block boundaries; they travel together."""

    def __init__(self, step: _Step, index: int, offload: bool, gap: bool, rank: int) -> None:
        self.step = step
        self.index = index
        self.offload = offload  # marked for offload (False: its tensors stay on the device)
        self.gap = gap  # between two groups (end_group): stays, and does not count for prefetch
        self.rank = rank  # how many groups marked for offload opened before it in this step
        self.chunks: list[weakref.ref[_Chunk]] = []
        self.kept_bytes = 0  # bytes saved in it that stay on the device
        # Its storages leave one by one as they are saved (from the second step on, where the
        # engine knows which groups stay for backward), not all at once when it closes.
        self.eager = False
        # A checkpointed module's group: its backward recomputes the module, and the reload of
        # the group below waits until that backward is past the recompute's peak (`GradProgress`).
        self.progress: GradProgress | None = None
        self.recompute_seen = False  # its backward has begun (a saved tensor of it unpacked)
        self.deferred_seq: int | None = None  # the reload below waits, from this position down

    def live(self) -> list[_Chunk]:
        return [c for ref in self.chunks if (c := ref()) is not None]

    def summary(self) -> tuple[int, int, int, int]:
        """At the turn: (bytes moved to the host, bytes that stayed on the device, of those the
        bytes marked for offload that stayed for backward, the bytes of its `RELOAD_STORAGES`
        newest storages moved: what backward reloads of it first, newest first)."""
        # Storage by storage: in a first step a group can leave in part, its storages still in
        # flight at the turn staying for backward (a storage that left has no device copy).
        chunks = self.live()
        moved = [c for c in chunks if c.gpu is None]
        stayed = sum(c.nbytes for c in chunks if c.gpu is not None)
        return (sum(c.nbytes for c in moved), self.kept_bytes + stayed, stayed if self.offload else 0,
                sum(c.nbytes for c in moved[-RELOAD_STORAGES:]))


class _Chunk:
    """One device storage that saved tensors view, moved as a whole: its bytes go to the host and
    come back in one copy, and every view is rebuilt on the reloaded storage with its own
    size, strides and offset, so the unpacked tensor is laid out exactly like the saved one.
    (Layout matters: a backward kernel may be built for the strides it saw in forward.)"""

    __slots__ = (
        "__weakref__", "group", "seq", "device", "nbytes", "gpu", "host", "buffer", "pinned",
        "reloaded", "pool", "stats", "last_reader", "views", "h2d_done", "used", "ahead", "freed_on",
        "storage_ref", "versions",
    )

    def __init__(self, tensor: torch.Tensor, group: _Group, pool: HostPool, stats: OffloadStats) -> None:
        storage = tensor.untyped_storage()
        self.group = group
        step = group.step
        self.seq = len(step.chunks)
        step.chunks.append(weakref.ref(self))
        self.h2d_done: Any = None
        # Which storage it is, after its device memory was released (a weak reference: a new
        # storage at the same address is another one), and the versions its views had when the
        # copy started: a view of it saved again later is served from the host copy.
        self.storage_ref = StorageWeakRef(storage)
        self.versions: set[int] = set()
        self.used = False  # a view of it was unpacked in backward
        self.ahead = False  # counted in its step's bytes on the device ahead of use
        self.freed_on: Any = None  # the stream that allocated the reload, and frees it
        self.device = tensor.device
        self.nbytes = storage.nbytes()
        # uint8 over the whole storage: holds it alive until the host copy is safe
        self.gpu: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.host: torch.Tensor | None = None  # the first nbytes of `buffer`
        self.buffer: torch.Tensor | None = None  # the pool's buffer, returned whole
        self.pinned = False
        self.reloaded: torch.Tensor | None = None
        self.pool = pool
        self.stats = stats  # counts the device bytes the chunk holds (its storage, or its reload)
        stats.hold(self.nbytes)
        self.last_reader: Any = None
        self.views: list[weakref.ref[_Saved]] = []

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views this chunk's storage, unchanged since its copy to the host
        started, after that copy was done and the device memory released (a compiled graph
        saves its tensors in one burst, where views of one storage need not come together)."""
        storage = tensor.untyped_storage()
        return (self.gpu is None and self.host is not None and self.reloaded is None
                and not self.storage_ref.expired() and self.storage_ref.cdata == storage._cdata
                and self.nbytes == storage.nbytes() and tensor._version in self.versions)

    def release_gpu(self) -> None:
        """Drop every device reference to the storage (the caller has made its reuse safe)."""
        for ref in self.views:
            if (saved := ref()) is not None:
                saved.check_version()
                saved.view = None
        if self.gpu is not None:
            self.gpu = None
            self.stats.release(self.nbytes)

    def reload_into(self, gpu: torch.Tensor) -> None:
        """Backward's copy of the storage, held until the last view of it is done."""
        self.reloaded = gpu
        self.stats.hold(self.nbytes)
        self.wait_for_use()

    def wait_for_use(self) -> None:
        """Count the storage as on the device ahead of use (reloaded, or kept at the turn)."""
        if not (self.used or self.ahead):
            self.ahead = True
            self.group.step.ahead += self.nbytes
            self.group.step.ahead_storages += 1

    def use(self) -> None:
        """A view of the storage was unpacked: it no longer counts as ahead of use."""
        self.used = True
        if self.ahead:
            self.ahead = False
            self.group.step.ahead -= self.nbytes
            self.group.step.ahead_storages -= 1

    def __del__(self) -> None:
        # Every saved view of this storage is gone: its device memory (if still held) goes back,
        # and its host buffer can serve the next step once the last copy that reads or writes
        # it has finished.
        if getattr(self, "gpu", None) is not None or getattr(self, "reloaded", None) is not None:
            self.stats.release(self.nbytes)
        if getattr(self, "reloaded", None) is not None and not self.used:
            # Reloaded but never used (backward stopped early): the memory goes back to the
            # stream that allocated it, which must not reuse it before the copy is done.
            try:
                self.freed_on.wait_event(self.h2d_done)
            except Exception:  # interpreter shutdown: CUDA may be gone already
                pass
        if getattr(self, "ahead", False):
            self.use()
        if getattr(self, "buffer", None) is not None:
            try:
                self.pool.release(self.buffer, self.last_reader, self.pinned)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass


class _Saved:
    """What autograd keeps for one offloaded tensor: which chunk, and how to view it."""

    __slots__ = ("__weakref__", "chunk", "size", "stride", "offset", "dtype", "version", "view", "modified",
                 "foreign")

    def __init__(self, tensor: torch.Tensor, chunk: _Chunk) -> None:
        self.chunk = chunk
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.dtype = tensor.dtype
        self.version = tensor._version
        # The saved view itself, while its storage is on the device: in-place changes show here.
        self.view: torch.Tensor | None = tensor.detach()
        self.modified = False
        # Saved by a later group than the chunk's (a tensor every block is given, as the rotary
        # tables a Llama computes once): its unpack is no sign that the chunk's group is needed.
        self.foreign = False

    def on(self, storage_bytes: torch.Tensor) -> torch.Tensor:
        """This view, rebuilt over a uint8 tensor holding the whole storage."""
        return torch.empty(0, dtype=self.dtype, device=storage_bytes.device).set_(
            storage_bytes.untyped_storage(), self.offset, self.size, self.stride
        )

    def check_version(self) -> None:
        if self.view is not None and self.view._version != self.version:
            self.modified = True


class _Copy:
    """Copies to the host launched together (a whole group, or one storage of an eager group),
    done when `done` is; until then their device memory is held."""

    __slots__ = ("group", "chunks", "done", "nbytes")

    def __init__(self, group: _Group, chunks: list[_Chunk], done: Any) -> None:
        self.group = group
        self.chunks = chunks
        self.done = done
        self.nbytes = sum(c.nbytes for c in chunks)


class GradProgress:
    """How far a checkpointed module's backward has got, read from its parameters' gradients:
    the moment its group's engine starts reloading the group below (issue 17's n - 2).

    A checkpointed block's backward begins with its recompute, which brings back every activation
    the block saves; the first backward ops then add their gradients on top (the widest, an MLP's
    hidden width, first in a transformer block): that is the block's peak, and checkpointing
    alone holds every lower block's input through it. Reloading the input of the block below as
    the recompute begins (the engine's schedule before) held it through that peak too. The
    reload now starts once the parameters holding half the module's parameter bytes have their
    gradient in this backward (`post_accumulate_grad` hooks): each gradient arrives as the op
    that used its weight is done, so by then the ops holding half the weights have run and freed
    their saved activations; in a transformer block that is its MLP (fc2 and fc1 are two thirds
    of its weights), past the widest ones. On a CPU blocks stack (d_model 128, ffn 512, float32,
    counted by the planner's LiveBytes), in block inputs above the step's start: the recompute
    ends at 24, fc2's backward peaks at 28.3, GELU's backward (just
    after fc2's gradient, the first signal one could take) at 28.05, which a reload there would
    push to 29.05; after fc1's gradient the block never exceeds 20.3. The copy is then hidden
    by the rest of the block's backward (attention, in a transformer block). A module whose
    signal leaves less than a quarter of its parameter bytes to come (one Linear: its weight is
    all of them) has nothing left to hide the copy behind: waiting only exposes it, so its
    later backwards reload at once (`missed`), as before. The input's unpack always waits for
    its reload, so a signal that comes late (or never) costs time, never correctness: if a
    lower group is needed first, its reload starts then, and this module's later backwards
    reload at once (`missed`), as a module without parameters of its own that require grad
    always does; unless no gradient of the module came at all in that backward
    (`torch.autograd.grad`), which must happen twice in a row (`note_miss`). FSDP2's
    parameters (DTensors) send no signal: under FSDP2 the reload starts with the recompute. Made by `OffloadEngine.mark_group(recomputed=module)` at the
    module's first call; its hooks come off with `OffloadEngine.close`.
    """

    def __init__(self, engine: OffloadEngine, module: nn.Module) -> None:
        self._engine = weakref.ref(engine)
        self._module = weakref.ref(module)
        # Plain parameters only: a tensor subclass (FSDP2's DTensor) gets its gradient from its
        # owner's reduction, not from autograd's accumulation, and would never signal.
        named = [(name, p) for name, p in module.named_parameters()
                 if type(p) is nn.Parameter and p.requires_grad]
        params = [p for _, p in named]
        self._params = [weakref.ref(p) for p in params]
        # Where each parameter sits (submodule names, then its own), to see at each recompute
        # that the module still holds it without walking `module.parameters()` (~20 us for a
        # Llama layer, once per layer per step in a launch-bound forward). None where a class in
        # the module overrides how parameters are listed: then every recompute walks.
        self._paths = ([(tuple(name.split(".")[:-1]), name.rsplit(".", 1)[-1]) for name, _ in named]
                       if _lists_parameters_plainly(module) else None)
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in params]
        self.waiting: _Group | None = None  # the group whose reload below waits, in this backward
        self.arrived = 0  # parameter bytes whose gradient came since it began to wait
        self.total = 0  # the module's parameter bytes that require grad now
        self.need = 0  # half of them
        self.missed = False  # the signal came too late to help: the reload no longer waits
        self.silent = 0  # backwards in a row in which no gradient of the module accumulated

    def note_miss(self) -> None:
        """The signal came too late in this backward. Some gradient of the module arrived (one
        Linear's, whose weight is nearly all its bytes; shared or replaced parameters): so it
        will in every backward, and the reload no longer waits. None arrived: that backward
        accumulated none (`torch.autograd.grad`, a gradient penalty or a saliency probe
        between training steps), which one call does not make a habit of: the reload waits
        again in the next backward, and stops waiting only after two such backwards in a row."""
        if self.arrived:
            self.missed = True
        else:
            self.silent += 1
            self.missed = self.silent >= 2

    def arm(self, group: _Group) -> bool:
        """`group`'s recompute begins: count from now. False when there is nothing to wait for
        (no parameter of its own requires grad now, the module replaced them, or it missed)."""
        module = self._module()
        if self.missed or module is None:
            return False
        total = sum(p.numel() * p.element_size() for p in self._held_by(module) if p.requires_grad)
        if total == 0:
            return False
        self.total, self.need, self.arrived, self.waiting = total, (total + 1) // 2, 0, group
        return True

    def _held_by(self, module: nn.Module) -> list[nn.Parameter]:
        """The hooked parameters `module.parameters()` still lists: each found where it was
        when hooked (the same object under the same names), else found by walking them all (a
        parameter replaced, deleted, or moved to another submodule)."""
        params = [ref() for ref in self._params]
        if self._paths is not None:
            for p, (owners, name) in zip(params, self._paths):
                owner: nn.Module | None = module
                for child in owners:
                    owner = owner._modules.get(child)
                    if owner is None:
                        break
                if owner is None or p is None or owner._parameters.get(name) is not p:
                    break
            else:
                return params  # type: ignore[return-value]
        current = {id(p) for p in module.parameters()}
        return [p for p in params if p is not None and id(p) in current]

    @torch.compiler.disable
    def _arrived(self, param: torch.Tensor) -> None:
        group = self.waiting
        if group is None:
            return
        self.arrived += param.numel() * param.element_size()
        if self.arrived >= self.need:
            engine = self._engine()
            if engine is None:
                self.waiting = None
            else:
                # Under a quarter still to come: the module's backward is all but done.
                engine._past_peak(group, missed=4 * (self.total - self.arrived) < self.total)

    def remove(self) -> None:
        """Take the hooks off the module's parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.waiting = None


def _lists_parameters_plainly(module: nn.Module) -> bool:
    """Whether `module.parameters()` is nn.Module's own walk of `_modules` and `_parameters`
    (no class in the tree overrides how it lists them), so a parameter held at its place is
    one it lists."""
    root = type(module)
    return (root.parameters is nn.Module.parameters and root.named_parameters is nn.Module.named_parameters
            and root._named_members is nn.Module._named_members
            and all(type(m).named_modules is nn.Module.named_modules for m in module.modules()))


class _BufferStorages:
    """The storages of the skipped modules' buffers on `device` (read live from each module's
    `_buffers`, so a buffer replaced or written in place is seen as it is now), found the first
    time a step asks. The modules are the ones in the tree when `skip_tensors_of` was called, a
    flat list: `module.buffers()` walks the tree through nested generators, about 830 Python
    calls a step on a tiny 8-layer Llama, in the launch-bound start of a GPU forward; the list
    makes none. A module added to the tree later is not looked at: a buffer of its, saved, is
    moved to the host while the module still holds it, a copy both ways that frees nothing
    (its values checked as any other's), never a wrong gradient."""

    __slots__ = ("_modules", "_device", "_found")

    def __init__(self, modules: list[weakref.ref[nn.Module]], device: torch.device) -> None:
        self._modules = modules
        self._device = device
        self._found: set[int] | None = None

    def __contains__(self, ptr: object) -> bool:
        if self._found is None:
            self._found = {b.untyped_storage().data_ptr()
                           for ref in self._modules if (module := ref()) is not None
                           for b in module._buffers.values()
                           if type(b) is torch.Tensor and b.device == self._device}
        return ptr in self._found


def stays(tensor: torch.Tensor, device: torch.device, buffers: Container[int],
          inputs: set[int] | frozenset[int] = frozenset()) -> str | None:
    """Why a saved tensor of offloadable size stays where it is, or None if it moves
    (`buffers`, `inputs`: storages of the module's buffers and of the step's inputs)."""
    if type(tensor) is not torch.Tensor:
        return "parameter" if isinstance(tensor, nn.Parameter) else "subclass"
    if tensor.layout is not torch.strided:
        return "layout"
    if tensor.device != device:
        return "device"
    if tensor.is_leaf and tensor.requires_grad:
        return "leaf"  # an input or parameter that requires grad: its owner holds it anyway
    base = tensor._base
    if base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return "parameter"
    if inputs and tensor.untyped_storage().data_ptr() in inputs:
        return "input"  # the caller's batch: its owner holds it for the whole step
    if tensor.untyped_storage().data_ptr() in buffers:
        return "buffer"
    return None


MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors under this many bytes stay on the device (the engine's default
`min_offload_bytes`): a copy's launch costs more than the memory it frees."""


class OffloadEngine:
    """Offloads saved activations of a forward pass to host memory and prefetches them for backward.

    Use `step()` around one forward pass and `mark_group()` at each block boundary inside it;
    the runtime (`actcfg.apply`) does both. Without any `mark_group()` every tensor stays in the
    one (last) group, nothing is offloaded, and the step warns.

    What the two scheduling knobs cost on the GPU:

    * `max_inflight`: copies to the host that may run at once: `max_inflight` times two of the
      largest storage moved (in the first step, met so far), in bytes. Each copy in flight
      keeps its device memory until it is done, so memory held during forward grows with it; in
      exchange, compute waits less when a copy is longer than the compute that follows it.
      Copies share one stream, so more buys time only when sizes are uneven.
    * `prefetch`: how far backward reloads ahead: the storages of the `prefetch` groups below
      the one in use, within `prefetch` times two of the largest storage moved, in bytes on the
      device ahead of their use, and at most `prefetch` times two storages.
    * `keep_last`: groups marked for offload that stay on the device at the forward/backward
      turn, from the last one back. Each costs its group's device memory at the turn (the peak,
      for most models), and saves its copy both ways, which at the turn nothing hides: backward
      needs the newest groups first.
    """

    def __init__(
        self,
        *,
        pin: bool = True,
        pin_budget: int | None = None,
        pin_budget_per_node: int | None = None,
        min_offload_bytes: int = MIN_OFFLOAD_BYTES,
        max_inflight: int = 1,
        prefetch: int = 1,
        keep_last: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if max_inflight < 1 or keep_last < 0 or prefetch < 0:
            raise OffloadError(
                f"offload engine: max_inflight must be at least 1 (got {max_inflight}), keep_last "
                f"at least 0 (got {keep_last}) and prefetch at least 0 (got {prefetch})")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda" and not (self.device.type == "cpu" and loopback_enabled()):
            raise OffloadError(
                "cpu_checkpointing needs a CUDA GPU: activations are offloaded from GPU memory "
                f"to the host, and this model is on {self.device}. On the CPU set "
                "`cpu_checkpointing: false`."
            )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise OffloadError("cpu_checkpointing needs a CUDA GPU, and torch sees none here")
        self.min_offload_bytes = min_offload_bytes
        self.max_inflight = max_inflight
        self.prefetch = prefetch
        self.keep_last = keep_last
        # Groups marked for offload in the last step: which of them are "the last keep_last"
        # is known only from a step before (steps repeat); None until a step has ended.
        self._offload_groups_last_step: int | None = None
        self._offload_groups = 0
        self._stats = OffloadStats()
        # Pinning is a CUDA registration: the host loopback counts its buffers as pinned (so
        # both budgets act in CPU CI) and registers none.
        node = NodeBudget(pin_budget_per_node) if pin and pin_budget_per_node is not None else None
        register = self.device.type == "cuda"
        # A pool shared by engines that run one after another (the planner's offload trials),
        # never one with a per-node budget: that account is this engine's own.
        shared = None if node is not None else borrow_shared_pool(pin, pin_budget, register, self._stats)
        self._pool = shared or HostPool(pin, pin_budget, self._stats, node, register=register)
        self._copies = _Copies(self.device)
        self._skip_modules: list[weakref.ref[nn.Module]] = []
        self._buffers = _BufferStorages([], self.device)
        self._inputs: set[int] = set()
        self._step: _Step | None = None
        self._owner: int | None = None
        self._open: _Group | None = None
        self._inflight: deque[_Copy] = deque()
        self._inflight_bytes = 0
        self._forward_window = 0  # bytes in flight to the host at once, from the step before
        self._largest_sent = 0  # the largest storage copied to the host in this step
        self._chunks: dict[int, _Chunk] = {}
        # Storages of offloadable size that a tensor saved in place holds on the device in this
        # step (by address, weakly): a view of one saved later into a group that offloads stays
        # too (`_held_in_place`).
        self._in_place: dict[int, StorageWeakRef] = {}
        # Checkpointed groups in backward whose reload of the group below waits for their
        # module's gradients (`GradProgress`); settled when the signal comes or a lower group
        # is needed first.
        self._deferred: list[_Group] = []
        self._progress: weakref.WeakKeyDictionary[nn.Module, GradProgress] = weakref.WeakKeyDictionary()
        self.reloads_below: Callable[[int, int], None] | None = None
        """Called with a group's index and the index of the group below it that it reloads
        first, where its backward begins reloading the groups below it (before their device
        memory is allocated): at its module's gradient signal where that reload waited
        (`GradProgress`), whether or not anything below was moved, else where its first reload
        of a lower group starts. The planner's probe splits a block's backward there where the
        group below is another block's, not the block's own earlier part
        (`actcfg.plan.probe.Probe.reload_began`)."""
        self._closed = False
        self._warned_no_effect = False
        # Unpin the pool even if close() is never called: freed memory must not stay registered.
        # A shared pool is given back instead: its owner closes it (`shared_host_pool`).
        self._unpin_at_exit = weakref.finalize(self, self._pool.give_back if shared else self._pool.close)

    # --- configuration -----------------------------------------------------------------

    def skip_tensors_of(self, module: nn.Module) -> None:
        """Never offload the buffers of `module` and of the submodules it has now (parameters
        are recognised as such when saved; see `_BufferStorages`)."""
        self._skip_modules.extend(weakref.ref(m) for m in module.modules())

    @property
    def stats(self) -> OffloadStats:
        """Counters of what the engine did (see `OffloadStats`)."""
        return self._stats

    # --- forward ---------------------------------------------------------------------------

    def step(self, inputs: Any = None) -> _StepScope:
        """A context manager: offload what autograd saves inside it; the last group stays on
        the device. `inputs`: the tensors the caller passed to the forward (a batch, in any
        nesting), which stay: their owner holds them for the whole step, so moving them would
        free nothing, and their reload would add a copy to backward (for checkpointed blocks,
        at its peak, when the first block's input comes back)."""
        return _StepScope(self, inputs)

    def in_step(self) -> bool:
        """True while this thread's forward is being offloaded."""
        return self._step is not None and self._owner == threading.get_ident()

    def _open_step(self, inputs: Any = None) -> None:
        if self._closed:
            raise OffloadError("this offload engine was closed (the policy was removed)")
        if self._step is not None:
            if self._owner != threading.get_ident():
                raise OffloadError(
                    "a second thread ran a training forward of this model while another "
                    "thread's forward was being offloaded: actcfg's offload engine serves one "
                    "forward at a time. Run the forwards one after another, or run the other "
                    "thread's forward under torch.no_grad()"
                )
            raise OffloadError("offload steps do not nest: a forward pass is already being offloaded")
        self._begin_step(inputs)

    @torch.compiler.disable
    def mark_group(self, offload: bool = True, *, recomputed: nn.Module | None = None) -> None:
        """A block boundary: start offloading the group saved so far (if it is marked for
        offload and not among the last `keep_last`), open a new one. `offload=False`: the new
        group's tensors stay on the device (counted in `kept_by_rule_bytes`). `recomputed`: the
        checkpointed module being entered, whose inputs the new group holds: its backward begins
        by recomputing it, and the group below is reloaded only once that backward is past the
        recompute's peak (`GradProgress`, hooked on the module's parameters until `close`).
        Returns None, so it can serve as a forward pre-hook as it is (a pre-hook's return value
        replaces the input); `open_group_index` is the index of the group it opened."""
        if self._step is None or self._owner != threading.get_ident():
            return
        self._open_group(offload, gap=False)
        if recomputed is not None:
            progress = self._progress.get(recomputed)
            if progress is None:  # the module's first call (a copy of the model has its own)
                progress = self._progress[recomputed] = GradProgress(self, recomputed)
            self._open.progress = progress

    @property
    def open_group_index(self) -> int | None:
        """Index, in this step, of the group open now (None outside this thread's step)."""
        if self._step is None or self._owner != threading.get_ident() or self._open is None:
            return None
        return self._open.index

    @torch.compiler.disable
    def end_group(self) -> None:
        """A block's exit: close its group as `mark_group` would, and keep on the device what is
        saved from here to the next group (the modules between groups)."""
        if self._step is None or self._owner != threading.get_ident():
            return
        self._open_group(False, gap=True)

    def _open_group(self, offload: bool, gap: bool) -> int:
        # Copies already done give their device memory back now, not at the next launch: an
        # offloaded block followed by kept ones must not stay resident until the turn.
        self._retire()
        group, self._open = self._open, self._new_group(offload, gap)
        if group is not None:
            self._close(group)
        stays = self._open.offload and not self._open.eager
        if stays and group is not None and group.eager:
            # The group that stays for backward opens after storages left one by one: it will
            # hold its whole block to the turn, so at most one copy stays in flight under it
            # (one keeps the copy stream busy through its forward; more would add to the turn).
            self._retire(keep=1)
        return self._open.index

    def _close(self, group: _Group) -> None:
        if not (group.offload and group.live()):
            return
        if group.eager:
            return  # its storages left as they were saved
        expected = self._offload_groups_last_step
        if expected is not None and group.rank >= expected - self.keep_last:
            return  # among the last keep_last: it stays for backward, which needs it first
        chunks = [c for c in group.live() if c.gpu is not None and c.host is None]
        if expected is None and chunks:
            # The first step (which groups stay for backward is not known yet, so the group
            # leaves only as the next one opens): storage by storage, within a window of
            # `max_inflight` x WINDOW_STORAGES of the largest storage met so far, as later
            # steps' groups do. Copied whole with
            # `max_inflight` groups in flight, a block's every activation stayed on the device
            # beside the next block's forward until the host saw its copy done: on an H200 a
            # plan's first step peaked 12-21% above its later steps, which the planner predicts.
            largest = max(self._largest_sent, max(c.nbytes for c in chunks))
            self._forward_window = self.max_inflight * WINDOW_STORAGES * largest
            for chunk in chunks:
                self._retire(room=chunk.nbytes)
                self._launch(group, [chunk])
            return
        # Room for the group about to leave: at most `max_inflight` copies run at once, which
        # bounds the device memory held above flat to that many groups.
        self._retire(keep=self.max_inflight - 1)
        self._launch(group, chunks)

    def _begin_step(self, inputs: Any = None) -> None:
        # Whatever an earlier step left in flight (a forward that raised, say) is settled first;
        # a backward that stopped early reloads nothing more.
        self._retire(keep=0)
        for group in self._deferred:
            group.deferred_seq = None
            if group.progress is not None and group.progress.waiting is group:
                group.progress.waiting = None
        self._deferred = []
        self._buffers = _BufferStorages(self._skip_modules, self.device)
        self._inputs = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0]
                        if type(t) is torch.Tensor and t.device == self.device}
        self._stats.begin_step()
        self._step = _Step()
        self._owner = threading.get_ident()
        self._offload_groups = 0
        self._largest_sent = 0
        self._open = self._new_group(True, gap=False)
        self._chunks = {}
        self._in_place = {}

    def _end_step(self, *, judge: bool) -> None:
        # The copies still in flight are waited for (on the compute stream) and their memory
        # released, so backward starts from the groups that stay: the one still open and, of
        # those marked for offload, the last keep_last (in the first step, the ones in flight).
        turn = self._offload_groups - self.keep_last
        stay = [c for c in self._inflight if not c.group.eager and c.group.rank >= turn]
        compute = self._copies.compute()
        for copy in stay:
            # Its device memory stays in use (backward reads it there). The compute stream waits
            # for the copy still reading it, so that memory is freed in order when backward is
            # done with it. (record_stream instead let the allocator free it whenever it next
            # looked: on an H200 the memory allocated after a step then differed from step to
            # step by 1.25 GB on the 200-step test.)
            compute.wait_event(copy.done)
            self._inflight_bytes -= copy.nbytes
        self._inflight = deque(c for c in self._inflight if c not in stay)
        self._retire(keep=0)
        groups = [g() for g in self._step.groups] if self._step is not None else []
        self._stats.end_step(None if g is None else g.summary() for g in groups)
        self._offload_groups_last_step = self._offload_groups
        # The schedule of the next step and of this backward, in bytes: a few of the largest
        # storage moved (see WINDOW_STORAGES).
        window = WINDOW_STORAGES * self._largest_sent
        self._forward_window = self.max_inflight * window
        if self._step is not None:
            self._step.open_groups = []  # from here each group lives as long as its tensors
            self._step.window = self.prefetch * window
            self._step.cursor = len(self._step.chunks) - 1
            # The storages that stay for backward (the last groups) are on the device ahead of
            # their use as much as a reload is: they take the window's room until used, so the
            # first reloads start as the last block's backward ends, not on top of all of it.
            for ref in self._step.chunks:
                if (chunk := ref()) is not None and chunk.gpu is not None:
                    chunk.wait_for_use()
        self._step = self._open = None
        self._owner = None
        self._chunks = {}
        self._in_place = {}
        if judge:
            self._warn_if_no_effect()

    def _warn_if_no_effect(self) -> None:
        if self._warned_no_effect:
            return
        why = no_effect_reason(self._stats, self.min_offload_bytes)
        if why is None:
            return
        self._warned_no_effect = True
        warnings.warn(f"actcfg offload: a training forward offloaded nothing: {why}.",
                      OffloadWarning, stacklevel=4)

    def _new_group(self, offload: bool, gap: bool) -> _Group:
        group = _Group(self._step, len(self._step.groups), offload, gap, self._offload_groups)
        if offload:
            self._offload_groups += 1
        # A group leaves storage by storage when the step before says it does not stay for
        # backward (not among the last keep_last, nor the last, open at the end) and how many bytes
        # may be in flight at once (the largest group moved, times max_inflight).
        expected = self._offload_groups_last_step
        group.eager = (offload and not gap and expected is not None and self._forward_window > 0
                       and group.rank < expected - max(self.keep_last, 1))
        # Strongly held by the step while it runs (an empty group must still count), weakly after.
        self._step.groups.append(weakref.ref(group))
        self._step.gaps.append(gap)
        self._step.open_groups.append(group)
        return group

    @torch.compiler.disable
    def _pack(self, tensor: torch.Tensor) -> _Saved | _Kept:
        nbytes = tensor.numel() * tensor.element_size()
        st = self._stats
        st.packed(nbytes)
        group = self._open
        if self._step is None or group is None:
            return _Kept(tensor)
        if self._inflight:
            # A copy that has finished gives its device memory back now, in the middle of
            # the next block's forward, not at the next boundary.
            self._retire()
        seq = len(self._step.chunks)
        if not group.offload:  # kept by the policy's choice (a rule, or a gap between groups)
            group.kept_bytes += nbytes
            st.kept_by_rule(nbytes)
            return self._kept_in_place(tensor, group, seq)
        if nbytes < self.min_offload_bytes:
            group.kept_bytes += nbytes
            return self._kept_in_place(tensor, group, seq)
        reason = stays(tensor, self.device, self._buffers, self._inputs)
        if reason is None and self._held_in_place(tensor.untyped_storage()):
            reason = "shared"  # a tensor saved in place holds its storage: moving it frees nothing
        if reason is not None:
            st.kept_for(reason, nbytes)
            group.kept_bytes += nbytes
            return self._kept_in_place(tensor, group, seq)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        chunk = self._chunks.get(ptr)
        if chunk is not None and chunk.holds(tensor):
            saved = _Saved(tensor, chunk)
            saved.view = None  # served from the host copy: the device memory stays released
            saved.foreign = chunk.group is not group
            chunk.views.append(weakref.ref(saved))
            return saved
        fresh = chunk is None or chunk.gpu is None or chunk.nbytes != storage.nbytes()
        if fresh:
            if storage.nbytes() > _MAX_STORAGE_OVER_VIEW * nbytes:
                # A small view of a large storage: moving the storage would move mostly other
                # data, and a copy of the view alone would change its layout. It stays.
                st.kept_for("view", nbytes)
                group.kept_bytes += nbytes
                return self._kept_in_place(tensor, group, seq)
            chunk = _Chunk(tensor, group, self._pool, st)
            group.chunks.append(weakref.ref(chunk))
            self._chunks[ptr] = chunk
        saved = _Saved(tensor, chunk)
        saved.foreign = chunk.group is not group
        chunk.views.append(weakref.ref(saved))
        if fresh and group.eager:
            self._send(chunk)  # it leaves as soon as it is saved
        return saved

    def _kept_in_place(self, tensor: torch.Tensor, group: _Group, seq: int) -> _Kept:
        """`tensor` stays where it is: so does its storage, for every later save in this step
        (a plain tensor's on this device: a subclass's storage may not be read)."""
        if type(tensor) is torch.Tensor and tensor.layout is torch.strided and tensor.device == self.device:
            storage = tensor.untyped_storage()
            if storage.nbytes() >= self.min_offload_bytes:
                self._in_place[storage.data_ptr()] = StorageWeakRef(storage)
        return _Kept(tensor, group, seq)

    def _held_in_place(self, storage: torch.UntypedStorage) -> bool:
        """Whether a tensor saved in place earlier in this step holds `storage` on the device.
        Moving it then frees nothing: the copy out and back costs both ways, and its reload in
        backward is a second device copy beside the one that never left. A block checkpointed
        part by part saves its attention's output in place (the block's own op, between its
        parts) and again as the next part's input: offloaded there, one block input each
        split_offload block held above what it counted as moved."""
        known = self._in_place.get(storage.data_ptr())
        return known is not None and not known.expired() and known.cdata == storage._cdata

    def _send(self, chunk: _Chunk) -> None:
        """Launch the copy of an eager group's storage as its first view is saved, once the
        copies in flight leave room for it within the forward window (the compute stream waits
        for the oldest). Its producer is queued already (an op's input was made before the op,
        its output before autograd saves it), and the copy is ordered after it. The views saved
        of it later (q, k and v of one projection come one after another) ride on this copy, or
        on its host copy once it is done. Sent at the next storage's save instead, as before,
        the seed chain's first copy waited for two layers' forward, not one: on the H200 the
        step took 83.8 against 83.1 ms, and the forward held one storage more."""
        self._retire(room=chunk.nbytes)
        self._launch(chunk.group, [chunk])

    def _launch(self, group: _Group, chunks: list[_Chunk]) -> None:
        copies = self._copies
        copies.d2h.wait_stream(copies.compute())  # the producers of these tensors come first
        st = self._stats
        with copies.on(copies.d2h):
            for chunk in chunks:
                for ref in chunk.views:
                    if (saved := ref()) is not None:
                        saved.check_version()
                        if not saved.modified:
                            chunk.versions.add(saved.version)
                buffer, last_reader, pinned = self._pool.acquire(chunk.nbytes)
                if last_reader is not None:
                    copies.d2h.wait_event(last_reader)  # the reload that last read this buffer
                host = buffer[: chunk.nbytes]
                host.copy_(chunk.gpu, non_blocking=pinned)
                chunk.host, chunk.buffer, chunk.pinned = host, buffer, pinned
                st.copied_out(chunk.nbytes)
                self._largest_sent = max(self._largest_sent, chunk.nbytes)
            done = copies.d2h.record_event()
        for chunk in chunks:
            chunk.last_reader = done
        copy = _Copy(group, chunks, done)
        self._inflight.append(copy)
        self._inflight_bytes += copy.nbytes
        st.in_flight(len(self._inflight))

    def _retire(self, *, keep: int | None = None, room: int | None = None) -> None:
        """Drop the device copies of storages whose host copy is done; then wait (on the compute
        stream, not the host) for the oldest copies until at most `keep` copies are in flight,
        or until `room` more bytes fit in the forward window."""
        # The compute stream is looked up only for a wait: `torch.cuda.current_stream` builds a
        # Python Stream object each call, and this runs at every save. On the H200 the Llama
        # stack's forward is launch-bound (the GPU's queue empty through it, in a profiler
        # trace), so the engine's host time there is step time.
        compute = None
        while self._inflight:
            copy = self._inflight[0]
            if not copy.done.query():
                over = ((keep is not None and len(self._inflight) > keep)
                        or (room is not None and self._inflight_bytes + room > self._forward_window))
                if not over:
                    break
                # Later compute-stream work may reuse this memory only after the copy has read it.
                compute = compute or self._copies.compute()
                compute.wait_event(copy.done)
                self._stats.copy_waits += 1
            self._inflight.popleft()
            self._inflight_bytes -= copy.nbytes
            for chunk in copy.chunks:
                if chunk.host is not None:
                    chunk.release_gpu()

    # --- backward -------------------------------------------------------------------------

    @torch.compiler.disable
    def _unpack(self, packed: _Saved | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            if packed.group is not None:
                if self._deferred:
                    self._settle_deferred(packed.group)
                self._prefetch(packed.group, packed.seq)
            if packed.version is not None and packed.tensor._version != packed.version:
                raise _modified_error(packed.tensor.size(), packed.tensor.dtype)
            return packed.tensor
        saved = packed
        chunk = saved.chunk
        if saved.foreign:
            # A storage an earlier group saved first, needed by a group above it: reloaded on
            # its own below if not back yet (it is needed now), without settling the waits
            # above it or moving the reload cursor down past the groups between.
            chunk.use()
        else:
            if self._deferred:
                self._settle_deferred(chunk.group)
            chunk.use()  # before the prefetch: it no longer takes room in the window
            self._prefetch(chunk.group, chunk.seq)
        saved.check_version()
        if saved.modified:
            raise _modified_error(saved.size, saved.dtype)
        if saved.view is not None:  # it never left the device
            return saved.view
        if chunk.reloaded is None:
            self._stats.late_reloads += 1
            self._reload([chunk])
        compute = self._copies.compute()
        compute.wait_event(chunk.h2d_done)
        if chunk.freed_on is not compute and chunk.freed_on != compute:
            chunk.freed_on.wait_event(chunk.h2d_done)  # it frees the reload: same order there
        return saved.on(chunk.reloaded)

    def _prefetch(self, group: _Group, seq: int) -> None:
        """Start the reloads of the storages saved before position `seq`, newest first (the
        order backward needs them in), while the bytes reloaded ahead of use stay within the
        step's window and they are at most `prefetch` x `RELOAD_STORAGES` storages. Only storages of the `prefetch`
        groups just below `group` qualify; the gaps `end_group` opens between groups are
        passed over, not counted, so a reload starts at most one block ahead (never earlier,
        which would hold its memory through the blocks between). A checkpointed group's
        reload of the groups below waits until its module's backward is past the recompute's
        peak (`GradProgress`); until then only its own storages come back."""
        step = group.step
        if self.prefetch <= 0:
            return
        recompute_begins = group.progress is not None and not group.recompute_seen
        if recompute_begins:
            group.recompute_seen = True
            if self._defer_below(group):
                group.deferred_seq = seq
        lowest, wanted = group.index, self.prefetch
        if group.deferred_seq is not None:
            group.deferred_seq = seq
            wanted = 0  # the groups below wait for the module's gradients
        for i in range(group.index - 1, -1, -1):
            if wanted <= 0:
                break
            if not step.gaps[i]:
                wanted -= 1
            lowest = i
        cursor = min(step.cursor, seq - 1)
        ahead, count = step.ahead, step.ahead_storages
        most = self.prefetch * RELOAD_STORAGES
        targets = []
        while cursor >= 0:
            chunk = step.chunks[cursor]()
            if chunk is None or chunk.host is None or chunk.gpu is not None or chunk.reloaded is not None:
                cursor -= 1  # gone, never moved, or already back
                continue
            if (chunk.group.index < lowest or count >= most
                    or (ahead and ahead + chunk.nbytes > step.window)):
                break
            targets.append(chunk)
            ahead += chunk.nbytes
            count += 1
            cursor -= 1
        step.cursor = cursor
        if self.reloads_below is not None:
            lower = [t.group.index for t in targets if t.group.index < group.index]
            if lower:
                self.reloads_below(group.index, max(lower))
        if targets:
            self._reload(targets)
        if recompute_begins:
            self._stats.recompute_began()

    def _defer_below(self, group: _Group) -> bool:
        """Whether the reload of the groups below `group` waits for its module's gradients: only
        where the tensor is unpacked to recompute the module op by op, so that its parameters'
        gradients arrive during its backward, as its recompute's activations are freed (torch's
        non-reentrant checkpoint: a built-in node of the module's backward is running; reentrant:
        torch's CheckpointFunction, which runs the module's backward inside its own). A compiled
        region's backward (or another custom Function) gives its gradients only when it is
        done: waiting for them would leave the copy uncovered, so the reload starts now."""
        node = _current_autograd_node()
        forward = getattr(type(node), "_forward_cls", None)
        if node is None or (forward is not None and forward is not CheckpointFunction):
            return False
        progress = group.progress
        if progress is None:
            return False
        if progress.waiting is not None:  # the module's earlier call, whose signal never came
            self._past_peak(progress.waiting, missed=True)
        if not progress.arm(group):
            return False
        self._deferred.append(group)
        return True

    def _past_peak(self, group: _Group, missed: bool = False) -> None:
        """`group`'s module is past its recompute's peak (`missed`: a group below is needed
        before the signal came, or it came with the module's backward all but done): start the
        reloads below it that waited."""
        seq, group.deferred_seq = group.deferred_seq, None
        if group in self._deferred:
            self._deferred.remove(group)
        progress = group.progress
        if progress is not None and progress.waiting is group:
            progress.waiting = None
        if seq is None:
            return
        if missed:
            # The module's gradients come after the group below is needed (shared or replaced
            # parameters, torch.autograd.grad), or only as its backward ends (one Linear):
            # waiting hides nothing, so its later backwards reload at once, as before
            # (`GradProgress.note_miss`: not for one backward that accumulated nothing).
            if progress is not None:
                progress.note_miss()
            self._stats.missed_deferrals += 1
        else:
            if progress is not None:
                progress.silent = 0
            self._stats.reload_deferred(group.index)
        if self.reloads_below is not None:
            gaps = group.step.gaps
            below = next((i for i in range(group.index - 1, -1, -1) if not gaps[i]), None)
            if below is not None:
                self.reloads_below(group.index, below)
        self._prefetch(group, seq)

    def _settle_deferred(self, group: _Group) -> None:
        """A tensor of `group` is needed: a group above it still waiting for its module's
        gradients waited too long; its reloads start now (the unpack waits for them)."""
        for waiting in [g for g in self._deferred if g.step is not group.step or g.index > group.index]:
            self._past_peak(waiting, missed=True)

    def _reload(self, targets: list[_Chunk]) -> None:
        """Copy storages back to the device on the reload stream."""
        copies = self._copies
        compute = copies.compute()
        try:
            # Allocated on the compute stream, which frees them: the reload stream waits for
            # everything queued there so far, so the memory is no longer in use.
            destinations = [torch.empty(c.nbytes, dtype=torch.uint8, device=c.device) for c in targets]
        except torch.cuda.OutOfMemoryError as e:
            need = sum(c.nbytes for c in targets)
            e.add_note(
                f"actcfg: out of GPU memory while reloading {need / 2**20:.0f} MiB of offloaded "
                "activations for backward. Checkpoint more modules (`checkpoint.modules`, "
                "`checkpoint.every: 1`) so fewer and smaller activations come back at once, or "
                "reduce the batch size."
            )
            raise
        copies.h2d.wait_stream(compute)
        for chunk in targets:
            if chunk.last_reader is not None:
                copies.h2d.wait_event(chunk.last_reader)  # its copy to the host
        with copies.on(copies.h2d):
            for chunk, gpu in zip(targets, destinations):
                gpu.copy_(chunk.host, non_blocking=chunk.pinned)
                # Held by the chunk, which dies with the last saved view of it: the reloaded
                # storage lives as long as backward still needs one of its views.
                chunk.reload_into(gpu)
                self._stats.copied_back(chunk.nbytes)
            done = copies.h2d.record_event()
        for chunk in targets:
            chunk.last_reader = done
            chunk.h2d_done = done
            # No record_stream on the destination: the compute stream, which allocated it and
            # frees it, waits for this copy before any view of it is used (`_unpack`), or when
            # the chunk dies unused (backward stopped early). With record_stream the allocator
            # frees it only once it sees the copy done, and backward's host thread runs ahead
            # of the GPU: on the H200 blocks stack 4 reloaded block inputs were still waiting
            # to be freed at checkpoint + cpu_checkpointing's peak.
            chunk.freed_on = compute

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every copy, then unpin and free the host pool (a shared pool is given back
        to its owner, buffers and all: each keeps the event its last copy recorded, which the
        next engine waits for). The engine cannot be used after."""
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        for progress in list(self._progress.values()):
            progress.remove()  # no hook of the engine's outlives it on the modules' parameters
        self._progress.clear()
        self._unpin_at_exit()


class _StepScope:
    """One forward pass under the engine's saved-tensor hooks. Entered and left outside
    torch.compile's graphs: dynamo breaks its graph here, and the forward inside is compiled."""

    def __init__(self, engine: OffloadEngine, inputs: Any = None) -> None:
        self.engine = engine
        self.inputs = inputs
        self.hooks: Any = None

    @torch.compiler.disable
    def __enter__(self) -> OffloadEngine:
        engine = self.engine
        engine._open_step(self.inputs)
        self.inputs = None  # held no longer than the step needs
        self.hooks = torch.autograd.graph.saved_tensors_hooks(engine._pack, engine._unpack)
        self.hooks.__enter__()
        return engine

    @torch.compiler.disable
    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self.hooks.__exit__(kind, value, tb)
        self.engine._end_step(judge=kind is None)


# The autograd node backward is running (None outside backward, or in a torch without it: then
# no reload waits for a signal, and the schedule is the one before GradProgress).
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)

# The copy windows, per `max_inflight` (forward) and per `prefetch` (backward), in the largest
# storage moved in a step. On the H200 blocks stack with everything offloaded (8 blocks, 16
# block inputs saved each): one storage kept the peak lowest but ran at 1.07-1.11x the transfer
# bound (compute waited on every copy); two ran at 1.02-1.03x; a whole group (the old schedule)
# at 1.02x with a whole second block held at the turn and in backward (peak 2.54 GiB, against
# 1.69 GiB with two storages and 0.88 GiB for torch's save_on_cpu).
WINDOW_STORAGES = 2

# How many storages backward holds reloaded ahead of their use, per `prefetch` (besides the
# bytes window above): each reloaded storage is freed as the backward op that unpacks its last
# view is done, so what a block's backward holds at once is the storages in use and these few,
# not the rest of the block brought back beside them. A bytes window alone (two of the largest
# storage) let a transformer block's small storages all come back at once while the MLP's wide
# ones were in use: on the CPU blocks stack (issue 17's 8 blocks, gradients freed each step)
# offloading everything peaked in block 0's GELU backward 7 block inputs above torch's
# save_on_cpu (which reloads a tensor as it is unpacked and holds nothing ahead), as on the
# H200 (2.002 against 1.563 GiB), and exactly at the checkpoint-every-block floor; two
# storages ahead hold 2 block inputs above save_on_cpu there (one storage: 1), and a reload
# still overlaps the backward of the op or two before its use.
RELOAD_STORAGES = 2

# A view is moved with its whole storage (q, k and v of one qkv projection travel as one
# storage) unless the storage is more than this many times larger than the view.
_MAX_STORAGE_OVER_VIEW = 4


def _modified_error(size: Any, dtype: torch.dtype) -> RuntimeError:
    # The same error autograd raises without hooks: a saved tensor changed in place after it was
    # saved, so its gradient would be computed from the wrong values.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: a saved tensor of shape {list(size)} and dtype {dtype} changed after it "
        "was saved (detected by actcfg's offload engine). Avoid the in-place operation "
        "(write `x = x + y`, not `x += y`)."
    )
