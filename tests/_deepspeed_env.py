"""Session fixture: real DeepSpeed under a single-process gloo group on the CPU.

Import the fixture into a test module (`from _deepspeed_env import ds_env`); tests/conftest.py
belongs to another module's owner. The first init compiles a small C++ op (seconds).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from types import ModuleType

import pytest

from actcfg.runtime.deepspeed_applier import read_back

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ds_env() -> Iterator[ModuleType]:
    """DeepSpeed's activation-checkpointing module, with torch.distributed initialised (gloo,
    world size 1) so that `deepspeed.checkpointing.configure` can run."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

    saved = {k: os.environ.get(k) for k in _ENV}
    started = False
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo")
        started = True
    try:
        yield ckpt
    finally:
        ckpt._configure_defaults()
        if started:
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ds_globals(ckpt: ModuleType) -> dict[str, object]:
    """DeepSpeed's activation-checkpointing state, keyed by configure() kwarg: actcfg's own
    read-back, whose table test_deepspeed_applier checks against `configure` itself."""
    return read_back(ckpt)
