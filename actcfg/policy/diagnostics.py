"""Findings and their rendering: `Diagnostic`, `Result`, and the reporters in `REPORTER_BY_NAME`.

Reporters return text; the CLI decides where it goes. Library code never prints.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple, Protocol

__all__ = [
    "Diagnostic",
    "GithubReporter",
    "JsonReporter",
    "REPORTER_BY_NAME",
    "Reporter",
    "Result",
    "TextReporter",
    "escape_controls",
]

Severity = Literal["error", "warning"]


class Diagnostic(NamedTuple):
    """One finding: where (file, 1-based line and column; None for the whole file), what, and the fix.

    A NamedTuple, not a frozen dataclass, as immutable: a frozen dataclass compiles six methods
    when it is defined (~1 ms), on every start of `actcfg validate` (issue 19)."""

    file: str
    line: int | None
    column: int | None
    code: str
    severity: Severity
    message: str
    hint: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.column or 1}"
        hint = f" ({self.hint})" if self.hint else ""
        return escape_controls(f"{where}: {self.severity} {self.code}: {self.message}{hint}")


# What a terminal acts on instead of printing: C0 and C1 controls (an ESC starts a sequence
# that can move the cursor and rewrite the line above), DEL, line and paragraph separators,
# and the bidirectional overrides that reorder what is shown (Trojan Source, CVE-2021-42574).
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """`text` with every control character written as an escape (`\\x1b`, `\\n`, `\\u202e`),
    so that a key from a file can neither break a finding's line nor act on the terminal."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if char in _NAMED:
            return _NAMED[char]
        return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

    return _CONTROLS.sub(escape, text)


class Result:
    """Every diagnostic of one `validate` run, in file order."""

    def __init__(self) -> None:
        # A plain class: a dataclass compiles its methods when defined, on every `actcfg
        # validate` start (issue 19), and a result is only ever added to and read.
        self.files: list[str] = []
        self.diagnostics: list[Diagnostic] = []

    def add(self, file: str, diagnostics: list[Diagnostic]) -> None:
        """Record that `file` was checked, with its findings."""
        self.files.append(file)
        self.diagnostics.extend(diagnostics)

    @property
    def errors(self) -> list[Diagnostic]:
        """The diagnostics of severity error."""
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        """The diagnostics of severity warning."""
        return [d for d in self.diagnostics if d.severity == "warning"]

    def success(self, strict: bool = False) -> bool:
        """No errors, and under `strict` no warnings either."""
        return not (self.diagnostics if strict else self.errors)

    def summary(self) -> str:
        """One line: how many files, errors and warnings."""
        n_files, n_err, n_warn = len(self.files), len(self.errors), len(self.warnings)
        return (
            f"{n_files} file{'s' * (n_files != 1)} checked: "
            f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}"
        )


class Reporter(Protocol):
    """Renders a `Result` as text for stdout."""

    def render(self, result: Result, strict: bool = False) -> str: ...


class TextReporter:
    """`FILE:LINE:COL: error CODE: message (hint)`, one line per finding."""

    def render(self, result: Result, strict: bool = False) -> str:
        return "".join(f"{d}\n" for d in result.diagnostics)


class JsonReporter:
    """One JSON object: `{"status": "ok"|"invalid", "errors": [...]}`, warnings included."""

    def render(self, result: Result, strict: bool = False) -> str:
        import json  # here, not above: the default text output does not need it

        body = {
            "status": "ok" if result.success(strict) else "invalid",
            "errors": [d._asdict() for d in result.diagnostics],
        }
        return json.dumps(body, indent=2) + "\n"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


class GithubReporter:
    """GitHub workflow annotations, then the text lines: a step shows at most 10 annotations
    of each severity (actions/toolkit#734), the log shows every line."""

    def render(self, result: Result, strict: bool = False) -> str:
        lines = []
        for d in result.diagnostics:
            props = [f"file={escape_controls(_escape_property(d.file))}"]
            if d.line is not None:
                props += [f"line={d.line}", f"col={d.column or 1}"]
            props.append(f"title={_escape_property(f'actcfg {d.code}')}")
            hint = f" ({d.hint})" if d.hint else ""
            lines.append(f"::{d.severity} {','.join(props)}::"
                         f"{escape_controls(_escape_data(d.message + hint))}\n")
        return "".join(lines) + TextReporter().render(result, strict)


REPORTER_BY_NAME: dict[str, Reporter] = {
    "text": TextReporter(),
    "json": JsonReporter(),
    "github": GithubReporter(),
}
