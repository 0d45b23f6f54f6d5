"""File -> policy or diagnostics: load, validate, and turn every problem into a `Diagnostic`.

Pydantic's errors are mapped to stable codes (docs/architecture.md) with a position in the
file and a hint that names the accepted choices or the fix; the cross-field rules of
`schema.check_rules` arrive as `Finding`s and become one diagnostic each.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from actcfg.policy.diagnostics import Diagnostic
from actcfg.errors import ConfigLoadError
from actcfg.policy.loader import YAML11_BOOLS, Document, LoadFailure, kind_of, parse_document, read_document
from actcfg.policy.schema import CHECKPOINT_MODES, Backend, Finding, Policy, check_rules, user_path

__all__ = ["check_data", "check_file", "check_text", "failure_diagnostic", "load"]

_CODE_BY_TYPE = {
    "extra_forbidden": "unknown-key",
    "invalid_key": "unknown-key",
    "missing": "missing-key",
    "union_tag_not_found": "missing-key",
    "union_tag_invalid": "bad-choice",
    "enum": "bad-choice",
    "literal_error": "bad-choice",
    "greater_than_equal": "out-of-range",
    "greater_than": "out-of-range",
    "too_short": "out-of-range",
    "size_negative": "out-of-range",
    "size_format": "bad-size",
    "size_under_a_byte": "bad-size",
    "size_type": "wrong-type",
    "string_pattern_mismatch": "bad-value",
    "string_too_short": "bad-value",
}

_TYPE_WORDS = {
    "bool_type": "a boolean (true or false)",
    "int_type": "a whole number",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "size_type": "a size such as 16GiB or a whole number of bytes",
}

_MISSING_HINTS = {
    ("version",): "add `version: 1` as the first line",
    ("checkpoint", "modules"): "add `modules: [...]`: class names or fnmatch patterns of the "
    "modules to checkpoint, such as `[Block]`",
    ("checkpoint", "mode"): "add `mode: none`, `mode: full`, `mode: selective` or `mode: external`",
    ("checkpoint", "rules"): "add `rules:`, a list such as `- {modules: [Block], mode: full}`",
}

_Backends = Iterable[Backend | str]


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _described(value: Any) -> str:
    """`string 'x'`, `integer 1`, `null`: the kind of a value, then the value unless obvious."""
    return kind_of(value) if value is None else f"{kind_of(value)} {_shown(value)}"


def _hint_for_type(kind: str, value: Any, path: tuple[Any, ...]) -> str:
    if kind == "bool_type" and isinstance(value, str):
        if value.lower() in YAML11_BOOLS:
            return f"YAML 1.1 reads `{value}` as a boolean, actcfg does not guess: write true or false"
        if value.lower() in ("true", "false"):
            return f"remove the quotes: write {value.lower()}"
        return "write true or false"
    if kind == "int_type" and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        if value.strip().lstrip("+-").startswith("0") and len(value.strip().lstrip("+-")) > 1:
            return f"YAML 1.1 would read `{value}` as octal; write the number without leading zeros"
        return f"remove the quotes: write {value.strip()}"
    if kind in ("model_attributes_type", "model_type", "dict_type") and path == ("checkpoint",):
        return "write a mapping such as `checkpoint: {mode: full, modules: [Block]}`"
    if kind in ("tuple_type", "list_type"):
        return f"write a list such as `[{value}]`" if isinstance(value, str) else "write a YAML list"
    return f"write {_TYPE_WORDS.get(kind, 'a value of the right type')}"


def _from_error(error: Mapping[str, Any], data: Any, doc: Document | None, name: str) -> list[Diagnostic]:
    """The diagnostics for one Pydantic error dict."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "policy_rule":
        return [_from_finding(f, doc, name) for f in ctx.get("findings", ())]
    path = tuple(user_path(tuple(error["loc"]), data))
    value = error.get("input")
    code = _CODE_BY_TYPE.get(kind, "wrong-type" if kind.endswith("_type") else "bad-value")
    where = _dotted(path)
    locate_key = False
    written = _key_as_written(error, path, doc) if kind == "invalid_key" else None
    if written is not None:
        # A key YAML reads as null, a boolean or a number (`~:`, `true:`, `1:`): Pydantic names
        # it by its Python value, at no position; name it as written, where it is written.
        text, value, line, column = written
        parent = path[:-1]
        level = f"under `{_dotted(parent)}:`" if parent else "at the top level"
        return [Diagnostic(
            name, line, column, "unknown-key", "error",
            f"unknown key `{text}` {level}: YAML reads it as {_described(value)}, not a name",
            "a key is a name such as `partition`; remove this one",
        )]
    if kind == "too_short" and isinstance(value, (list, tuple)) and value:
        return []  # `modules: [~]`: the item's own error says what is wrong; the list is not empty
    if code == "unknown-key":
        # Imported here: a valid file (the common, timed case) needs neither.
        from actcfg.policy.suggest import keys_at, suggest

        parent, key = path[:-1], path[-1]
        mode = data.get("checkpoint", {}).get("mode") if isinstance(data.get("checkpoint"), dict) else None
        valid = keys_at(parent, mode if isinstance(mode, str) else None)
        level = f"under `{_dotted(parent)}:`" if parent else "at the top level"
        message = f"unknown key `{key}` {level}"
        hint = suggest(str(key), valid, parent) or (
            "valid keys here: " + ", ".join(f"`{k}`" for k in valid) if valid else "remove it"
        )
        locate_key = True
    elif kind == "missing":
        message = f"missing required key `{where}`"
        hint = _MISSING_HINTS.get(path, f"add `{path[-1]}`")
        if path[-1] == "modules" and path[:1] == ("checkpoint",):
            hint = _MISSING_HINTS[("checkpoint", "modules")]
    elif kind == "union_tag_not_found":
        message = f"`{where}` needs a `mode`"
        hint = _MISSING_HINTS[("checkpoint", "mode")]
        path = (*path, "mode")
    elif kind == "union_tag_invalid":
        tag = ctx.get("tag")
        path = (*path, "mode")
        message = f"`checkpoint.mode` is {_shown(tag)}, which is not a checkpoint mode"
        import difflib

        close = difflib.get_close_matches(str(tag), CHECKPOINT_MODES, n=1, cutoff=0.6)
        hint = "choose one of " + ", ".join(CHECKPOINT_MODES) + (f"; did you mean `{close[0]}`?" if close else "")
    elif kind in ("enum", "literal_error"):
        expected = str(ctx.get("expected", "")).replace("'", "")
        message = f"`{where}` is {_shown(value)}; expected {expected}"
        if path == ("version",):
            hint = "this actcfg reads `version: 1`"
        else:
            choices = [c.strip() for c in expected.replace(" or ", ",").split(",") if c.strip()]
            import difflib

            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
            # The message lists the choices already: the hint adds only what it does not say.
            hint = f"did you mean `{close[0]}`?" if close else "write one of these values as shown"
            if path == ("backend",) and str(value) in {b.value for b in Backend}:
                hint = (f"`{value}` is a translation target (`actcfg translate --backend {value}`); "
                        f"a policy's backend is the one actcfg.apply runs: choose {expected}")
    elif code == "wrong-type":
        expected = _TYPE_WORDS.get(kind)
        message = (
            f"`{where}` must be {expected}, got {_described(value)}"
            if expected
            else f"`{where}`: {error['msg']}"
        )
        hint = _hint_for_type(kind, value, path)
    elif kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        message = f"`{where}` must be {'at least' if 'ge' in ctx else 'more than'} {bound}, got {_shown(value)}"
        hint = f"use a whole number of at least {bound}" if "ge" in ctx else f"use a number above {bound}"
    elif kind == "too_short":
        message = f"`{where}` is empty"
        hint = ("list at least one rule, such as `- {modules: [Block], mode: full}`"
                if path == ("checkpoint", "rules") else
                "list at least one module pattern, such as `[Block]`")
    elif kind == "size_negative":
        message = f"`{where}` is {_shown(value)}: a size cannot be negative"
        hint = "use a size of 0 or more, such as 16GiB"
    elif kind == "size_zero":
        message = f"`{where}` is {_shown(value)}: a budget of 0 bytes leaves no room for a training step"
        hint = "give the most GPU memory one training step may allocate, such as 40GiB"
    elif kind == "finite_number":
        message = f"`{where}` is {_shown(value)}: it must be a finite number"
        hint = "write a number of milliseconds, such as 12.5"
    elif kind == "size_under_a_byte":
        message = f"`{where}` is {_shown(value)}: less than one byte, which would round to 0"
        hint = "write 0 for no pinned memory at all, or a size of at least one byte, such as 1KiB"
    elif code == "bad-size":
        message = f"`{where}` is {_shown(value)}, not a size"
        hint = "write a number and one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, such as 16GiB"
    elif kind == "string_pattern_mismatch" and "save_ops" in path:
        message = f"`{where}` is {_shown(value)}, not an op name"
        hint = "write ops as namespace.op, such as aten.mm"
    else:
        message = f"`{where}`: {error['msg']}, got {_shown(value)}"
        hint = "fix the value"
    line, column = doc.locate(path, key=locate_key) if doc is not None else (None, None)
    return [Diagnostic(name, line, column, code, "error", message, hint)]


