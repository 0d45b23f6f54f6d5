"""`actcfg verify CONFIG`: run a model plain and with the policy on the GPU and judge each
promise of the policy; under torchrun every rank measures and rank 0 writes."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from actcfg.backends import RUNTIME_BACKENDS, Backend
from actcfg.cli._diagnostics import exit_code, report_diagnostics
from actcfg.cli._launch import process_group, rank_zero_writes, refuse_run, require_torch
from actcfg.cli._output import Usage, write_error, write_output
from actcfg.errors import ActcfgError
from actcfg.policy.checker import check_file
from actcfg.policy.diagnostics import escape_controls

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Under torchrun every rank measures and judges alike; only rank 0 writes (the report, the
    plot, the errors), and every rank returns the exit code of the same verdicts."""
    return rank_zero_writes(_verify_here, args)


def _verify_here(args: argparse.Namespace, write: bool = True) -> int:
    # Imported here, not above: verify measures with torch, and validate must never load it.
    from actcfg.verification import DEFAULT_MODEL, load_factory, require_cuda, verify
    from actcfg.verification.render import REPORTER_BY_NAME as RENDERERS
    from actcfg.verification.render import plot_memory, require_plotting

    policy, diagnostics = check_file(args.config, backends=(args.backend,) if args.backend else ())
    if policy is None:  # an invalid policy is 1, as in validate; unreadable 2
        return refuse_run(args, exit_code(diagnostics) or 1, None, diagnostics)
    report_diagnostics(diagnostics)
    if args.steps < 1:
        return refuse_run(args, 2, f"--steps must be at least 1, got {args.steps}")
    backend = Backend.parse(args.backend) if args.backend else policy.backend
    try:  # what would stop the run is found before the GPU work, and is a usage error
        require_torch("actcfg verify")  # before the model: the default probe model needs it too
        factory = load_factory(args.model or DEFAULT_MODEL)
        require_cuda()
        if args.plot:
            require_plotting()
    except ActcfgError as e:
        return refuse_run(args, 2, str(e))
    with contextlib.ExitStack() as stack:
        try:
            group = stack.enter_context(process_group(backend))
        except Usage as e:
            return refuse_run(args, 2, str(e))
        options: dict[str, Any] = {}
        if group is not None and backend is Backend.DEEPSPEED:
            # The ranks torchrun started hold the same model, as tensor-parallel ranks do:
            # they are the model-parallel group DeepSpeed partitions across.
            options["mpu"] = group
        report = verify(factory, policy, steps=args.steps, backend=args.backend, **options)
    if not write:
        return 0 if report.ok else 1
    write_output(RENDERERS[args.format](report))
    if args.plot:
        try:
            plot_memory(report, args.plot)
        except ActcfgError as e:
            write_error(f"actcfg: error: {escape_controls(str(e))}\n")
            # The verdicts are already out: a failed promise (1) must not read as an I/O error (2).
            return 2 if report.ok else 1
    return 0 if report.ok else 1


def add_parser(sub: Any) -> None:
    """Add `verify` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("verify", help="run a model plain and with the policy on the GPU; exit 1 "
                                      "if a promise of the policy does not hold")
    p.add_argument("config", metavar="CONFIG", help="policy YAML file")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="factory returning (model, example_inputs), or a model with an "
                        "example_inputs attribute or method (default: actcfg.probes:linear_chain)")
    p.add_argument("--backend", choices=[b.value for b in RUNTIME_BACKENDS], help="default: the policy's `backend`")
    p.add_argument("--steps", type=int, default=3, help="forward+backward steps per run (default 3)")
    p.add_argument("--format", choices=["json", "text"], default="text", help="output format")
    p.add_argument("--plot", metavar="PNG", help="also write memory per block, plain vs policy")
    p.set_defaults(run=run)
