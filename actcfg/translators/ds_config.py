"""Existing DeepSpeed configs: merge a translated section into one, or import one as a policy.

DeepSpeed reads its `activation_checkpointing` section with `dict.get`: unknown keys are
ignored and values are not type-checked, only tested for truth (`"false"` is a non-empty
string, so ON). Import takes what DeepSpeed ran and says so wherever the file says something
else; merge refuses to write over a value that disagrees with the policy unless asked to
replace it (`translate --merge --replace`), and then names each value it replaced. gpt-neox configs
(`checkpoint-activations`, `partition-activations`, ...) are imported from the flags gpt-neox
passes to `deepspeed.checkpointing.configure`.

Pure: no I/O, no torch, no deepspeed import. Every finding is returned, none raised, so a
caller reports all of them in one run.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION, TABLE
from actcfg.backends.table import Key
from actcfg.errors import TranslationError
from actcfg.policy.schema import MODULES_PLACEHOLDER, Finding, Policy, check_rules
from actcfg.policy.suggest import FOREIGN_NAMES

__all__ = [
    "ALIASES",
    "ImportResult",
    "MODULES_PLACEHOLDER",
    "NEOX_FLAGS",
    "deepspeed_keys",
    "import_ds_config",
    "merge_conflicts",
    "merge_ds_config",
    "placeholder_finding",
    "splice_section",
    "yaml_comment",
]

BACKEND = Backend.DEEPSPEED.value

# JSON key -> actcfg field, from the one DeepSpeed table.
_FIELD_BY_KEY: dict[str, str] = {e.key: path for path, e in TABLE.items() if isinstance(e, Key)}
_KEYS = tuple(_FIELD_BY_KEY)
_COUNT = "number_checkpoints"
_CONTIGUOUS = "contiguous_memory_optimization"

def _aliases() -> dict[str, tuple[str, str]]:
    """Names that look right in a ds_config section but that DeepSpeed ignores: each
    configure() keyword whose JSON key differs, and every foreign name of suggest.py whose
    actcfg field DeepSpeed reads under a JSON key (one table of foreign names, two readers)."""
    out: dict[str, tuple[str, str]] = {
        e.kwarg: (e.key, "the configure() keyword argument name")
        for e in TABLE.values() if isinstance(e, Key) and e.kwarg and e.kwarg != e.key
    }
    for name, (target, origin) in FOREIGN_NAMES.items():
        entry = TABLE.get(target)
        if isinstance(entry, Key) and entry.key != name and name not in out:
            out[name] = (entry.key, origin)
    return out


ALIASES: dict[str, tuple[str, str]] = _aliases()
"""ds_config name DeepSpeed ignores -> (the JSON key it reads, where the name comes from)."""

NEOX_FLAGS: dict[str, str] = {
    "partition_activations": "partition",
    "contiguous_checkpointing": "contiguous",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize_each_layer": "synchronize",
    "profile_backward": "profile",
}
"""gpt-neox flag (underscore spelling; gpt-neox also reads hyphens) -> actcfg field. gpt-neox
passes each to deepspeed.checkpointing.configure (megatron/initialize.py), with
num_checkpoints = ceil(num_layers / checkpoint_num_layers)."""

# Top-level keys of a ds_config that no policy has: what tells a DeepSpeed config from a
# policy given to the wrong command (DeepSpeed's runtime/config.py and constants.py).
_DEEPSPEED_TOP_LEVEL = (SECTION, "train_batch_size", "train_micro_batch_size_per_gpu",
                        "gradient_accumulation_steps", "zero_optimization", "optimizer",
                        "scheduler", "fp16", "bf16", "amp", "gradient_clipping", "steps_per_print",
                        "wall_clock_breakdown", "flops_profiler", "zero_allow_untested_optimizer",
                        "tensorboard", "wandb", "comms_logger", "data_types")

_NEOX_ONLY = ("checkpoint_activations", "checkpoint_num_layers", "synchronize_each_layer",
              "profile_backward", "contiguous_checkpointing", "checkpoint_in_cpu")
_NEOX_SWITCH = "checkpoint_activations"


def _why_ignored(key: str) -> str:
    if key in ALIASES:
        right, origin = ALIASES[key]
        return (f"DeepSpeed reads only its six keys and ignores `{key}` ({origin}); "
                f"the key is `{right}`")
    close = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return f"DeepSpeed reads only {', '.join(_KEYS)} and ignores `{key}`{hint}"


def _section_typo(ds_config: Mapping[str, Any]) -> str | None:
    """A top-level key that looks like a misspelt `activation_checkpointing`."""
    if SECTION in ds_config:
        return None
    for key in ds_config:
        if isinstance(key, str) and difflib.get_close_matches(key, [SECTION], n=1, cutoff=0.8):
            return key
    return None


def _same(a: Any, b: Any) -> bool:
    # `1 == True` in Python, but DeepSpeed and JSON readers tell them apart.
    return type(a) is type(b) and a == b


def _js(value: Any) -> str:
    """`value` as JSON text for a message, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 1