def _key_as_written(
    error: Mapping[str, Any], path: tuple[Any, ...], doc: Document | None
) -> tuple[str, Any, int, int] | None:
    """(text, value, line, column) of the non-string key an `invalid_key` error is about."""
    if doc is None or not path:
        return None
    loc = path[-1]
    for text, value, line, column in doc.keys_at(path[:-1]):
        if not isinstance(value, str) and (value == loc or str(value) == str(loc)):
            return text, value, line, column
    return None


def _from_finding(finding: Finding, doc: Document | None, name: str) -> Diagnostic:
    line, column = doc.locate(finding.path) if doc is not None else (None, None)
    return Diagnostic(
        name, line, column, finding.code, finding.severity,
        finding.message, finding.hint,
    )


def failure_diagnostic(name: str, failure: LoadFailure) -> Diagnostic:
    """The diagnostic of a file that could not be read or parsed."""
    return Diagnostic(
        name, failure.line, failure.column, failure.code, "error", failure.message, failure.hint
    )


def _backends(backends: _Backends) -> tuple[Backend, ...]:
    return tuple(Backend.parse(b) for b in backends)


def _validate(
    data: Any, doc: Document | None, name: str, backends: tuple[Backend, ...]
) -> tuple[Policy | None, list[Diagnostic]]:
    out: list[Diagnostic] = []
    if doc is not None:
        out.extend(
            Diagnostic(name, p.line, p.column, p.code, "error", p.message, p.hint) for p in doc.problems
        )
    context: dict[str, Any] = {"backends": backends}
    try:
        policy = Policy.model_validate(data, context=context)
    except ValidationError as e:
        for error in e.errors(include_url=False):
            out.extend(_from_error(error, data, doc, name))
        out.sort(key=lambda d: (d.line or 0, d.column or 0))
        return None, out
    out.extend(_from_finding(f, doc, name) for f in context.get("warnings", ()))
    out.sort(key=lambda d: (d.line or 0, d.column or 0))  # file order; stable at one position
    return (None if any(d.severity == "error" for d in out) else policy), out


