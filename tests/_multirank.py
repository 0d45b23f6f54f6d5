"""Run a test body on several ranks: fresh processes (torch.multiprocessing, start method spawn),
one torch.distributed group over them, results back through JSON files.

Shared by tests/runtime/test_multirank.py (two gloo ranks on the CPU) and tests/runtime/test_distributed.py (two
NCCL ranks, one GPU each). A worker is a module-level function `worker(rank, out_dir, *args)`;
it calls `init_group` first. When a rank raises, its traceback fails the test and the other
ranks are terminated; when the ranks outlive `timeout`, all are terminated and the test fails
(a rank that died inside a collective would otherwise leave the others waiting). Both limits,
the ranks' and the collectives', are stretched by ACTCFG_TEST_TIMEOUT_SCALE (tests/_timeouts.py):
a fixed 120 s errored 8 times on a loaded 2-core CI machine.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

try:
    from tests._timeouts import scaled
except ImportError:  # tests/ on sys.path instead of the repository root
    from _timeouts import scaled

WORLD = 2
_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_or_skip() -> None:
    """Skip unless torch.distributed with the gloo backend is available."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend in this torch build")


def run_ranks(worker: Callable[..., None], out_dir: Path, *args: Any, world: int = WORLD,
              timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run `worker(rank, str(out_dir), port, *args)` on `world` ranks; return what each rank
    wrote with `write_result`, in rank order. `timeout` is stretched by
    ACTCFG_TEST_TIMEOUT_SCALE."""
    import torch.multiprocessing as mp

    timeout = scaled(timeout)

    port = free_port()
    context = mp.start_processes(_exit_after, args=(worker, str(out_dir), port, *args), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(10)
            pytest.fail(f"the {world} ranks ran longer than {timeout:.0f} s and were stopped")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


def _exit_after(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """Run `worker` on this rank; once it returns, leave the process without the interpreter's
    teardown. A rank that had written its result aborted at exit 1 run in 5 to 6 on this
    2-core machine ("terminate called without an active exception", SIGABRT; the CLI test and
    the ZeRO-3 test, once in CI). gdb's backtrace: Python's finalization holds the GIL (its
    last garbage collection) while a gloo `runLoop` thread drops the last reference to a
    finished all-gather's work, whose tensors need the GIL to be freed; the thread, refused
    the GIL while the interpreter finalizes, exits through a destructor that may not throw
    (torch's proposed fix, pytorch/pytorch#179291, was abandoned). A raised exception still
    travels as before: torch's spawn wrapper reports it."""
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_group(rank: int, port: int, backend: str = "gloo", world: int = WORLD,
               deepspeed: bool = False) -> None:
    """Start this rank's torch.distributed group (and DeepSpeed's view of it), the environment
    set as torchrun sets it; collectives give up after five minutes (scaled) instead of hanging."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=scaled(300)))
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend=backend)


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """What the test reads back from this rank."""
    path = Path(out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(result, default=str))


def finish() -> None:
    """Wait for the other ranks, then end the group."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
