"""The offload engine's host memory: buffers reused across steps, pinned within a budget.

Page-locked buffers are registered with `cudaHostRegister` at their exact size (torch's pinned
allocator rounds every request up to a power of two), never more than `pin_budget` in total;
past it, or if pinning fails, pageable buffers with one warning.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from actcfg.offload_stats import OffloadStats, OffloadWarning

__all__ = ["HostPool"]


class HostPool:
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
        self._free: dict[int, list[tuple[torch.Tensor, Any, bool]]] = {}
        self._registered: list[torch.Tensor] = []
        self._pin_failed = False
        self._warned = False
        # Reentrant: a chunk's __del__ (which releases its buffer) can run from garbage
        # collection in the middle of acquire() on the same thread.
        self._lock = threading.RLock()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Any, bool]:
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

    def release(self, buffer: torch.Tensor, event: Any, pinned: bool) -> None:
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
                self._free.clear()
                return
            torch.cuda.synchronize()  # no copy may still touch a buffer we unpin
            cudart = torch.cuda.cudart()
            for buffer in self._registered:
                cudart.cudaHostUnregister(buffer.data_ptr())
            self._registered.clear()
            self._free.clear()
