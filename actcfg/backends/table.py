"""The entries of a backend table, and the one walk that judges a policy against a table.

A table maps every policy field (dotted path) to one entry: where the value goes (`Key`), who
acts on it instead of a config key (`RoutedBy`), that the backend cannot express it
(`Unsupported`), or that it is about the policy file itself (`Meta`). `findings` turns a table
into the schema's backend rules and the translators' refusals, so a backend's limits are
written once. Works on any object with the policy's attributes: no import of the schema.

The findings and entries are NamedTuples, not frozen dataclasses, as immutable: a frozen
dataclass compiles six methods when it is defined (~1 ms each class), and `actcfg validate`
defines every one of these types on each start (issue 19).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Union

__all__ = [
    "Advice",
    "Entry",
    "Finding",
    "Key",
    "MISSING",
    "Meta",
    "Rejection",
    "RoutedBy",
    "Unsupported",
    "field_value",
    "findings",
]

MISSING = object()
"""`field_value`'s value for a field the policy's checkpoint variant does not have."""


class Finding(NamedTuple):
    """One rule's verdict on a policy: error or warning, at a field, with the fix."""

    code: str
    severity: Literal["error", "warning"]
    path: tuple[str | int, ...]
    """Where in the file: keys, and list indexes (`checkpoint.rules.0.save_ops`)."""
    message: str
    hint: str
    reason: str = ""
    """The sentence without the backend's context (what a translator refusing it says)."""


class Advice(NamedTuple):
    """A warning for a value the backend takes but that does less than the user may think."""

    when: Any
    """The value that draws the warning."""
    code: str
    message: str
    hint: str


class Rejection(NamedTuple):
    """A value the backend cannot take, with the sentence and the fix."""

    when: Any
    """The value refused, or a predicate over the value (`lambda patterns: ...`)."""
    code: str
    message: str
    hint: str


class Key(NamedTuple):
    """The value goes to backend key `key` (and keyword argument `kwarg`, where there is one)."""

    key: str
    kwarg: str | None = None
    needs_checkpoint: bool = False
    """The backend acts on it only inside checkpointed calls: a non-default value with
    `checkpoint.mode: none` would do nothing, so it is refused."""
    hint_without_checkpoint: str = ""
    """Added to the fix when `needs_checkpoint` refuses the value."""
    advice: Advice | None = None
    dropped: str | None = None
    """Why the backend accepts the key but never acts on it (a warning when the value is not
    the default): a trainer that loses it on its way to the library underneath."""
    dropped_fix: str = ""
    """The fix for `dropped`."""


class RoutedBy(NamedTuple):
    """No config key: `who` acts on the value (the runtime routes modules); it lands in `key`."""

    who: str
    key: str
    rejects: tuple[Rejection, ...] = ()


class Unsupported(NamedTuple):
    """The backend cannot express this field; only the schema default passes."""

    code: str
    message: str
    """Why, in a sentence that reads on its own: "`partition` is DeepSpeed-only (...)"."""
    hint: str
    explicit: bool = False
    """Refuse the field whenever the file sets it, even to the default value."""


class Meta(NamedTuple):
    """About the policy file itself, not the backend's behaviour."""

    reason: str


Entry = Union[Key, RoutedBy, Unsupported, Meta]


def field_value(policy: Any, path: str) -> tuple[Any, Any, bool]:
    """(value, schema default, set explicitly) of a dotted field; value is `MISSING` when the
    policy's checkpoint variant has no such field, or when the field is inside a list or an
    unset section (`checkpoint.rules.mode`: the rules are read by the translator itself)."""
    obj: Any = policy
    *parents, leaf = path.split(".")
    for part in parents:
        obj = getattr(obj, part, MISSING)
        if obj is MISSING or not hasattr(type(obj), "model_fields"):
            return MISSING, MISSING, False
    fields = type(obj).model_fields
    if leaf not in fields:
        return MISSING, MISSING, False
    return getattr(obj, leaf), fields[leaf].default, leaf in obj.model_fields_set


def findings(table: dict[str, Entry], policy: Any, name: str, checkpoint_function: str,
             origin: str = "") -> list[Finding]:
    """Every field of `policy` that the backend of `table` cannot express or that does nothing
    there, in table order. `name` is the backend's name in sentences ("but the backend is
    torch"); `origin` says where that backend came from (" (from --backend)")."""
    out: list[Finding] = []
    mode = policy.checkpoint.mode
    for path, entry in table.items():
        value, default, explicit = field_value(policy, path)
        if value is MISSING:
            continue
        where = tuple(path.split("."))
        if isinstance(entry, Unsupported):
            if value != default or (entry.explicit and explicit):
                out.append(Finding(entry.code, "error", where,
                                   f"{entry.message}, but the backend is {name}{origin}", entry.hint,
                                   entry.message))
        elif isinstance(entry, RoutedBy):
            for rejection in entry.rejects:
                if rejection.when(value) if callable(rejection.when) else value == rejection.when:
                    out.append(Finding(rejection.code, "error", where,
                                       f"{rejection.message}, but the backend is {name}{origin}",
                                       rejection.hint, rejection.message))
        elif isinstance(entry, Key):
            if entry.needs_checkpoint and mode == "none" and value != default:
                extra = f" ({entry.hint_without_checkpoint})" if entry.hint_without_checkpoint else ""
                reason = (f"`{path}` acts only inside {checkpoint_function}, but checkpoint.mode "
                          "is none")
                # The note belongs to the backend whose rule this is, not to checkpoint.mode.
                note = f"`{path}` acts only inside {checkpoint_function}" + (
                    f" ({name} backend, {origin.strip(' ()')})" if origin else "")
                out.append(Finding(
                    "needs-checkpointing", "error", where,
                    f"{note}, but checkpoint.mode is none: it would do nothing",
                    f"set `checkpoint: {{mode: full, modules: [...]}}`, or remove `{path}`{extra}",
                    f"{reason}: it would do nothing",
                ))
            elif entry.dropped is not None and value != default:
                out.append(Finding("dropped-by-backend", "warning", where,
                                   f"`{path}`: {entry.dropped}{origin}",
                                   entry.dropped_fix,
                                   f"`{path}`: {entry.dropped}"))
            if entry.advice is not None and value == entry.advice.when:
                out.append(Finding(entry.advice.code, "warning", where,
                                   entry.advice.message + origin, entry.advice.hint,
                                   entry.advice.message))
    return out
