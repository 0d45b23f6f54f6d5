"""`actcfg validate FILE...`: check policy files and report every finding; the light path (no
torch, no JSON, no parser for the other commands), timed by benchmarks/validate_speed.py."""

from __future__ import annotations

import argparse
import os
from typing import Any

from actcfg.backends import Backend
from actcfg.cli._diagnostics import exit_code
from actcfg.cli._output import write_error, write_output
from actcfg.policy.checker import check_file
from actcfg.policy.diagnostics import REPORTER_BY_NAME, Diagnostic, Result
from actcfg.policy.loader import LoadFailure

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Check every file, report the findings in the format asked for; the exit code."""
    name = args.format or ("github" if os.environ.get("GITHUB_ACTIONS") == "true" else "text")
    result = Result()
    backends = tuple(args.backend or ())
    for path in args.files:
        _, diagnostics = check_file(path, backends=backends, at=args.at)
        if args.at is None and any(d.severity == "error" for d in diagnostics):
            diagnostics = _deepspeed_config_instead(path) or diagnostics
        result.add(path, diagnostics)
    write_output(REPORTER_BY_NAME[name].render(result, args.strict))
    if name != "json":
        summary = result.summary()
        if args.strict and result.warnings and not result.errors:
            # Exit 1 under "0 errors" needs its reason on the same line.
            summary += (f"; --strict fails on {'the warning' if len(result.warnings) == 1 else 'warnings'}")
        write_error(f"actcfg: {summary}\n")
    return exit_code(result.diagnostics, args.strict)


def _deepspeed_config_instead(path: str) -> list[Diagnostic]:
    """For a file that failed validation: when it is a DeepSpeed (or gpt-neox) config, read as
    DeepSpeed reads it (hjson: comments, trailing commas), the one error that says so and
    points at `actcfg import`; else nothing. Only on failure: valid policies never pay for it."""
    from actcfg.translators.ds_loader import read_config
    from actcfg.translators.ds_config import deepspeed_keys

    try:
        doc = read_config(path)
    except LoadFailure:
        return []
    keys = deepspeed_keys(doc.data)
    if not keys:
        return []
    line, column = doc.locate((keys[0],), key=True)
    named = ", ".join(f"`{k}`" for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
    return [Diagnostic(path, line, column, "deepspeed-config", "error",
                       f"this is a DeepSpeed config ({named}), not an actcfg policy",
                       f"`actcfg import {path}` writes the policy for what DeepSpeed runs from it; "
                       "validate that policy")]


def add_parser(sub: Any) -> None:
    """Add `validate` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("validate", help="check policy files; exit 1 on any error")
    p.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files")
    p.add_argument("--backend", action="append", choices=[b.value for b in Backend],
                   help="also check the rules of this backend (repeatable)")
    p.add_argument("--format", choices=sorted(REPORTER_BY_NAME),
                   help="output format (default: text; github under GITHUB_ACTIONS=true)")
    p.add_argument("--strict", action="store_true", help="treat warnings as errors")
    p.add_argument("--at", metavar="KEY", help="dotted key of the policy inside a larger YAML")
    p.set_defaults(run=run)