def check_document(
    doc: Document, *, backends: _Backends = (), at: str | None = None
) -> tuple[Policy | None, list[Diagnostic]]:
    """The policy in `doc` (at section `at`) and every diagnostic about it."""
    try:
        section = doc.section(at)
    except LoadFailure as e:
        return None, [failure_diagnostic(doc.name, e)]
    return _validate(section.data, section, doc.name, _backends(backends))


def check_file(
    path: str | os.PathLike[str], *, backends: _Backends = (), at: str | None = None
) -> tuple[Policy | None, list[Diagnostic]]:
    """The policy in the file at `path` (or None) and every diagnostic about it."""
    name = os.fspath(path)
    try:
        doc = read_document(name)
    except LoadFailure as e:
        return None, [failure_diagnostic(name, e)]
    return check_document(doc, backends=backends, at=at)


def check_text(
    text: str, name: str = "<string>", *, backends: _Backends = (), at: str | None = None
) -> tuple[Policy | None, list[Diagnostic]]:
    """The policy in YAML `text` (or None) and every diagnostic about it."""
    try:
        doc = parse_document(text, name)
    except LoadFailure as e:
        return None, [failure_diagnostic(name, e)]
    return check_document(doc, backends=backends, at=at)


def check_data(
    data: Any, name: str = "<dict>", *, backends: _Backends = ()
) -> tuple[Policy | None, list[Diagnostic]]:
    """The policy in already-loaded `data` (or None) and every diagnostic, without positions."""
    if not isinstance(data, dict):
        return None, [Diagnostic(name, None, None, "yaml-not-mapping", "error",
                                 f"a policy is a mapping, not a {kind_of(data)}", "pass a dict")]
    return _validate(data, None, name, _backends(backends))


def load(source: Any, *, at: str | None = None, backends: _Backends = ()) -> Policy:
    """A validated `Policy` from a path, a YAML string, a dict or a `Policy`.

    A str is YAML text when it contains a newline or ':' and names no existing file;
    otherwise it is a path. Raises `ConfigLoadError` listing every error.
    """
    if isinstance(source, Policy):
        # Validated when it was built; only the rules of the backends asked for are new.
        policy = source
        diagnostics = [_from_finding(f, None, "<Policy>")
                       for f in check_rules(source, _backends(backends)) if f.severity == "error"]
        if diagnostics:
            policy = None
    elif isinstance(source, dict):
        data = source
        if at:
            for part in at.split("."):
                if not isinstance(data, dict) or part not in data:
                    raise ConfigLoadError(f"<dict>: error section-missing: no section `{at}`")
                data = data[part]
        policy, diagnostics = check_data(data, backends=backends)
    elif isinstance(source, str) and ("\n" in source or ":" in source) and not os.path.isfile(source):
        policy, diagnostics = check_text(source, backends=backends, at=at)
    elif isinstance(source, (str, os.PathLike)):
        policy, diagnostics = check_file(source, backends=backends, at=at)
    else:
        raise ConfigLoadError(
            f"cannot load a policy from a {type(source).__name__}: "
            "pass a path, a YAML string, a dict or a Policy"
        )
    if policy is None:
        errors = [d for d in diagnostics if d.severity == "error"]
        raise ConfigLoadError("invalid actcfg policy:\n" + "\n".join(str(d) for d in errors), errors)
    return policy
