"""`actcfg schema`: the JSON Schema of a policy file, for editors."""

from __future__ import annotations

import argparse
from typing import Any

from actcfg.cli._output import write_output
from actcfg.policy.schema import policy_json_schema

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Print (or write to `-o`) the policy's JSON Schema."""
    import json  # json is imported by the commands that print it, not by validate

    write_output(json.dumps(policy_json_schema(), indent=2) + "\n", args.output)
    return 0


def add_parser(sub: Any) -> None:
    """Add `schema` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("schema", help="print the JSON Schema of a policy file")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    p.set_defaults(run=run)
