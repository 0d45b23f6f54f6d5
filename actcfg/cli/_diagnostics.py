"""Diagnostics as the CLI reports them: on standard error, as an exit code, and a config file's
findings (translate, import) placed at the keys they name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actcfg.cli._output import write_error
from actcfg.policy.checker import failure_diagnostic
from actcfg.policy.diagnostics import Diagnostic
from actcfg.policy.loader import LoadFailure

__all__ = [
    "exit_code",
    "in_file_order",
    "located_diagnostics",
    "problem_diagnostics",
    "read_ds_config",
    "report_diagnostics",
]

UNREADABLE = frozenset({"file-not-found", "file-unreadable", "json-too-complex"})
"""The codes of a file that could not be read: exit 2, as a usage error, not 1."""


def exit_code(diagnostics: Sequence[Diagnostic], strict: bool = False) -> int:
    """2 for a file that could not be read, 1 for an error (any finding with `strict`), else 0."""
    if any(d.code in UNREADABLE for d in diagnostics):
        return 2
    if any(d.severity == "error" or strict for d in diagnostics):
        return 1
    return 0


def report_diagnostics(diagnostics: Sequence[Diagnostic]) -> None:
    """Each diagnostic on its own line of standard error."""
    if diagnostics:
        write_error("".join(f"{d}\n" for d in diagnostics))


def located_diagnostics(doc: Any, name: str, findings: Sequence[Any]) -> list[Diagnostic]:
    """Findings (path in the config file) as diagnostics at the key each path names."""
    out = []
    for f in findings:
        line, column = doc.locate(tuple(f.path), key=True)
        out.append(Diagnostic(name, line, column, f.code, f.severity, f.message, f.hint))
    return out


def problem_diagnostics(doc: Any, name: str) -> list[Diagnostic]:
    """The loader's problems with the file (duplicate keys) as error diagnostics."""
    return [Diagnostic(name, p.line, p.column, p.code, "error", p.message, p.hint)
            for p in doc.problems]


def in_file_order(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """The diagnostics sorted by line and column."""
    return sorted(diagnostics, key=lambda d: (d.line or 0, d.column or 0))


def read_ds_config(path: str) -> tuple[Any, list[Diagnostic]]:
    """A ds_config (JSON or hjson) or gpt-neox YAML as DeepSpeed reads it, or the diagnostic why not."""
    from actcfg.translators.ds_loader import read_config

    try:
        return read_config(path), []
    except LoadFailure as e:
        return None, [failure_diagnostic(path, e)]
