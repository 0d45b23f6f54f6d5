"""The offload engine: saved-tensor hooks that move activations to host memory off the compute stream.

What torch's `save_on_cpu` does per tensor, this does per group of tensors (a block), the way the
fastest offload runtimes do (../shared/reference/BACKENDS.md section 3):

* Forward. A packed tensor joins the open group and stays on the GPU. When the next group opens
  (`mark_group`, called at each block boundary), the previous group is copied to the host on a
  side stream, ordered after its producers by an event. At most `max_inflight` groups are in
  flight: past that the compute stream waits for the oldest copy, so GPU memory held per block
  stays flat. The last group of a forward never leaves the GPU: backward needs it first; at the
  end of forward the other groups' copies are waited for, so backward starts from that one.
* Backward. Unpacking a tensor of group g makes sure g is on the GPU, then starts the reload of the
  next offloaded group below g on a second side stream, so that copy overlaps g's backward.
* Host memory comes from a pool reused across steps: page-locked (pinned) buffers registered with
  `cudaHostRegister` at their exact size (torch's pinned allocator rounds every request up to a
  power of two), never more than `pin_budget` in total; past it, or if pinning fails, pageable
  buffers with one warning.
* Parameters, buffers and tensors under `min_offload_bytes` are never offloaded.

`unpack(pack(t))` equals `t` in value, size, dtype and device, as torch's hook contract asks.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from actcfg.errors import OffloadError

__all__ = ["OffloadEngine", "OffloadStats", "OffloadWarning"]


class OffloadWarning(UserWarning):
    """The engine had to depart from the policy (pageable instead of pinned memory)."""


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
    steps: int = 0
    """Forward passes run under the engine."""
    offloaded_bytes: int = 0
    """Bytes copied to the host in the last step."""
    offloaded_tensors: int = 0
    """Tensors copied to the host in the last step."""
    kept_bytes: int = 0
    """Bytes of the last group of the last step, kept on the GPU for backward."""
    reloaded_bytes: int = 0
    """Bytes copied back to the GPU in the last backward."""
    late_reloads: int = 0
    """Groups in the last backward whose reload was not prefetched (started only when needed)."""


class _HostPool:
    """Host buffers keyed by size, reused across steps; pinned ones bounded by a budget."""

    def __init__(self, pin: bool, pin_budget: int | None, stats: OffloadStats) -> None:
        self._pin = pin
        self._budget = pin_budget
        self._stats = stats
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None, bool]]] = {}
        self._registered: list[torch.Tensor] = []
        self._pin_failed = False
        self._warned = False
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None, bool]:
        """A uint8 host buffer of `nbytes`, the event its last reader recorded, and whether it is pinned."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        buffer = self._new_pinned(nbytes) if self._pin else None
        if buffer is not None:
            return buffer, None, True
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._stats.pageable_bytes += nbytes
        return buffer, None, False

    def release(self, buffer: torch.Tensor, event: torch.cuda.Event | None, pinned: bool) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, event, pinned))

    def _new_pinned(self, nbytes: int) -> torch.Tensor | None:
        over_budget = self._budget is not None and self._stats.pinned_bytes + nbytes > self._budget
        if over_budget or self._pin_failed:
            self._fall_back(
                f"pin_budget ({self._budget} bytes) is reached" if over_budget
                else "pinning host memory failed earlier"
            )
            return None
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        try:
            self._register(buffer)
        except (RuntimeError, OSError) as e:
            self._pin_failed = True
            self._fall_back(f"pinning {nbytes} bytes of host memory failed ({e})")
            return None
        self._registered.append(buffer)
        self._stats.pinned_bytes += nbytes
        self._stats.pinned_allocations += 1
        return buffer

    def _register(self, buffer: torch.Tensor) -> None:
        # cudaHostRegister pins exactly these bytes; torch's caching host allocator would round
        # the request up to a power of two (vllm-project/vllm#56410), up to 2x over the budget.
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned error {int(err)}")

    def _fall_back(self, why: str) -> None:
        self._stats.pinned_fallbacks += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"actcfg offload: {why}; offloading into pageable host memory from here on, "
                "which copies several times slower. Raise `pin_budget` (or free host memory) "
                "to keep every offload pinned.",
                OffloadWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        """Unpin and drop every buffer. The caller makes sure no copy is in flight."""
        with self._lock:
            if not self._registered:
                return
            torch.cuda.synchronize()  # no copy may still touch a buffer we unpin
            cudart = torch.cuda.cudart()
            for buffer in self._registered:
                cudart.cudaHostUnregister(buffer.data_ptr())
            self._registered.clear()
            self._free.clear()


