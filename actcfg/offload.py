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
* A saved view travels with its whole storage (q, k and v of one projection are one copy), and
  is rebuilt on the reloaded storage with its own strides and offset: `unpack(pack(t))` equals
  `t` in value, size, dtype and device, as torch's hook contract asks, and in layout too. That
  last part is not cosmetic: on an H200 (torch 2.11), bf16 transformer blocks whose saved q/k/v
  views came back contiguous got gradients 14% off the plain run's, every step (this engine's
  first version); torch's `save_on_cpu`, which also returns them contiguous, was 17% off in one
  run of several. With the layout kept, the error is the plain run's own run-to-run noise.
* Parameters, buffers and tensors under `min_offload_bytes` are never offloaded.
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
    """Storages copied to the host in the last step (views of one storage travel together)."""
    kept_bytes: int = 0
    """Bytes of the last group of the last step, kept on the GPU for backward."""
    reloaded_bytes: int = 0
    """Bytes copied back to the GPU in the last backward."""
    late_reloads: int = 0
    """Storages in the last backward whose reload was not prefetched (started only when needed)."""
    kept_views: int = 0
    """Saved views of a storage over 4x their size, left on the GPU in the last step."""


class _HostPool:
    """Host buffers reused across steps, served best-fit by size; pinned ones bounded by a budget.

    A request takes the smallest free buffer that holds it and is at most twice its size (an
    exact fit when shapes repeat, as they do step after step); only a miss allocates. With shapes
    that vary from step to step the pool can still grow past one step's need: `pin_budget`
    bounds the pinned part.
    """

    def __init__(self, pin: bool, pin_budget: int | None, stats: OffloadStats) -> None:
        self._pin = pin
        self._budget = pin_budget
        self._stats = stats
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None, bool]]] = {}
        self._registered: list[torch.Tensor] = []
        self._pin_failed = False
        self._warned = False
        # Reentrant: a chunk's __del__ (which releases its buffer) can run from garbage
        # collection in the middle of acquire() on the same thread.
        self._lock = threading.RLock()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None, bool]:
        """A uint8 host buffer of at least `nbytes`, the event its last reader recorded, and
        whether it is pinned. Use its first `nbytes`; release the whole buffer."""
        with self._lock:
            fits = [size for size, free in self._free.items() if free and nbytes <= size <= 2 * nbytes]
            if fits:
                return self._free[min(fits)].pop()
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
    """The storages saved between two block boundaries; they travel together."""

    def __init__(self, step: _Step, index: int) -> None:
        self.step = step
        self.index = index
        self.chunks: list[weakref.ref[_Chunk]] = []
        self.offloaded = False  # copies to the host were launched
        self.kept = False  # last group of its forward: never offloaded
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None

    def live(self) -> list[_Chunk]:
        return [c for ref in self.chunks if (c := ref()) is not None]


class _Chunk:
    """One GPU storage that saved tensors view, moved as a whole: its bytes go to the host and
    come back in one copy, and every view is rebuilt on the reloaded storage with its own
    size, strides and offset, so the unpacked tensor is laid out exactly like the saved one.
    (Layout matters: a backward kernel may be built for the strides it saw in forward.)"""

    __slots__ = (
        "__weakref__", "group", "device", "nbytes", "gpu", "host", "buffer", "pinned", "reloaded",
        "pool", "last_reader", "views",
    )

    def __init__(self, tensor: torch.Tensor, group: _Group, pool: _HostPool) -> None:
        storage = tensor.untyped_storage()
        self.group = group
        self.device = tensor.device
        self.nbytes = storage.nbytes()
        # uint8 over the whole storage: holds it alive until the host copy is safe
        self.gpu: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.host: torch.Tensor | None = None  # the first nbytes of `buffer`
        self.buffer: torch.Tensor | None = None  # the pool's buffer, returned whole
        self.pinned = False
        self.reloaded: torch.Tensor | None = None
        self.pool = pool
        self.last_reader: torch.cuda.Event | None = None
        self.views: list[weakref.ref[_Saved]] = []

    def release_gpu(self) -> None:
        """Drop every GPU reference to the storage (the caller has made its reuse safe)."""
        for ref in self.views:
            if (saved := ref()) is not None:
                saved.check_version()
                saved.view = None
        self.gpu = None

    def __del__(self) -> None:
        # Every saved view of this storage is gone: its host buffer can serve the next step,
        # once the last copy that reads or writes it has finished.
        if getattr(self, "buffer", None) is not None:
            try:
                self.pool.release(self.buffer, self.last_reader, self.pinned)
            except Exception:  # interpreter shutdown: the pool may be gone already
                pass