def _on(value: Any) -> str:
    return "ON" if value else "OFF"


def deepspeed_keys(data: Any) -> list[str]:
    """The top-level keys that make `data` a DeepSpeed (or gpt-neox) config rather than an
    actcfg policy, in file order; empty when it is not one (a policy has `version`)."""
    if not isinstance(data, dict) or set(data) & set(Policy.model_fields):
        return []  # a policy, however broken
    if _is_neox(data):
        return [k for k in data if _neox_key(k) in (*NEOX_FLAGS, *_NEOX_ONLY)]
    return [k for k in data if k in _DEEPSPEED_TOP_LEVEL]


def yaml_comment(text: str) -> str:
    """A YAML comment line holding `text` as written (quotes stay quotes). Line breaks (YAML
    also breaks on U+0085, U+2028, U+2029) and other unprintable characters are escaped, so
    text from the user's file cannot end the comment and inject YAML."""
    return "# " + "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)


def placeholder_finding(source: str, path: tuple[Any, ...], external: str) -> Finding:
    """The warning for an imported policy holding `modules: [CHANGE_ME]`: `source` cannot say
    which modules are checkpointed; `external` says when `--external` is the right answer."""
    return Finding(
        "placeholder", "warning", path,
        f"{source} cannot say which modules the model checkpoints: the policy holds "
        f"`modules: [{MODULES_PLACEHOLDER}]`, which validate refuses until it is replaced",
        f"run import with --modules CLASSNAME... (the checkpointed modules' class names), or "
        f"--external {external}")


# --- merge -----------------------------------------------------------------------------------


