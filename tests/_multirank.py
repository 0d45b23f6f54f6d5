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
    context = mp.start_processes(worker, args=(str(out_dir), port, *args), nprocs=world,
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
    """Wait for the other ranks, end the group and leave the process at once.

    Call it last, after `write_result`. DeepSpeed's engines are reference cycles that may still
    hold ZeRO-3's asynchronous gloo work; collected at interpreter exit, after the group is gone,
    that work aborted a rank once in CI ("terminate called without an active exception", SIGABRT,
    after the rank had trained; torch's own proposed fix, pytorch/pytorch#179291, was abandoned).
    So the cycles are collected while the group still lives, and the process skips the
    interpreter's teardown, which a rank whose result is written has no use for."""
    import gc
    import sys

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
