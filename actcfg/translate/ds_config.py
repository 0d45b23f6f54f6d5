"""Existing DeepSpeed configs: merge a translated section into one, or import one as a policy.

DeepSpeed reads its `activation_checkpointing` section with `dict.get`: unknown keys are
ignored and values are not type-checked (`"false"` is a truthy string, so ON). Both
directions here refuse or report exactly those cases instead of passing them on.
Pure: no I/O, no torch, no deepspeed import.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from actcfg.errors import TranslationError
from actcfg.schema import Policy
from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION, TABLE
from actcfg.backends.table import Key

__all__ = ["ALIASES", "ImportResult", "MODULES_PLACEHOLDER", "import_ds_config", "merge_ds_config"]

BACKEND = Backend.DEEPSPEED.value

# JSON key -> actcfg field, from the one DeepSpeed table.
_FIELD_BY_KEY: dict[str, str] = {e.key: path for path, e in TABLE.items() if isinstance(e, Key)}
_KEYS = tuple(_FIELD_BY_KEY)

# Names that look right but that DeepSpeed's section ignores, and where they come from.
ALIASES: dict[str, tuple[str, str]] = {
    "checkpoint_in_cpu": ("cpu_checkpointing", "the configure() keyword argument name"),
    "partitioned_activations": ("partition_activations",
                                "the stale ACTIVATION_CHKPT_FORMAT text in DeepSpeed's config.py"),
    "partition_activation": ("partition_activations", "DeepSpeed's Megatron tutorial"),
    "contiguous_checkpointing": ("contiguous_memory_optimization",
                                 "the configure() keyword argument name"),
    "contigious_checkpointing": ("contiguous_memory_optimization",
                                 "Megatron-DeepSpeed's misspelt flag"),
    "num_checkpoints": ("number_checkpoints", "the configure() keyword argument name"),
    "synchronize": ("synchronize_checkpoint_boundary", "the configure() keyword argument name"),
    "cpu_offload": ("cpu_checkpointing", "other tools' offload flags"),
    "offload": ("cpu_checkpointing", "other tools' offload flags"),
}

# DeepSpeed's config does not say which modules go through deepspeed.checkpointing.checkpoint
# (the model code decides), so an import cannot know them; this name matches nothing, and
# actcfg.apply refuses patterns that match nothing.
MODULES_PLACEHOLDER = "CHANGE_ME"


def _why_ignored(key: str) -> str:
    if key in ALIASES:
        right, origin = ALIASES[key]
        return (f"DeepSpeed reads only its six keys and ignores `{key}` ({origin}); "
                f"the key is `{right}`")
    close = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return f"DeepSpeed reads only {', '.join(_KEYS)} and ignores `{key}`{hint}"


def _section_typo(ds_config: dict[str, Any]) -> str | None:
    """A top-level key that looks like a misspelt `activation_checkpointing`."""
    if SECTION in ds_config:
        return None
    for key in ds_config:
        if isinstance(key, str) and difflib.get_close_matches(key, [SECTION], n=1, cutoff=0.8):
            return key
    return None


def _section_of(ds_config: Any) -> dict[str, Any] | None:
    if not isinstance(ds_config, dict):
        raise TranslationError("ds_config", BACKEND,
                               f"a DeepSpeed config is a JSON object, got {type(ds_config).__name__}")
    section = ds_config.get(SECTION)
    if section is not None and not isinstance(section, dict):
        raise TranslationError(SECTION, BACKEND,
                               f"`{SECTION}` must be a JSON object, got {type(section).__name__}")
    return section


def _same(a: Any, b: Any) -> bool:
    # `1 == True` in Python, but DeepSpeed and JSON readers tell them apart.
    return type(a) is type(b) and a == b


def merge_ds_config(ds_config: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """A new ds_config with `activation_checkpointing` = `section`; refuses conflicting values
    and keys DeepSpeed would ignore in the existing section."""
    existing = _section_of(ds_config)
    typo = _section_typo(ds_config)
    if typo is not None:
        raise TranslationError(
            typo, BACKEND,
            f"DeepSpeed ignores the top-level key `{typo}`; it looks like a misspelt `{SECTION}`: "
            f"rename or remove it, then merge again",
        )
    for key, old in (existing or {}).items():
        if key not in section:
            raise TranslationError(f"{SECTION}.{key}", BACKEND,
                                   f"{_why_ignored(key)}; remove it from the ds_config")
        new = section[key]
        if not _same(old, new):
            field_name = _FIELD_BY_KEY.get(key, key)
            raise TranslationError(
                f"{SECTION}.{key}", BACKEND,
                f"the ds_config has {json.dumps(old)}, the policy gives {json.dumps(new)}; "
                f"remove `{key}` from the ds_config, or set `{field_name}` in the policy to "
                f"{json.dumps(old)}",
            )
    merged: dict[str, Any] = {}
    for key, value in ds_config.items():
        merged[key] = copy.deepcopy(value)
    merged[SECTION] = dict(section)
    return merged


@dataclass(frozen=True)
class ImportResult:
    """An imported policy as YAML, and the (key, why) pairs DeepSpeed would have ignored."""

    yaml: str
    ignored: list[tuple[str, str]] = field(default_factory=list)


def _check_value(key: str, value: Any) -> str | None:
    """Why `value` cannot be taken as written for JSON key `key`, or None if it can."""
    path = _FIELD_BY_KEY[key]
    if path == "num_checkpoints":
        if value is None or (type(value) is int and value >= 1):
            return None
        return (f"value {json.dumps(value)} is not a positive whole number; DeepSpeed does not "
                f"check it and fails later (IndexError in forward); not imported, write a "
                f"number such as 12")
    if type(value) is bool:
        return None
    effect = "ON" if value else "OFF"
    return (f"value {json.dumps(value)} is not a JSON boolean; DeepSpeed does not parse it and "
            f"treats it as {effect} (Python truthiness); actcfg does not guess, so `{path}` was "
            f"left at its default: write true or false")


def _comment(text: str) -> str:
    # Keys come from the user's JSON: escape every line break (YAML also breaks on \x85,
    # \u2028, \u2029) so a key cannot end the comment and inject YAML.
    return "# " + json.dumps(text, ensure_ascii=True)[1:-1]


def import_ds_config(ds_config: dict[str, Any], *,
                     modules: Sequence[str] | None = None) -> ImportResult:
    """The actcfg YAML equivalent to `ds_config`'s activation checkpointing, listing every
    key DeepSpeed would ignore. `modules` names the checkpointed modules (the ds_config
    cannot say); without it the YAML carries a placeholder to replace."""
    section = _section_of(ds_config)
    ignored: list[tuple[str, str]] = []
    typo = _section_typo(ds_config)
    if typo is not None:
        ignored.append((typo, f"DeepSpeed ignores this top-level key; it looks like a misspelt "
                              f"`{SECTION}`, so nothing in it was imported"))
    values: dict[str, Any] = {}
    for key, value in (section or {}).items():
        if key not in _FIELD_BY_KEY:
            ignored.append((key, _why_ignored(key)))
            continue
        problem = _check_value(key, value)
        if problem is not None:
            ignored.append((key, problem))
            continue
        values[_FIELD_BY_KEY[key]] = value

    lines = ["# actcfg policy imported from a DeepSpeed config (actcfg import)"]
    for key, why in ignored:
        lines.append(_comment(f"ignored {key}: {why}"))
    lines += ["version: 1", "backend: deepspeed"]
    if section is not None:
        pats = list(modules) if modules else [MODULES_PLACEHOLDER]
        if not modules:
            lines.append("# checkpoint.modules: the ds_config cannot say which modules the model "
                         "routes through deepspeed.checkpointing.checkpoint: name them here")
        lines += ["checkpoint:", "  mode: full",
                  f"  modules: [{', '.join(json.dumps(p) for p in pats)}]"]
        for path, entry in TABLE.items():
            if isinstance(entry, Key):
                value = values.get(path, Policy.model_fields[path].default)
                lines.append(f"{path}: {json.dumps(value)}")
    text = "\n".join(lines) + "\n"
    try:
        Policy.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        raise TranslationError(
            SECTION, BACKEND,
            "the ds_config's settings do not form a valid policy (DeepSpeed would assert or "
            f"fail at configure time): {e.errors(include_url=False)[0]['msg']}",
        ) from e
    return ImportResult(yaml=text, ignored=ignored)