class _Saved:
    """What autograd keeps for one offloaded tensor: which chunk, and how to view it."""

    __slots__ = ("__weakref__", "chunk", "size", "stride", "offset", "dtype", "version", "view", "modified")

    def __init__(self, tensor: torch.Tensor, chunk: _Chunk) -> None:
        self.chunk = chunk
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.dtype = tensor.dtype
        self.version = tensor._version
        # The saved view itself, while its storage is on the GPU: in-place changes show here.
        self.view: torch.Tensor | None = tensor.detach()
        self.modified = False

    def on(self, storage_bytes: torch.Tensor) -> torch.Tensor:
        """This view, rebuilt over a uint8 tensor holding the whole storage."""
        return torch.empty(0, dtype=self.dtype, device=storage_bytes.device).set_(
            storage_bytes.untyped_storage(), self.offset, self.size, self.stride
        )

    def check_version(self) -> None:
        if self.view is not None and self.view._version != self.version:
            self.modified = True


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
        self._chunks: dict[int, _Chunk] = {}
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
        if group is not None and group.live():
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
        st.reloaded_bytes = st.late_reloads = st.kept_views = 0
        self._step = _Step()
        self._open = self._new_group()
        self._chunks = {}

    def _end_step(self) -> None:
        # Only the last group stays on the GPU: the copies still in flight are waited for (on
        # the compute stream) and their GPU memory released, so backward starts from one block.
        self._retire(keep=0)
        group = self._open
        if group is not None:
            group.kept = True
            self._stats.kept_bytes = sum(c.nbytes for c in group.live())
        self._step = self._open = None
        self._chunks = {}

    def _new_group(self) -> _Group:
        group = _Group(self._step, len(self._step.groups))
        self._step.groups.append(weakref.ref(group))
        return group

    def _pack(self, tensor: torch.Tensor) -> _Saved | _Kept:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda" or nbytes < self.min_offload_bytes:
            return _Kept(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._skip_storages:
            return _Kept(tensor)
        chunk = self._chunks.get(ptr)
        if chunk is None or chunk.gpu is None or chunk.nbytes != storage.nbytes():
            if storage.nbytes() > _MAX_STORAGE_OVER_VIEW * nbytes:
                # A small view of a large storage: moving the storage would move mostly other
                # data, and a copy of the view alone would change its layout. It stays.
                self._stats.kept_views += 1
                return _Kept(tensor)
            chunk = _Chunk(tensor, self._open, self._pool)
            self._open.chunks.append(weakref.ref(chunk))
            self._chunks[ptr] = chunk
        saved = _Saved(tensor, chunk)
        chunk.views.append(weakref.ref(saved))
        return saved

    def _launch_offload(self, group: _Group) -> None:
        compute = torch.cuda.current_stream(self.device)
        self._d2h.wait_stream(compute)  # the producers of this group's tensors come first
        st = self._stats
        chunks = [c for c in group.live() if c.gpu is not None]
        with torch.cuda.stream(self._d2h):
            for chunk in chunks:
                for ref in chunk.views:
                    if (saved := ref()) is not None:
                        saved.check_version()
                buffer, last_reader, pinned = self._pool.acquire(chunk.nbytes)
                if last_reader is not None:
                    self._d2h.wait_event(last_reader)  # the reload that last read this buffer
                host = buffer[: chunk.nbytes]
                host.copy_(chunk.gpu, non_blocking=pinned)
                chunk.host, chunk.buffer, chunk.pinned = host, buffer, pinned
                st.offloaded_bytes += chunk.nbytes
                st.offloaded_tensors += 1
            group.d2h_done = self._d2h.record_event()
        for chunk in chunks:
            chunk.last_reader = group.d2h_done
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
            for chunk in group.live():
                if chunk.host is not None:
                    chunk.release_gpu()

    # --- backward -------------------------------------------------------------------------

    def _unpack(self, packed: _Saved | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        saved = packed
        chunk = saved.chunk
        self._prefetch_below(chunk.group)
        saved.check_version()
        if saved.modified:
            raise _modified_error(saved)
        if saved.view is not None:  # the last group: it never left the GPU
            return saved.view
        if chunk.reloaded is None:
            if chunk.group.h2d_done is None:
                self._stats.late_reloads += 1
            self._reload(chunk.group, only=chunk)
        torch.cuda.current_stream(self.device).wait_event(chunk.group.h2d_done)
        return saved.on(chunk.reloaded)

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

    def _reload(self, group: _Group, only: _Chunk | None = None) -> None:
        """Copy a group's chunks (or one chunk) back to the GPU on the reload stream."""
        compute = torch.cuda.current_stream(self.device)
        targets = [only] if only is not None else group.live()
        targets = [c for c in targets if c.gpu is None and c.host is not None and c.reloaded is None]
        try:
            # Allocated on the compute stream, which frees them: the reload stream waits for
            # everything queued there so far, so the memory is no longer in use.
            destinations = [torch.empty(c.nbytes, dtype=torch.uint8, device=c.device) for c in targets]
        except torch.cuda.OutOfMemoryError as e:
            need = sum(c.nbytes for c in targets)
            raise OffloadError(
                f"out of GPU memory while reloading {need / 2**20:.0f} MiB of offloaded activations "
                "for backward. Checkpoint more modules (`checkpoint.modules`, `checkpoint.every: 1`) "
                "so fewer and smaller activations come back at once, or reduce the batch size."
            ) from e
        self._h2d.wait_stream(compute)
        if group.d2h_done is not None:
            self._h2d.wait_event(group.d2h_done)
        if group.h2d_done is not None:
            self._h2d.wait_event(group.h2d_done)  # one event keeps covering the whole group
        with torch.cuda.stream(self._h2d):
            for chunk, gpu in zip(targets, destinations):
                gpu.copy_(chunk.host, non_blocking=chunk.pinned)
                # If the chunk dies before any view of it is unpacked (backward stopped early),
                # its memory goes back to the compute stream: make that wait for this copy.
                gpu.record_stream(self._h2d)
                # Held by the chunk, which dies with the last saved view of it: the reloaded
                # storage lives as long as backward still needs one of its views.
                chunk.reloaded = gpu
                self._stats.reloaded_bytes += chunk.nbytes
            done = self._h2d.record_event()
        for chunk in targets:
            chunk.last_reader = done
        group.h2d_done = done

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every copy, then unpin and free the host pool. The engine cannot be used after."""
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        self._unpin_at_exit()


# A view is moved with its whole storage (q, k and v of one qkv projection travel as one
# storage) unless the storage is more than this many times larger than the view.
_MAX_STORAGE_OVER_VIEW = 4


def _modified_error(saved: _Saved) -> RuntimeError:
    # The same error autograd raises without hooks: a saved tensor changed in place after it was
    # saved, so its gradient would be computed from the wrong values.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: a saved tensor of shape {list(saved.size)} and dtype {saved.dtype} changed "
        "after it was saved (detected by actcfg's offload engine). Avoid the in-place operation "
        "(write `x = x + y`, not `x += y`)."
    )