def merge_conflicts(ds_config: Mapping[str, Any], section: Mapping[str, Any], *,
                    replace: bool = False) -> list[Finding]:
    """Why `ds_config` cannot take `section` as its `activation_checkpointing`: a
    `ds-config-conflict` error per existing key that disagrees or that DeepSpeed would ignore
    (and for a misspelt section name), and a warning when the merged section leaves
    `number_checkpoints` to actcfg.apply. With `replace`, each key that disagrees or that
    DeepSpeed would ignore is a `ds-config-replaced` warning naming the value it had."""
    if replace:
        return [_replaced(f, ds_config) if f.code == "ds-config-conflict" and f.path[:1] == (SECTION,)
                else f for f in merge_conflicts(ds_config, section)]
    out: list[Finding] = []
    typo = _section_typo(ds_config)
    if typo is not None:
        out.append(Finding(
            "ds-config-conflict", "error", (typo,),
            f"DeepSpeed ignores the top-level key `{typo}`; it looks like a misspelt `{SECTION}`",
            "rename or remove it, then merge again"))
    existing = ds_config.get(SECTION)
    if existing is not None and not isinstance(existing, dict):
        return [Finding("ds-config-conflict", "error", (SECTION,),
                        f"`{SECTION}` must be a JSON object, got {_js(existing)}",
                        f"replace it with {{}} or remove it, then merge again")]
    for key, old in (existing or {}).items():
        path = (SECTION, key)
        if key not in section:
            out.append(Finding("ds-config-conflict", "error", path, _why_ignored(key),
                               "remove it from the ds_config"))
            continue
        new = section[key]
        if _same(old, new):
            continue
        field_name = _FIELD_BY_KEY[key]
        message = f"`{key}`: the ds_config has {_js(old)}, the policy gives {_js(new)}"
        if key == _COUNT:
            valid = old is None or _is_count(old)
            hint = f"remove `{key}` from the ds_config" + (
                f", or set `{field_name}: {_js(old)}` in the policy" if valid else
                f" ({_js(old)} is not a count of checkpoints)")
        elif type(old) is bool:
            hint = f"remove `{key}` from the ds_config, or set `{field_name}: {_js(old)}` in the policy"
        else:
            runs = bool(old)
            message += (f"; {_js(old)} is not a JSON boolean, DeepSpeed tests it for truth and "
                        f"runs it {_on(runs)}")
            hint = f"write {_js(new)} in the ds_config, or remove `{key}` there" + (
                "" if runs == new else f", or set `{field_name}: {_js(runs)}` in the policy to "
                                       "keep what DeepSpeed ran")
        out.append(Finding("ds-config-conflict", "error", path, message, hint))
    if section.get(_CONTIGUOUS) and section.get(_COUNT) is None:
        out.append(Finding(
            "num-checkpoints-unset", "warning", (SECTION,),
            f"the merged section has {_CONTIGUOUS} true and {_COUNT} null: actcfg.apply fills "
            "the count in with the number of modules it routes, but DeepSpeed's "
            "configure(deepspeed_config=...) and Lightning assert on null",
            "set `num_checkpoints` in the policy if another program configures DeepSpeed "
            "from this ds_config",
        ))
    return out


def _replaced(conflict: Finding, ds_config: Mapping[str, Any]) -> Finding:
    """A merge conflict as what `--replace` did about it, with the value the file had."""
    key = conflict.path[1] if len(conflict.path) == 2 else None
    old = ds_config[SECTION] if key is None else ds_config[SECTION][key]
    what = conflict.message if key is not None and conflict.message.startswith(f"`{key}`: the ds_config has") \
        else f"`{key or SECTION}` was {_js(old)}: {conflict.message}"
    return Finding("ds-config-replaced", "warning", conflict.path,
                   f"replaced by the policy's section: {what}", "")


