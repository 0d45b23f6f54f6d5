"""The offload engine's host memory: buffers reused across steps, pinned within a budget.

Page-locked buffers are registered with `cudaHostRegister` at their exact size (torch's pinned
allocator rounds every request up to a power of two), never more than `pin_budget` in total
nor more than this process's part of `pin_budget_per_node`; past either, or if pinning fails,
pageable buffers with one warning. Buffers are prepared ahead of need on one background thread.
Engines that run one after another (the planner's offload trials) can share one pool
(`shared_host_pool`), so what one pinned the next reuses.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from actcfg.runtime.host_budget import NodeBudget
from actcfg.runtime.offload_stats import OffloadStats, OffloadWarning

__all__ = ["HostPool", "borrow_shared_pool", "shared_host_pool"]


class HostPool:
    """Host buffers reused across steps, served best-fit by size; pinned ones bounded by a budget.

    A request takes the smallest free buffer that holds it and is at most twice its size (an
    exact fit when shapes repeat, as they do step after step); only a miss allocates. With shapes
    that vary from step to step the pool can still grow past one step's need: `pin_budget`
    bounds the pinned part.

    Growing it off the critical path. A fresh buffer is slow to make: every page faults in on
    first touch, and `cudaHostRegister` on untouched pages faults them in while it holds the
    driver's lock (torch's own host allocator touches the pages first for that reason:
    ATen/cuda/CachingHostAllocator.cpp, `allocWithCudaHostRegister`). With every buffer pinned
    on the spot inside the copy launch, a first step at 16k tokens on an H200 (3B Llama,
    checkpoint + offload) took 1.96 s against 1.24 s for HF checkpointing's (issue 23). A step's
    offloads repeat their sizes block after block, so a size missed twice predicts a third: the
    pool then prepares one *spare* of that size on a background thread (pages touched, then
    registered) while the next block computes, and the request that takes a spare (with no
    other free buffer of its size left) orders the next one. So the first step
    pins two buffers per repeating size on demand and the rest ahead; a later step finds every
    buffer free and orders nothing. What this costs: one unused spare per repeating size after
    the pool has grown (about one block's offload), counted in `pinned_bytes` like any buffer.
    Spares give way to requests under `pin_budget` (an unused spare is unpinned to make room),
    and a spare that cannot be pinned is dropped without a warning (the request that finds the
    pinning failed warns). Preparing runs for pageable buffers too (touching pages is most of
    their cost), which is how the host loopback exercises it.
    """

    def __init__(self, pin: bool, pin_budget: int | None, stats: OffloadStats,
                 node: NodeBudget | None = None, register: bool = True) -> None:
        self._pin = pin
        self._budget = pin_budget
        self._node = node  # this process's account of pin_budget_per_node
        self._register_buffers = register  # False on the host loopback: counted, not registered
        self._stats = stats
        self._free: dict[int, list[tuple[torch.Tensor, Any, bool]]] = {}
        self._registered: list[torch.Tensor] = []
        self._pin_failed = False
        self._pin_error = ""
        self._warned = False
        self._misses: dict[int, int] = {}  # on-demand allocations per size
        self._spares: set[int] = set()  # data_ptrs of prepared buffers no request has taken yet
        # size -> every buffer of it ordered and not yet made (`prepare` orders several), in
        # order: the first is the one a request of that size waits for
        self._queued: dict[int, deque[concurrent.futures.Future[None]]] = {}
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._borrowed = False  # a shared pool (`shared_host_pool`) lent to an engine now
        # Reentrant: a chunk's __del__ (which releases its buffer) can run from garbage
        # collection in the middle of acquire() on the same thread.
        self._lock = threading.RLock()

    @property
    def stats(self) -> OffloadStats:
        """The counters the pool writes its holdings and growth into (its engine's)."""
        return self._stats

    def lend(self, stats: OffloadStats) -> None:
        """Count into `stats` from here on (the engine that borrows a shared pool now), with what
        the pool holds and has done carried over: the budget goes on counting every byte it
        pinned, and the engine's report shows the pool it really uses."""
        with self._lock:
            for name in _POOL_COUNTERS:
                setattr(stats, name, getattr(self._stats, name))
            self._stats = stats
            self._borrowed = True

    def give_back(self) -> None:
        """The borrowing engine is done (closed): its buffers stay for the next engine."""
        with self._lock:
            self._borrowed = False

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Any, bool]:
        """A uint8 host buffer of at least `nbytes`, the event its last reader recorded, and
        whether it is pinned. Use its first `nbytes`; release the whole buffer."""
        waited = 0.0
        while True:
            with self._lock:
                entry = self._take(nbytes)
                if entry is not None:
                    self._stats.host_wait_s += waited
                    return entry
                # A spare that fits is on its way: waiting for the rest of its preparation is
                # never slower than starting a buffer of our own (and pins nothing twice).
                coming = next((q[0] for size, q in self._queued.items() if nbytes <= size <= 2 * nbytes), None)
            if coming is None:
                break
            t0 = time.perf_counter()
            concurrent.futures.wait([coming])
            waited += time.perf_counter() - t0
        t0 = time.perf_counter()
        buffer = self._new_pinned(nbytes) if self._pin else None
        pinned = buffer is not None
        if buffer is None:
            buffer = _touched(nbytes)
            self._stats.pageable_bytes += nbytes
        self._stats.host_buffers_on_demand += 1
        self._stats.host_wait_s += waited + time.perf_counter() - t0
        with self._lock:
            self._misses[nbytes] = self._misses.get(nbytes, 0) + 1
            if self._misses[nbytes] >= 2:  # this size repeats: the next request for it is likely
                self._order_spare(nbytes)
        return buffer, None, pinned

    def _take(self, nbytes: int) -> tuple[torch.Tensor, Any, bool] | None:
        """The best-fitting free buffer, or None; taking the last spare of a size orders the next.
        The caller holds the lock."""
        fits = [size for size, free in self._free.items() if free and nbytes <= size <= 2 * nbytes]
        if not fits:
            return None
        size = min(fits)
        entry = self._free[size].pop()
        ptr = entry[0].data_ptr()
        if ptr in self._spares:
            self._spares.discard(ptr)
            # Only while the pool is short of this size: a step that finds its buffers free
            # (every step after the first at a length) takes no spare or leaves others free.
            if not self._free[size]:
                self._order_spare(size)
        return entry

    def prepare(self, sizes: Iterable[int]) -> None:
        """Make a buffer of each of `sizes` on the background thread, in order, ahead of a run
        known to need them: spares like those the pool orders itself, within the budget, and
        unpinned to make room for a request past it."""
        with self._lock:
            for nbytes in sizes:
                self._order_spare(nbytes, more=True)

    def _order_spare(self, nbytes: int, more: bool = False) -> None:
        """Prepare one buffer of `nbytes` on the background thread, unless one is on its way
        (`more`: even then) or the budget has no room for it (a spare is a guess; it never
        pushes a request past the budget). The caller holds the lock."""
        if self._closed or (nbytes in self._queued and not more):
            return
        pinned = self._pin and not self._pin_failed
        if pinned:
            if self._budget is not None and self._stats.pinned_bytes + nbytes > self._budget:
                return
            if self._node is not None and not self._node.reserve(nbytes):
                return  # the node has no room for a guess; a request will say so if it needs it
            self._stats.pinned_bytes += nbytes  # reserved now, so the budget sees it at once
            self._stats.pinned_allocations += 1
        else:
            self._stats.pageable_bytes += nbytes
        self._stats.host_buffers_ahead += 1
        if self._worker is None:
            # One thread: registrations serialize on the driver's lock anyway, and one worker
            # keeps the spares in the order they were ordered.
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="actcfg-host-pool")
        # The device the engine copies on (acquire runs under its copy stream, which makes it
        # current): a new thread's current device is 0, and a CUDA call there would create a
        # context on GPU 0 for every rank of a job that does not mask devices.
        device = torch.cuda.current_device() if pinned and torch.cuda.is_available() else None
        # Under the lock: `_prepare` reads the queue only once this call has left it.
        self._queued.setdefault(nbytes, deque()).append(
            self._worker.submit(self._prepare, nbytes, pinned, device))

    def _made(self, nbytes: int) -> None:
        """One buffer of `nbytes` ordered is made (or failed): a request of that size now waits
        for the next one, if any. The caller holds the lock."""
        queue = self._queued.get(nbytes)
        if queue:
            queue.popleft()  # this job's own future: the one worker runs them in order
        if not queue:
            self._queued.pop(nbytes, None)

    def _prepare(self, nbytes: int, pinned: bool, device: int | None) -> None:
        """On the background thread: make a spare and put it in the free list."""
        buffer = _touched(nbytes)
        if pinned:
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # this thread's current device only
                if self._register_buffers:
                    self._register(buffer)
            except (RuntimeError, OSError) as e:
                if self._node is not None:
                    self._node.release(nbytes)
                with self._lock:
                    self._stats.pinned_bytes -= nbytes
                    self._stats.pinned_allocations -= 1
                    self._pin_failed, self._pin_error = True, str(e)
                    self._made(nbytes)
                return
        with self._lock:
            self._made(nbytes)
            if self._closed:  # close() ran meanwhile: nothing may stay registered
                if pinned:
                    self._unregister(buffer)
                    if self._node is not None:
                        self._node.release(nbytes)
                return
            if pinned and self._register_buffers:
                self._registered.append(buffer)
            self._free.setdefault(nbytes, []).append((buffer, None, pinned))
            self._spares.add(buffer.data_ptr())

    def release(self, buffer: torch.Tensor, event: Any, pinned: bool) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, event, pinned))

    def _new_pinned(self, nbytes: int) -> torch.Tensor | None:
        if self._budget is not None and self._stats.pinned_bytes + nbytes > self._budget:
            self._drop_spares(nbytes)
        over_budget = self._budget is not None and self._stats.pinned_bytes + nbytes > self._budget
        if over_budget or self._pin_failed:
            self._fall_back(
                f"pin_budget ({self._budget} bytes) is reached" if over_budget
                else f"pinning host memory failed earlier ({self._pin_error})" if self._pin_error
                else "pinning host memory failed earlier"
            )
            return None
        node = self._node
        if node is not None and not node.reserve(nbytes):
            held, ranks = node.node_held()
            self._fall_back(f"pin_budget_per_node ({node.budget} bytes) is reached: {ranks} ranks "
                            f"of this job hold {held} bytes pinned on this node",
                            "pin_budget_per_node")
            return None
        buffer = _touched(nbytes)  # pages faulted in here, not under the driver's lock
        try:
            if self._register_buffers:
                self._register(buffer)
        except (RuntimeError, OSError) as e:
            if node is not None:
                node.release(nbytes)
            self._pin_failed = True
            self._fall_back(f"pinning {nbytes} bytes of host memory failed ({e})")
            return None
        with self._lock:
            if self._register_buffers:
                self._registered.append(buffer)
            self._stats.pinned_bytes += nbytes
            self._stats.pinned_allocations += 1
        return buffer

    def _drop_spares(self, nbytes: int) -> None:
        """Unpin unused spares (largest first) until `nbytes` more fit the budget: a guess never
        costs a request its pinned memory."""
        with self._lock:
            pending = [f for queue in self._queued.values() for f in queue]
        concurrent.futures.wait(pending)  # their bytes are reserved
        with self._lock:
            for size in sorted(self._free, reverse=True):
                for entry in [e for e in self._free[size] if e[0].data_ptr() in self._spares and e[2]]:
                    if self._stats.pinned_bytes + nbytes <= self._budget:
                        return
                    # by identity: list.remove would compare tensors elementwise
                    self._free[size] = [e for e in self._free[size] if e is not entry]
                    self._spares.discard(entry[0].data_ptr())
                    self._registered = [b for b in self._registered if b is not entry[0]]
                    self._unregister(entry[0])  # never used by a copy: nothing reads it
                    if self._node is not None:
                        self._node.release(size)
                    self._stats.pinned_bytes -= size

    def _register(self, buffer: torch.Tensor) -> None:
        # cudaHostRegister pins exactly these bytes; torch's caching host allocator would round
        # the request up to a power of two (vllm-project/vllm#56410), up to 2x over the budget.
        # Portable: pinned for every context, whichever device this thread has current (the
        # background thread has none of its own).
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned error {int(err)}")

    def _unregister(self, buffer: torch.Tensor) -> None:
        if self._register_buffers:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

    def _fall_back(self, why: str, knob: str = "pin_budget") -> None:
        self._stats.pinned_fallbacks += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"actcfg offload: {why}; offloading into pageable host memory from here on, "
                f"which copies several times slower. Raise `{knob}` (or free host memory) "
                "to keep every offload pinned.",
                OffloadWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        """Unpin and drop every buffer. The caller makes sure no copy is in flight."""
        with self._lock:
            self._closed = True  # a spare still in preparation unpins itself
            worker, self._worker = self._worker, None
        if worker is not None:
            # Not from the worker itself (a finalizer may run there): it sees _closed.
            on_worker = threading.current_thread().name.startswith("actcfg-host-pool")
            worker.shutdown(wait=not on_worker, cancel_futures=True)
        with self._lock:
            self._queued.clear()
            if not self._registered:
                self._free.clear()
                self._leave_node()
                return
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no copy may still touch a buffer we unpin
            for buffer in self._registered:
                self._unregister(buffer)
            self._registered.clear()
            self._free.clear()
            self._leave_node()

    def _leave_node(self) -> None:
        # Only once nothing is pinned any more: another rank may pin these bytes right after.
        if self._node is not None:
            self._node.close()


