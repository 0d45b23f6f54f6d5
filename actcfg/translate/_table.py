"""The entry types of the translators' mapping tables, and the walk over policy fields.

Each backend module owns ONE table: actcfg field path -> entry. An entry either names
where the value goes (`Key`), who acts on it instead of a config key (`RoutedBy`), says
the backend cannot express it (`Unsupported`), or marks it as about the file itself
(`Meta`). A test walks every schema field and fails if a table lacks one.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel

from actcfg.errors import TranslationError
from actcfg.schema import Policy

__all__ = [
    "Entry",
    "Key",
    "MISSING",
    "Meta",
    "RoutedBy",
    "Unsupported",
    "check_expressible",
    "get_field",
    "policy_field_paths",
]

MISSING = object()


@dataclass(frozen=True)
class Key:
    """The value goes to backend key `key` (and keyword argument `kwarg`, where there is one)."""

    key: str
    kwarg: str | None = None
    needs_checkpoint: bool = False
    """The backend acts on it only inside checkpointed calls: a non-default value with
    `checkpoint.mode: none` would do nothing, so it is refused."""


@dataclass(frozen=True)
class RoutedBy:
    """No config key: `who` acts on the value (the runtime routes modules); it lands in `key`."""

    who: str
    key: str
    rejects: tuple[tuple[Any, str], ...] = ()
    """(value, reason) pairs the backend cannot route."""


@dataclass(frozen=True)
class Unsupported:
    """The backend cannot express this field; only the schema default passes."""

    reason: str
    explicit: bool = False
    """Refuse the field whenever the file sets it, even to the default value."""


@dataclass(frozen=True)
class Meta:
    """About the policy file itself, not the backend's behaviour."""

    reason: str


Entry = Union[Key, RoutedBy, Unsupported, Meta]


def _model_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        variants = [a for a in typing.get_args(_strip(info.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            variants = [info.annotation]
        if not variants:
            out.append(path)
            continue
        for variant in variants:
            for sub in _model_fields(variant, f"{path}."):
                if sub not in out:
                    out.append(sub)
    return out


def _strip(annotation: Any) -> Any:
    """`Annotated[Union[...], ...]` -> `Union[...]`."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def policy_field_paths() -> list[str]:
    """Every leaf field of the schema as a dotted path, each checkpoint variant included."""
    return _model_fields(Policy)


def get_field(policy: Policy, path: str) -> tuple[Any, Any, bool]:
    """(value, schema default, set explicitly) of a dotted field; value is `MISSING` when the
    policy's checkpoint variant has no such field."""
    obj: Any = policy
    *parents, leaf = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    if leaf not in type(obj).model_fields:
        return MISSING, MISSING, False
    default = type(obj).model_fields[leaf].default
    return getattr(obj, leaf), default, leaf in obj.model_fields_set


def check_expressible(table: dict[str, Entry], policy: Policy, backend: str) -> None:
    """Raise `TranslationError` for the first field (in table order) the backend cannot express."""
    mode = policy.checkpoint.mode
    for path, entry in table.items():
        value, default, explicit = get_field(policy, path)
        if value is MISSING:
            continue
        if isinstance(entry, Unsupported):
            if value != default or (entry.explicit and explicit):
                raise TranslationError(path, backend, f"{entry.reason} (got {value!r})")
        elif isinstance(entry, RoutedBy):
            for bad, reason in entry.rejects:
                if value == bad:
                    raise TranslationError(path, backend, reason)
        elif isinstance(entry, Key) and entry.needs_checkpoint:
            if mode == "none" and value != default:
                raise TranslationError(
                    path, backend,
                    f"it acts only inside checkpointed calls, but checkpoint.mode is none "
                    f"(got {value!r}); set `checkpoint: {{mode: full, modules: [...]}}`, or remove "
                    f"`{path}`",
                )