def merge_ds_config(ds_config: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """A new ds_config with `activation_checkpointing` = `section`; raises `TranslationError`
    for the first conflict `merge_conflicts` finds, or a misspelt section name."""
    if not isinstance(ds_config, dict):
        raise TranslationError("ds_config", BACKEND,
                               f"a DeepSpeed config is a JSON object, got {type(ds_config).__name__}")
    for finding in merge_conflicts(ds_config, section):
        if finding.severity == "error":
            raise TranslationError(".".join(finding.path), BACKEND,
                                   f"{finding.message}; {finding.hint}")
    merged = {key: copy.deepcopy(value) for key, value in ds_config.items()}
    merged[SECTION] = dict(section)
    return merged


def _line_indent(text: str, offset: int) -> str:
    start = text.rfind("\n", 0, offset) + 1
    return re.match(r"[ \t]*", text[start:offset]).group()


def splice_section(text: str, spans: Mapping[tuple[Any, ...], Any], section: Mapping[str, Any]) -> str:
    """`text` (a ds_config as written, with the member `spans` of its top-level object) with
    the `activation_checkpointing` value replaced by `section`, or the section added as the
    last member. Every other character stays as it was: comments, number spellings
    (`1e-5`, `1e400`), key order and non-ASCII text. Raises `TranslationError` when the
    top level has no braces to add a member inside."""
    root = spans[()]
    top = sorted((span for path, span in spans.items() if len(path) == 1), key=lambda s: s.start)
    one_line = "\n" not in text[root.start:root.end]
    existing = spans.get((SECTION,))
    first = existing if existing is not None else (top[0] if top else None)
    key_indent = _line_indent(text, first.key_start) if first is not None else "  "
    unit = key_indent or "  "
    inner = [span for path, span in spans.items() if len(path) == 2 and path[0] == SECTION]
    if existing is not None and inner:
        found = _line_indent(text, min(s.key_start for s in inner))
        if found.startswith(key_indent) and len(found) > len(key_indent):
            unit = found[len(key_indent):]
    newline = "\r\n" if "\r\n" in text else "\n"
    if one_line:
        body = json.dumps(dict(section), separators=(", ", ": "))
    else:
        body = json.dumps(dict(section), indent=unit).replace("\n", newline + key_indent)
    if existing is not None:
        return text[:existing.start] + body + text[existing.end:]
    if text[root.start:root.start + 1] != "{":
        raise TranslationError(SECTION, BACKEND, "the ds_config's top level has no braces "
                               "(hjson allows that), so actcfg cannot add a member to it: add "
                               f'`"{SECTION}": {{}}` by hand, then merge again')
    member = f'"{SECTION}": {body}'
    if not top:  # `{}`: the section becomes the only member
        if one_line:
            return text[:root.start + 1] + member + text[root.start + 1:]
        rest = text[root.start + 1:].lstrip(" \t")
        return text[:root.start + 1] + newline + key_indent + member + newline + rest
    last = top[-1]
    separator = ", " if one_line else "," + newline + key_indent
    return text[:last.end] + separator + member + text[last.end:]


# --- import ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportResult:
    """An imported policy as YAML (None when an error finding stops it), and every finding,
    each with its path in the imported file."""

    yaml: str | None
    findings: list[Finding] = field(default_factory=list)
    source: str = "deepspeed"
    """`deepspeed` (an activation_checkpointing section, or none) or `gpt-neox` (its flags)."""

    @property
    def ok(self) -> bool:
        """No error finding: the YAML was written."""
        return self.yaml is not None


_comment = yaml_comment


def _neox_key(key: Any) -> str | None:
    return key.replace("-", "_") if isinstance(key, str) else None


def _is_neox(ds_config: Mapping[str, Any]) -> bool:
    names = {_neox_key(k) for k in ds_config}
    hyphenated = any(isinstance(k, str) and "-" in k and _neox_key(k) in (*NEOX_FLAGS, *_NEOX_ONLY)
                     for k in ds_config)
    return (hyphenated or bool(names & set(_NEOX_ONLY))
            or ("partition_activations" in names and "num_layers" in names))


def _flag(key: str, value: Any, name: str, findings: list[Finding], path: tuple[Any, ...],
          reader: str) -> bool:
    """What runs for a switch written as `value`: its truth, with a warning when the file says
    it another way. `reader` is the program whose reading is described (DeepSpeed tests its
    six values with `if`)."""
    if type(value) is bool:
        return value
    runs = bool(value)
    how = (f"DeepSpeed tests it for truth and runs it {_on(runs)}" if reader == "DeepSpeed"
           else f"a Python `if` reads it as {_on(runs)}")
    findings.append(Finding(
        "truthy-value", "warning", path,
        f"`{key}` is {_js(value)}, not a boolean: {how}; imported as `{name}: {_js(runs)}`",
        f"write {_js(runs)} in the file to say what runs",
    ))
    return runs


def _checkpoint_lines(modules: Sequence[str] | None, external: bool) -> list[str]:
    if external:
        return ["checkpoint:", "  mode: external"]
    patterns = list(modules) if modules else [MODULES_PLACEHOLDER]
    return ["checkpoint:", "  mode: full", f"  modules: [{', '.join(json.dumps(p) for p in patterns)}]"]


def _render(header: list[str], checkpoint: list[str], values: dict[str, Any] | None) -> str:
    """The policy YAML: every DeepSpeed setting explicit when `values` is given (None: no
    section, DeepSpeed's defaults)."""
    lines = [*header, "version: 1", "backend: deepspeed", *checkpoint]
    for path, entry in TABLE.items():
        if isinstance(entry, Key) and values is not None:
            lines.append(f"{path}: {json.dumps(values.get(path, Policy.model_fields[path].default))}")
    return "\n".join(lines) + "\n"


_IMPORT_HINTS = {
    "contiguous-needs-num-checkpoints":
        "run import with --num-checkpoints N, N the number of checkpointed calls per step "
        "(Megatron passes its --num-layers), or with --modules to let actcfg.apply count them",
}


def _policy_findings(text: str, where: Mapping[str, tuple[Any, ...]], fallback: tuple[Any, ...],
                     placeholder: bool) -> list[Finding]:
    """The schema's findings for the imported YAML, each at the file key it came from."""
    import yaml

    found: list[Finding] = []
    if placeholder:
        # The placeholder is refused by design (the caller says why, and what to pass); check
        # every other rule on the policy as it will be once a name replaces it.
        text = text.replace(json.dumps(MODULES_PLACEHOLDER), json.dumps("_"))
    try:
        policy = Policy.model_validate(yaml.safe_load(text))
        found = list(check_rules(policy))
    except ValidationError as e:
        for error in e.errors(include_url=False):
            found.extend((error.get("ctx") or {}).get("findings", ())
                         or [Finding("bad-value", "error", (), error["msg"], "fix the file")])
    out = []
    for f in found:
        path = where.get(".".join(f.path), fallback)
        out.append(Finding(f.code, f.severity, path, f.message, _IMPORT_HINTS.get(f.code, f.hint)))
    return out


def _import_neox(ds_config: Mapping[str, Any], modules: Sequence[str] | None,
                 num_checkpoints: int | None) -> ImportResult:
    findings: list[Finding] = []
    seen: dict[str, tuple[str, Any]] = {}
    for key, value in ds_config.items():
        name = _neox_key(key)
        if name is None:
            continue
        if name in seen:
            findings.append(Finding(
                "neox-spelled-twice", "warning", (key,),
                f"`{key}` and `{seen[name][0]}` are the same gpt-neox flag; gpt-neox reads the "
                f"last one, {_js(value)}", f"keep one spelling of `{name}`"))
        seen[name] = (key, value)
    switch_key = seen.get(_NEOX_SWITCH, ("checkpoint-activations", False))[0]
    on = (_flag(switch_key, seen[_NEOX_SWITCH][1], "checkpoint", findings, (switch_key,), "gpt-neox")
          if _NEOX_SWITCH in seen else False)
    values: dict[str, Any] = {}
    where: dict[str, tuple[Any, ...]] = {}
    for flag, field_name in NEOX_FLAGS.items():
        if flag not in seen:
            continue
        key, value = seen[flag]
        where[field_name] = (key,)
        runs = _flag(key, value, field_name, findings, (key,), "gpt-neox")
        if runs and not on:
            findings.append(Finding(
                "ignored-key", "warning", (key,),
                f"`{key}` is on, but `{switch_key}` is off: gpt-neox checkpoints nothing, so it "
                "does nothing; not imported", f"set `{switch_key}: true`, or remove `{key}`"))
        elif on:
            values[field_name] = runs
    header = ["# actcfg policy imported from a gpt-neox config (actcfg import): gpt-neox calls",
              "# deepspeed.checkpointing.checkpoint itself and passes these flags to configure()"]
    if not on:
        header.append(f"# {switch_key} is off or absent: gpt-neox checkpoints nothing")
        return _result(_render(header, [], None), findings, "gpt-neox")
    if values.get("contiguous"):
        layers = seen.get("num_layers")
        chunk_key, chunk = seen.get("checkpoint_num_layers", ("checkpoint-num-layers", 1))
        where["num_checkpoints"] = seen["contiguous_checkpointing"][:1]
        if num_checkpoints is not None:
            values["num_checkpoints"] = num_checkpoints
        elif layers is not None and _is_count(layers[1]) and _is_count(chunk):
            values["num_checkpoints"] = -(-layers[1] // chunk)
            header.append(f"# num_checkpoints: ceil({layers[0]} / {chunk_key}), as gpt-neox passes it")
    text = _render(header, _checkpoint_lines(modules, not modules), values)
    return _result(text, findings + _policy_findings(text, where, (switch_key,), False), "gpt-neox")


def _result(text: str, findings: list[Finding], source: str) -> ImportResult:
    errors = any(f.severity == "error" for f in findings)
    return ImportResult(None if errors else text, findings, source)


def import_ds_config(ds_config: Any, *, modules: Sequence[str] | None = None,
                     external: bool = False, num_checkpoints: int | None = None,
                     source: str = "the ds_config") -> ImportResult:
    """The actcfg policy for what DeepSpeed runs from `ds_config` (a parsed ds_config, or a
    gpt-neox config), as YAML, with every finding.

    A ds_config cannot say which modules go through deepspeed.checkpointing.checkpoint (the
    model code decides): `modules` names them (`checkpoint: {mode: full}`), `external` says the
    model calls it itself (`mode: external`); with neither, the YAML holds the placeholder
    `CHANGE_ME`, which validation refuses until it is replaced. `num_checkpoints` is the count
    the program passes to configure() itself (Megatron: its layer count), which the file
    cannot hold when it leaves number_checkpoints out. `source` names what was read, in the
    placeholder's sentences (Lightning's import passes its keywords through here).
    """
    if not isinstance(ds_config, dict):
        return ImportResult(None, [Finding(
            "bad-value", "error", (), f"a DeepSpeed config is a JSON object, not {_js(ds_config)}",
            "pass the ds_config.json file")])
    if "version" in ds_config and set(ds_config) <= set(Policy.model_fields):
        return ImportResult(None, [Finding(
            "not-a-ds-config", "error", ("version",),
            "this is an actcfg policy (it has `version` and only policy keys), not a DeepSpeed "
            "config: import reads a ds_config and writes a policy",
            "check the policy with `actcfg validate FILE`, or write its DeepSpeed section with "
            "`actcfg translate FILE --backend deepspeed`")])
    if _is_neox(ds_config):
        # gpt-neox's model calls deepspeed.checkpointing.checkpoint itself: external, unless
        # the caller names modules to route instead.
        return _import_neox(ds_config, None if external else modules, num_checkpoints)
    findings: list[Finding] = []
    typo = _section_typo(ds_config)
    if typo is not None:
        findings.append(Finding(
            "ignored-key", "warning", (typo,),
            f"DeepSpeed ignores the top-level key `{typo}`: it looks like a misspelt `{SECTION}`, "
            "so nothing in it was imported", f"rename it to `{SECTION}`"))
    for key in ds_config:
        if key in _FIELD_BY_KEY:
            findings.append(Finding(
                "ignored-key", "warning", (key,),
                f"DeepSpeed reads `{key}` only inside `{SECTION}` and ignores it at the top level; "
                "not imported", f"move it into `{SECTION}`"))
    header = ["# actcfg policy imported from a DeepSpeed config (actcfg import)"]
    if SECTION not in ds_config:
        if not modules and not external:
            header.append(f"# no {SECTION} section: DeepSpeed's defaults, nothing checkpointed")
            return _result(_render(header, [], None), findings, "deepspeed")
        # The caller says the model routes modules through deepspeed.checkpointing.checkpoint
        # (or calls it itself): that runs with DeepSpeed's defaults, which the policy spells
        # out. Dropping --modules here would import "nothing checkpointed", silently.
        header.append(f"# no {SECTION} section: DeepSpeed's defaults")
        values_default: dict[str, Any] = {}
        if num_checkpoints is not None:
            values_default["num_checkpoints"] = num_checkpoints
        text = _render(header, _checkpoint_lines(modules, external), values_default)
        return _result(text, findings + _policy_findings(text, {}, (), False), "deepspeed")
    section = ds_config[SECTION]
    if not isinstance(section, dict):
        what = ("null: DeepSpeed fails when it builds its config (AttributeError: 'NoneType' "
                "object has no attribute 'get'), it does not take null for 'no section'"
                if section is None else
                f"{_js(section)}, not a JSON object: DeepSpeed fails when it builds its config")
        findings.append(Finding("bad-value", "error", (SECTION,), f"`{SECTION}` is {what}",
                                f"write `\"{SECTION}\": {{}}` for DeepSpeed's defaults, or remove it"))
        return _result("", findings, "deepspeed")
    values: dict[str, Any] = {}
    where: dict[str, tuple[Any, ...]] = {}
    for key, value in section.items():
        if key not in _FIELD_BY_KEY:
            findings.append(Finding("ignored-key", "warning", (SECTION, key), _why_ignored(key),
                                    "DeepSpeed would ignore it; it was not imported"))
        elif key != _COUNT:
            field_name = _FIELD_BY_KEY[key]
            where[field_name] = (SECTION, key)
            values[field_name] = _flag(key, value, field_name, findings, (SECTION, key), "DeepSpeed")
    count = section.get(_COUNT)
    path = (SECTION, _COUNT)
    contiguous = values.get("contiguous", False)
    where["num_checkpoints"] = path if _COUNT in section else (SECTION, _CONTIGUOUS)
    if num_checkpoints is not None:
        values["num_checkpoints"] = num_checkpoints
        if _COUNT in section and not _same(count, num_checkpoints):
            findings.append(Finding(
                "ignored-key", "warning", path,
                f"`{_COUNT}` is {_js(count)}, but --num-checkpoints gives {num_checkpoints}, the "
                "count the program passes to configure() (which overrides the file's): "
                f"imported {num_checkpoints}", f"remove `{_COUNT}`, or make the two agree"))
    elif _is_count(count):
        values["num_checkpoints"] = count
    elif not contiguous:
        if count is not None:
            findings.append(Finding(
                "ignored-key", "warning", path,
                f"`{_COUNT}` is {_js(count)}, which is not a count, but DeepSpeed reads it only "
                f"with {_CONTIGUOUS} on, and it is off here: never read; not imported",
                f"remove `{_COUNT}`, or write a whole number of at least 1"))
    elif not external:  # with `mode: external` the schema's rule says it, as an error
        fails = ("asserts at configure() (`Must specify the number of layers`)" if count is None else
                 f"fails when it sizes its buffers with {_js(count)}")
        wrote = "no count" if _COUNT not in section else f"{_COUNT} {_js(count)}"
        findings.append(Finding(
            "num-checkpoints-unset", "warning", path if _COUNT in section else (SECTION, _CONTIGUOUS),
            f"{_CONTIGUOUS} is on with {wrote}: DeepSpeed {fails} when configure() reads this "
            "section; Megatron-DeepSpeed and gpt-neox pass num_checkpoints to configure() "
            "themselves, and actcfg.apply passes the number of modules it routes (with "
            "`mode: full`); imported without num_checkpoints",
            "set `num_checkpoints` in the policy if another program configures DeepSpeed from "
            "this section, or if the model checkpoints itself (`mode: external`)"))
    placeholder = not modules and not external
    if placeholder:
        header.append(f"# checkpoint.modules: {source} cannot say which modules the model "
                      "routes through deepspeed.checkpointing.checkpoint: name them here")
        findings.append(placeholder_finding(
            source, (SECTION,), "if the model calls deepspeed.checkpointing.checkpoint itself"))
    for f in findings:
        if f.code in ("ignored-key", "truthy-value") and len(f.path) == 2:
            header.append(_comment(f.message))
    text = _render(header, _checkpoint_lines(modules, external), values)
    findings += _policy_findings(text, where, (SECTION,), placeholder)
    return _result(text, findings, "deepspeed")