class _Kept:
    """A saved tensor that stays where it is (small, a parameter, or not on the GPU)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        # detach(): holding the tensor with its grad_fn would make a reference cycle through
        # the graph that saved it.
        self.tensor = tensor.detach()


class _Step:
    """One forward pass: its groups in order (weakly: a group dies with its saved tensors)."""

    def __init__(self) -> None:
        self.groups: list[weakref.ref[_Group]] = []


class _Group:
    """The tensors saved between two block boundaries; they travel together."""

    def __init__(self, step: _Step, index: int) -> None:
        self.step = step
        self.index = index
        self.handles: list[weakref.ref[_Saved]] = []
        self.offloaded = False  # copies to the host were launched
        self.kept = False  # last group of its forward: never offloaded
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None


class _Saved:
    """What autograd keeps for one offloadable tensor: the GPU copy until the host copy is safe."""

    __slots__ = (
        "__weakref__", "group", "size", "stride", "dtype", "device", "nbytes", "dense",
        "version", "gpu", "host", "buffer", "pinned", "reloaded", "modified", "pool", "last_reader",
    )

    def __init__(self, tensor: torch.Tensor, group: _Group, pool: _HostPool) -> None:
        self.group = group
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dense = _is_dense(tensor)
        self.version = tensor._version
        self.gpu: torch.Tensor | None = tensor.detach()
        self.host: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self.reloaded: torch.Tensor | None = None
        self.modified = False
        self.pool = pool
        self.last_reader: torch.cuda.Event | None = None

    def host_view(self, buffer: torch.Tensor) -> torch.Tensor:
        typed = buffer.view(self.dtype)
        if self.dense:  # keep the layout, so the reload has the saved strides
            return typed.as_strided(self.size, self.stride)
        return typed.view(self.size)

    def __del__(self) -> None:
        # The graph that saved this tensor is gone: its host buffer can serve the next step,
        # once the last copy that reads or writes it has finished.
        if getattr(self, "buffer", None) is not None:
            try:
                self.pool.release(self.buffer, self.last_reader, self.pinned)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass


class OffloadEngine:
    """Offloads saved activations of a forward pass to host memory and prefetches them for backward.

    Use `step()` around one forward pass and `mark_group()` at each block boundary inside it;
    the runtime (`actcfg.apply`) does both. Without any `mark_group()` every tensor stays in the
    one (last) group, and nothing is offloaded.
    """

    def __init__(
        self,
        *,
        pin: bool = True,
        pin_budget: int | None = None,
        min_offload_bytes: int = 1 << 20,
        max_inflight: int = 1,
        prefetch: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise OffloadError(
                "cpu_checkpointing needs a CUDA GPU: activations are offloaded from GPU memory "
                "to the host. On the CPU set `cpu_checkpointing: false`."
            )
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.min_offload_bytes = min_offload_bytes
        self.max_inflight = max_inflight
        self.prefetch = prefetch
        self._stats = OffloadStats()
        self._pool = _HostPool(pin, pin_budget, self._stats)
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._skip_modules: list[weakref.ref[nn.Module]] = []
        self._skip_storages: set[int] = set()
        self._step: _Step | None = None
        self._open: _Group | None = None
        self._inflight: deque[_Group] = deque()
        self._dedupe: dict[tuple, _Saved] = {}
        self._closed = False
        # Unpin the pool even if close() is never called: freed memory must not stay registered.
        self._unpin_at_exit = weakref.finalize(self, self._pool.close)

    # --- configuration -----------------------------------------------------------------

    def skip_tensors_of(self, module: nn.Module) -> None:
        """Never offload `module`'s parameters and buffers (nor views of them)."""
        self._skip_modules.append(weakref.ref(module))

    @property
    def stats(self) -> OffloadStats:
        """Counters of what the engine did (see `OffloadStats`)."""
        return self._stats

    # --- forward ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[OffloadEngine]:
        """Offload what autograd saves inside this block; the last group stays on the GPU."""
        if self._closed:
            raise OffloadError("this offload engine was closed (the policy was removed)")
        if self._step is not None:
            raise OffloadError("offload steps do not nest: a forward pass is already being offloaded")
        self._begin_step()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._end_step()

    def mark_group(self) -> None:
        """A block boundary: start offloading the group saved so far, open a new one."""
        if self._step is None:
            return
        # Room for the group about to leave: at most `max_inflight` copies run at once, which
        # bounds the GPU memory held above flat to that many groups.
        self._retire(keep=self.max_inflight - 1)
        group, self._open = self._open, self._new_group()
        if group is not None and any(ref() is not None for ref in group.handles):
            self._launch_offload(group)

    def _begin_step(self) -> None:
        # Whatever an earlier step left in flight (a forward that raised, say) is settled first.
        self._retire(keep=0)
        self._skip_storages = {
            t.untyped_storage().data_ptr()
            for ref in self._skip_modules
            if (m := ref()) is not None
            for t in (*m.parameters(), *m.buffers())
        }
        st = self._stats
        st.steps += 1
        st.offloaded_bytes = st.offloaded_tensors = st.kept_bytes = 0
        st.reloaded_bytes = st.late_reloads = 0
        self._step = _Step()
        self._open = self._new_group()
        self._dedupe = {}

    def _end_step(self) -> None:
        # Only the last group stays on the GPU: the copies still in flight are waited for (on
        # the compute stream) and their GPU memory released, so backward starts from one block.
        self._retire(keep=0)
        group = self._open
        if group is not None:
            group.kept = True
            self._stats.kept_bytes = sum(h.nbytes for ref in group.handles if (h := ref()) is not None)
        self._step = self._open = None
        self._dedupe = {}

    def _new_group(self) -> _Group:
        group = _Group(self._step, len(self._step.groups))
        self._step.groups.append(weakref.ref(group))
        return group

    def _pack(self, tensor: torch.Tensor) -> _Saved | _Kept:
        nbytes = tensor.numel() * tensor.element_size()
        if (
            tensor.device.type != "cuda"
            or nbytes < self.min_offload_bytes
            or tensor.untyped_storage().data_ptr() in self._skip_storages
        ):
            return _Kept(tensor)
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.size(),
               tensor.stride(), tensor.dtype, tensor._version)
        saved = self._dedupe.get(key)
        if saved is not None and saved.gpu is not None:
            return saved  # the same tensor saved twice (e.g. by two ops): one copy serves both
        saved = _Saved(tensor, self._open, self._pool)
        self._open.handles.append(weakref.ref(saved))
        self._dedupe[key] = saved
        return saved

    def _launch_offload(self, group: _Group) -> None:
        compute = torch.cuda.current_stream(self.device)
        self._d2h.wait_stream(compute)  # the producers of this group's tensors come first
        st = self._stats
        with torch.cuda.stream(self._d2h):
            for ref in group.handles:
                saved = ref()
                if saved is None or saved.gpu is None:
                    continue
                if saved.gpu._version != saved.version:
                    saved.modified = True
                buffer, last_reader, pinned = self._pool.acquire(saved.nbytes)
                if last_reader is not None:
                    self._d2h.wait_event(last_reader)  # the reload that last read this buffer
                saved.buffer, saved.pinned = buffer, pinned
                saved.host = saved.host_view(buffer)
                saved.host.copy_(saved.gpu, non_blocking=pinned)
                st.offloaded_bytes += saved.nbytes
                st.offloaded_tensors += 1
            group.d2h_done = self._d2h.record_event()
        for ref in group.handles:
            if (saved := ref()) is not None:
                saved.last_reader = group.d2h_done
        group.offloaded = True
        self._inflight.append(group)

    def _retire(self, *, keep: int) -> None:
        """Drop the GPU copies of groups whose host copy is done, then wait (on the compute
        stream, not the host) for the oldest copies until at most `keep` groups are in flight."""
        compute = torch.cuda.current_stream(self.device)
        while self._inflight:
            group = self._inflight[0]
            if not group.d2h_done.query():
                if len(self._inflight) <= keep:
                    break
                # Later compute-stream work may reuse this memory only after the copy has read it.
                compute.wait_event(group.d2h_done)
            self._inflight.popleft()
            for ref in group.handles:
                saved = ref()
                if saved is not None and saved.gpu is not None:
                    if saved.gpu._version != saved.version:
                        saved.modified = True
                    saved.gpu = None

    # --- backward -------------------------------------------------------------------------

    def _unpack(self, packed: _Saved | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        saved = packed
        group = saved.group
        self._prefetch_below(group)
        if saved.gpu is not None:  # kept, or its copy was still in flight: no reload needed
            if saved.gpu._version != saved.version or saved.modified:
                raise _modified_error(saved)
            return saved.gpu
        if saved.modified:
            raise _modified_error(saved)
        reloaded = saved.reloaded
        if reloaded is None:
            if group.h2d_done is None:
                self._stats.late_reloads += 1
            self._reload(group, only=None if group.h2d_done is None else saved)
            reloaded = saved.reloaded
        torch.cuda.current_stream(self.device).wait_event(group.h2d_done)
        # Drop our reference: the tensor lives as long as autograd needs it, no longer.
        saved.reloaded = None
        return reloaded

    def _prefetch_below(self, group: _Group) -> None:
        groups = group.step.groups
        wanted = self.prefetch
        for i in range(group.index - 1, -1, -1):
            if wanted <= 0:
                return
            below = groups[i]()
            if below is None or not below.offloaded:
                continue
            if below.h2d_done is None:
                self._reload(below)
            wanted -= 1

    def _reload(self, group: _Group, only: _Saved | None = None) -> None:
        """Copy a group (or one tensor of it) back to the GPU on the reload stream."""
        compute = torch.cuda.current_stream(self.device)
        targets = [only] if only is not None else [s for r in group.handles if (s := r()) is not None]
        targets = [s for s in targets if s.gpu is None and s.host is not None and s.reloaded is None]
        try:
            # Allocated on the compute stream, which frees them: the reload stream waits for
            # everything queued there so far, so the memory is no longer in use.
            destinations = [
                torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=s.device) if s.dense
                else torch.empty(s.size, dtype=s.dtype, device=s.device)
                for s in targets
            ]
        except torch.cuda.OutOfMemoryError as e:
            need = sum(s.nbytes for s in targets)
            raise OffloadError(
                f"out of GPU memory while reloading {need / 2**20:.0f} MiB of offloaded activations "
                "for backward. Checkpoint more modules (`checkpoint.modules`, `checkpoint.every: 1`) "
                "so fewer and smaller activations come back at once, or reduce the batch size."
            ) from e
        self._h2d.wait_stream(compute)
        if group.d2h_done is not None:
            self._h2d.wait_event(group.d2h_done)
        with torch.cuda.stream(self._h2d):
            for saved, gpu in zip(targets, destinations):
                gpu.copy_(saved.host, non_blocking=saved.pinned)
                saved.reloaded = gpu
                self._stats.reloaded_bytes += saved.nbytes
            done = self._h2d.record_event()
        for saved in targets:
            saved.last_reader = done
        if only is None or group.h2d_done is None:
            group.h2d_done = done
        else:
            # A single late tensor: make its group's event cover it too.
            self._h2d.wait_event(group.h2d_done)
            group.h2d_done = self._h2d.record_event()

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every copy, then unpin and free the host pool. The engine cannot be used after."""
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        self._unpin_at_exit()


def _is_dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly once in some dimension order (a permuted
    contiguous tensor): then a host copy can keep its strides."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.size(), t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _modified_error(saved: _Saved) -> RuntimeError:
    # The same error autograd raises without hooks: a saved tensor changed in place after it was
    # saved, so its gradient would be computed from the wrong values.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: a saved tensor of shape {list(saved.size)} and dtype {saved.dtype} changed "
        "after it was saved (detected by actcfg's offload engine). Avoid the in-place operation "
        "(write `x = x + y`, not `x += y`)."
    )
