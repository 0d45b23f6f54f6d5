"""What verify and plan share around a measurement on the GPU: the refusal before it (in the
format asked for), the ranks torchrun started and the process group they measure in, and the
user's model factory. torch is imported inside the functions that need it."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from actcfg.backends import Backend
from actcfg.cli._diagnostics import report_diagnostics
from actcfg.cli._output import Usage, write_error, write_output
from actcfg.errors import ActcfgError, install_command
from actcfg.policy.diagnostics import Diagnostic, escape_controls

__all__ = [
    "build_model",
    "launched_rank",
    "launched_world",
    "process_group",
    "rank_zero_writes",
    "refuse_run",
    "to_device",
]


def refuse_run(args: argparse.Namespace, code: int, message: str | None,
                   diagnostics: Sequence[Diagnostic] = (), status: str | None = None) -> int:
    """Report why verify (or plan) measured nothing, in the format asked for; return `code`."""
    if args.format == "json":
        import json

        status = status or {1: "invalid", 2: "unreadable" if diagnostics else "usage-error"}[code]
        body = {"ok": False, "status": status, "message": message,
                "errors": [d._asdict() for d in diagnostics]}
        write_output(json.dumps(body, indent=2) + "\n")
        return code
    if diagnostics:
        report_diagnostics(diagnostics)
    if message is not None:
        write_error(f"actcfg: error: {escape_controls(message)}\n")
    return code


def require_torch(command: str) -> None:
    """ActcfgError naming the extra to install where torch is missing: checked before the
    model is imported, whose module imports torch and whose ImportError would say less."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ActcfgError(f"{command} needs torch, which is not installed: "
                          f"{install_command('torch')}") from None


def launched_rank() -> int:
    """This process's rank under a launcher that starts several (torchrun sets RANK and
    WORLD_SIZE); 0 otherwise."""
    try:
        return int(os.environ.get("RANK", "0")) if launched_world() > 1 else 0
    except ValueError:
        return 0


def launched_world() -> int:
    """How many ranks the launcher started (WORLD_SIZE); 1 without one."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank_zero_writes(command: Callable[..., int], args: argparse.Namespace) -> int:
    """Run `command` on every rank; rank 0 (or a process torchrun did not start) writes, the
    others run it silenced and return the same exit code."""
    if launched_rank() == 0:
        return command(args)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            return command(args, write=False)
        except Usage:
            return 2
        except ActcfgError:
            return 1


@contextlib.contextmanager
def process_group(backend: Backend) -> Iterator[Any]:
    """The process group verify runs in, destroyed after if started here; yields the group of
    all ranks when a launcher started several, else None.

    Under a launcher (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)
    the group is started from its environment, one GPU per rank (LOCAL_RANK): the ranks gather
    their measurements through it. Without one, a DeepSpeed policy gets a one-process group
    (DeepSpeed's `configure` asks torch.distributed for the rank even on one GPU) and a torch
    policy none. A group already up is used as it is and left up.
    """
    import torch.distributed as dist

    launched = "WORLD_SIZE" in os.environ
    if dist.is_available() and dist.is_initialized():
        yield dist.group.WORLD if dist.get_world_size() > 1 else None
        return
    if backend is not Backend.DEEPSPEED and launched_world() <= 1:
        yield None
        return
    if not dist.is_available():
        raise Usage("verify on several ranks needs torch.distributed, which this torch lacks")
    deepspeed = None
    if backend is Backend.DEEPSPEED:
        try:
            # DeepSpeed logs to stdout (its logger's handler takes sys.stdout when first
            # imported; its op builder prints): stdout is for the report (`--format json`).
            with contextlib.redirect_stdout(sys.stderr):
                import deepspeed
        except ImportError:
            raise Usage("this policy's backend is deepspeed, and DeepSpeed is not installed: "
                         f"{install_command('deepspeed')}") from None
    import torch

    before: dict[str, str | None] = {}
    if not launched:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
    # NCCL wants one GPU per rank, chosen before the group starts; without CUDA (verify's own
    # check refuses that later), gloo.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        name = "nccl"
    else:
        name = "gloo"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if deepspeed is not None:
                deepspeed.init_distributed(dist_backend=name, dist_init_required=True)
            else:
                dist.init_process_group(name)
        yield dist.group.WORLD if dist.get_world_size() > 1 else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def to_device(value: Any, device: Any) -> Any:
    """The example inputs with every tensor on the model's device."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def build_model(factory: Callable[[], Any], spec: str) -> tuple[Any, Any]:
    """The factory's (model, example_inputs), or Usage with a sentence: the factory raised, or
    returned something that is not a model with its inputs."""
    from actcfg.verification.factory import build

    try:
        return build(factory)
    except ActcfgError as e:
        raise Usage(f"--model {spec}: {e}") from None
    except Exception as e:  # the user's code: say what it raised, never "internal error"
        raise Usage(f"--model {spec}: the model factory raised {type(e).__name__}: {e}") from None