_POOL_COUNTERS = ("pinned_bytes", "pinned_allocations", "pageable_bytes", "pinned_fallbacks",
                  "host_buffers_ahead", "host_buffers_on_demand", "host_wait_s")
"""The `OffloadStats` fields that count the pool (over its lifetime), not an engine's steps."""

_SHARED = threading.local()


@contextlib.contextmanager
def shared_host_pool(pin: bool, pin_budget: int | None, *, register: bool) -> Iterator[HostPool]:
    """Within this block, each offload engine this thread builds with the same `pin` and
    `pin_budget` (and no `pin_budget_per_node`) borrows this one pool instead of making its own,
    while no other engine holds it; the pool is closed (unpinned) when the block ends.

    For engines that run one after another: the planner's offload trials
    (`actcfg.plan.profile`). Each trial's engine made its own pool and closed it at `remove()`,
    so the same host memory was pinned once per trial, and pinning runs at a few GB/s
    (`cudaHostRegister`, pages faulted in first): seconds per trial at a GPT-2's activations.
    Shared, a trial finds the buffers an earlier one made (served best-fit, as within a run), and
    the pool holds the largest trial's need rather than their sum. `register`: pin with
    `cudaHostRegister` (False on the host loopback, as the engine's own pool)."""
    pool = HostPool(pin, pin_budget, OffloadStats(), register=register)
    before = getattr(_SHARED, "pool", None)
    _SHARED.pool = pool
    try:
        yield pool
    finally:
        _SHARED.pool = before
        pool.close()


def borrow_shared_pool(pin: bool, pin_budget: int | None, register: bool,
                       stats: OffloadStats) -> HostPool | None:
    """The `shared_host_pool` of this thread, lent to the engine counting into `stats`, when its
    settings are the engine's and no engine holds it; else None (the engine makes its own)."""
    pool: HostPool | None = getattr(_SHARED, "pool", None)
    if pool is None or pool._borrowed or pool._closed or (pool._pin, pool._budget,
                                                         pool._register_buffers) != (pin, pin_budget, register):
        return None
    pool.lend(stats)
    return pool


# cudaHostRegisterPortable (driver_types.h).
_HOST_REGISTER_PORTABLE = 1
_PAGE = 4096


def _touched(nbytes: int) -> torch.Tensor:
    """A new uint8 host buffer with every page faulted in: one byte written per 4 KiB page (and
    the last byte), which is all a page fault needs; larger pages are touched several times."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        buffer[::_PAGE].zero_()
        buffer[-1:].zero_()
    return buffer


