"""`actcfg translate FILE`: the backend's names for a policy, as JSON, or (`--merge`) spliced
into the user's ds_config with every other byte kept."""

from __future__ import annotations

import argparse
from typing import Any

from actcfg.backends import Backend
from actcfg.cli._diagnostics import (
    exit_code,
    in_file_order,
    located_diagnostics,
    problem_diagnostics,
    read_ds_config,
    report_diagnostics,
)
from actcfg.cli._output import Usage, refuse_output_over, write_output
from actcfg.errors import ActcfgError, TranslationError
from actcfg.policy.checker import check_document, failure_diagnostic
from actcfg.policy.diagnostics import Diagnostic
from actcfg.policy.loader import LoadFailure, read_document

__all__ = ["add_parser", "run"]


def _merge(args: argparse.Namespace, section: dict[str, Any]) -> tuple[str | None, int]:
    """The ds_config's text with `section` spliced in, or None and the exit code."""
    from actcfg.backends.deepspeed import SECTION
    from actcfg.translators.ds_loader import JsonDocument, parse_config
    from actcfg.translators.ds_config import merge_conflicts, splice_section

    doc, failed = read_ds_config(args.merge)
    if failed:
        report_diagnostics(failed)
        return None, exit_code(failed)
    if not isinstance(doc, JsonDocument):
        raise Usage(f"--merge edits a DeepSpeed JSON config, and {args.merge} is YAML")
    if not isinstance(doc.data, dict):
        report_diagnostics([Diagnostic(args.merge, 1, 1, "bad-value", "error", "a ds_config is a JSON object",
                            "pass the ds_config.json file")])
        return None, 1
    conflicts = merge_conflicts(doc.data, section, replace=args.replace)
    conflicts = [f._replace(hint=f"{f.hint}; or pass --replace to take the policy's section")
                 if f.code == "ds-config-conflict" and f.path[:1] == (SECTION,) else f for f in conflicts]
    diagnostics = in_file_order(problem_diagnostics(doc, args.merge) + located_diagnostics(doc, args.merge, conflicts))
    report_diagnostics(diagnostics)
    if any(d.severity == "error" for d in diagnostics):
        return None, 1
    try:
        text = splice_section(doc.text, doc.spans, section)
    except TranslationError as e:
        report_diagnostics([Diagnostic(args.merge, 1, 1, "ds-config-conflict", "error", str(e),
                            "add the section by hand")])
        return None, 1
    # The splice touched one member: check that the result reads back as the merge says.
    expected = {**doc.data, "activation_checkpointing": section}
    if parse_config(text, args.merge).data != expected:
        raise ActcfgError(f"--merge: splicing the section into {args.merge} changed other "
                          "values; nothing was written (please report this)")
    return ("\ufeff" if doc.bom else "") + text, 0


def run(args: argparse.Namespace) -> int:
    """Print (or write to `-o`) the policy in the backend's names, or merged into `--merge`."""
    import json

    from actcfg.translators import translate

    refuse_output_over(args.output, [args.file, args.merge])
    try:
        doc = read_document(args.file)
    except LoadFailure as e:
        failure = [failure_diagnostic(args.file, e)]
        report_diagnostics(failure)
        return exit_code(failure)
    backends = (args.backend,) if args.backend else ()
    policy, diagnostics = check_document(doc, backends=backends, at=args.at)
    report_diagnostics(diagnostics)
    if policy is None:
        return 1
    backend = Backend.parse(args.backend) if args.backend else policy.backend
    if args.merge and backend is not Backend.DEEPSPEED:
        raise Usage("--merge needs the deepspeed backend (it edits a ds_config)")
    if args.replace and not args.merge:
        raise Usage("--replace goes with --merge DS_CONFIG (it replaces that file's section)")
    try:
        out = translate(policy, backend)
    except TranslationError as e:
        line, column = doc.section(args.at).locate(tuple(e.field.split(".")))
        report_diagnostics([Diagnostic(args.file, line, column, "unsupported-on-backend", "error",
                            str(e), f"remove `{e.field}`, or choose another backend")])
        return 1
    if args.merge:
        text, code = _merge(args, out["activation_checkpointing"])
        if text is None:
            return code
        write_output(text, args.output)
        return 0
    write_output(json.dumps(out, indent=2) + "\n", args.output)
    return 0


def add_parser(sub: Any) -> None:
    """Add `translate` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("translate", help="print the backend's names for a policy, as JSON")
    p.add_argument("file", metavar="FILE", help="the policy YAML file to translate")
    p.add_argument("--backend", choices=[b.value for b in Backend], help="default: the policy's `backend`")
    p.add_argument("--merge", metavar="DS_CONFIG",
                   help="print this ds_config.json with the policy's activation_checkpointing "
                        "section in it (every other byte kept as written); keys the file's "
                        "section already has must agree with the policy, or it exits 1 naming "
                        "each one")
    p.add_argument("--replace", action="store_true",
                   help="with --merge: replace a section that disagrees, with a warning naming "
                        "each old value")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write here instead of stdout (never over an input)")
    p.add_argument("--at", metavar="KEY", help="dotted key of the policy inside a larger YAML")
    p.set_defaults(run=run)
