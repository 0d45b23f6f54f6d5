"""Trainer settings read back as a policy: Hugging Face `TrainingArguments` keywords and
Lightning `DeepSpeedStrategy` keywords, each with what the trainer would have ignored or dropped.

Pure: no I/O, no transformers or lightning import. Names come from the hf and lightning tables
in `actcfg.backends`; the DeepSpeed section goes through `import_ds_config`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION
from actcfg.backends.deepspeed import TABLE as DS_TABLE
from actcfg.backends.hf import ARGUMENT, KWARGS, OLD_NAMES
from actcfg.backends.hf import TABLE as HF_TABLE
from actcfg.backends.lightning import CONFIG_SECTION
from actcfg.backends.lightning import TABLE as LIGHTNING_TABLE
from actcfg.backends.table import Key, findings
from actcfg.errors import TranslationError
from actcfg.policy.schema import Policy
from actcfg.translators.ds_config import ALIASES, MODULES_PLACEHOLDER, import_ds_config, yaml_comment

__all__ = ["TrainerImport", "import_strategy_keywords", "import_training_arguments"]

# Keys of activation_checkpointing_kwargs that transformers itself takes out before calling
# torch.utils.checkpoint (trainer.py); the rest go to torch.
_EVERY_N = "every_n_layers"
# Keywords torch.utils.checkpoint.checkpoint takes that a policy has no field for.
_TORCH_ONLY = ("preserve_rng_state", "determinism_check", "debug", "context_fn", "early_stop")


@dataclass(frozen=True)
class TrainerImport:
    """An imported policy as YAML, the (key, why) pairs the trainer would have ignored, the
    (key, why) pairs it accepts but never passes on (imported: actcfg's callback passes them),
    and whether the policy holds the modules placeholder (no --modules or --external given)."""

    yaml: str
    ignored: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    placeholder: bool = False


def _near(key: Any, names: list[str]) -> str | None:
    """The name `key` looks like a misspelling of (or a DeepSpeed alias of), else None."""
    if not isinstance(key, str) or key in names:
        return None
    if key in ALIASES and ALIASES[key][0] in names:
        return ALIASES[key][0]
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
    return match[0] if match else None


def _close(key: str, names: list[str]) -> str:
    near = _near(key, names)
    return f"; did you mean `{near}`?" if near else ""


def _finish(lines: list[str], ignored: list[tuple[str, str]], backend: Backend) -> TrainerImport:
    text = "\n".join(lines) + "\n"
    try:
        # The module placeholder is the user's to replace (validate refuses it until then);
        # every other setting must already form a valid policy.
        policy = Policy.model_validate(yaml.safe_load(text.replace(MODULES_PLACEHOLDER, "Module")))
    except ValidationError as e:
        raise TranslationError(
            backend.value, backend.value,
            f"the settings do not form a valid policy: {e.errors(include_url=False)[0]['msg']}",
        ) from e
    spec = backend.spec
    dropped = []
    for f in findings(spec.table, policy, backend.value, spec.checkpoint_function):
        path = ".".join(f.path)
        dropped.append((path, f"{f.reason.removeprefix(f'`{path}`: ')}; {f.hint}"))
    return TrainerImport(yaml=text, ignored=ignored, dropped=dropped,
                         placeholder=f"[{json.dumps(MODULES_PLACEHOLDER)}]" in text
                         or f"[{MODULES_PLACEHOLDER}]" in text)


# --- Hugging Face ---------------------------------------------------------------------------


def _hf_value(data: dict[str, Any], name: str) -> tuple[str, Any]:
    """(the key used, its value): the new name when set, else its deprecated alias."""
    old = OLD_NAMES[name]
    if data.get(name) is None and data.get(old) is not None:
        return old, data[old]
    return name, data.get(name)


def import_training_arguments(data: Any, *, modules: list[str] | None = None,
                              external: bool = False) -> TrainerImport:
    """The actcfg policy equivalent to Hugging Face `TrainingArguments` keywords (a mapping, such
    as `TrainingArguments.to_dict()`), listing what transformers would ignore. The keywords
    cannot say which layers transformers checkpoints: `modules` names their classes, `external`
    keeps transformers' own checkpointing (`mode: external`); with neither, the policy holds
    the placeholder."""
    if not isinstance(data, dict):
        raise TranslationError("TrainingArguments", Backend.HF.value,
                               f"TrainingArguments keywords are a mapping, got {type(data).__name__}")
    ignored: list[tuple[str, str]] = []
    known = [ARGUMENT, KWARGS, *OLD_NAMES.values()]
    for key in data:
        if _near(key, known):
            ignored.append((key, f"not a TrainingArguments keyword (TrainingArguments(...) raises "
                                 f"TypeError){_close(key, known)}"))
    switch_name, switch = _hf_value(data, ARGUMENT)
    kwargs_name, kwargs = _hf_value(data, KWARGS)
    if isinstance(kwargs, str) and kwargs.startswith("{"):
        try:  # TrainingArguments parses a JSON string here too
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            pass
    if kwargs is not None and not isinstance(kwargs, dict):
        ignored.append((kwargs_name, f"must be a mapping, got {json.dumps(kwargs)}; not imported"))
        kwargs = None
    if switch not in (None, True, False):
        ignored.append((switch_name, f"value {json.dumps(switch)} is not a boolean; actcfg does not "
                                     "guess, so checkpointing was left off: write true or false"))
        switch = False
    field_by_kwarg = {entry.key.removeprefix(f"{KWARGS}."): path for path, entry in HF_TABLE.items()
                      if isinstance(entry, Key) and entry.key.startswith(f"{KWARGS}.")}
    values: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        where = f"{kwargs_name}.{key}"
        if not switch:
            ignored.append((where, f"{switch_name} is off, so transformers never reads it"))
        elif key in field_by_kwarg:
            if type(value) is bool:
                values[field_by_kwarg[key]] = value
            else:
                ignored.append((where, f"value {json.dumps(value)} is not a boolean; not imported: "
                                       "write true or false"))
        elif key == _EVERY_N:
            if type(value) is not int or value < 1:
                ignored.append((where, f"value {json.dumps(value)} is not a whole number >= 1; not "
                                       "imported"))
            elif value > 1:
                n = value
                ignored.append((where, f"transformers checkpoints layers 0, {n}, {2 * n}, ... "
                                       f"({_EVERY_N}: {n}), actcfg's `every: {n}` layers {n - 1}, "
                                       f"{2 * n - 1}, ...: not imported; set `checkpoint.every: {n}` "
                                       "if that shift is what you want"))
        elif key in _TORCH_ONLY:
            ignored.append((where, "a torch.utils.checkpoint keyword actcfg has no field for; not "
                                   "imported"))
        else:
            ignored.append((where, "not a keyword of torch.utils.checkpoint, whose non-reentrant "
                                   "form passes it on to the layer's forward, which swallows it: it "
                                   f"did nothing{_close(key, [*field_by_kwarg, _EVERY_N, *_TORCH_ONLY])}"))

    if switch and external and "checkpoint.reentrant" in values:
        ignored.append((f"{kwargs_name}.use_reentrant",
                        "with --external transformers keeps checkpointing and passes it to torch "
                        "itself; a `mode: external` policy has no reentrant field: not imported"))
        values.pop("checkpoint.reentrant")
    if not switch and (modules or external):
        ignored.append(("--modules" if modules else "--external",
                        f"{switch_name} is off, so transformers checkpoints nothing; not used"))
    lines = ["# actcfg policy imported from Hugging Face TrainingArguments (actcfg import --backend hf)"]
    lines += [_comment(f"ignored {key}: {why}") for key, why in ignored]
    lines += ["version: 1", "backend: torch"]
    if switch and external:
        lines += ["# checkpoint: transformers keeps its own checkpointing; actcfg.integrations.hf "
                  "configures and offloads around it", "checkpoint:", "  mode: external"]
    elif switch:
        if modules:
            lines += ["checkpoint:", "  mode: full", f"  modules: [{', '.join(json.dumps(m) for m in modules)}]"]
        else:
            lines += [
                "# checkpoint.modules: the TrainingArguments keywords cannot say which layers "
                "transformers checkpoints (every GradientCheckpointingLayer of the model): name "
                "your model's decoder layer class here, or write `checkpoint: {mode: external}` "
                "to keep HF's own checkpointing under actcfg.integrations.hf",
                "checkpoint:", "  mode: full", f"  modules: [{json.dumps(MODULES_PLACEHOLDER)}]",
            ]
        if "checkpoint.reentrant" in values:
            lines.append(f"  reentrant: {json.dumps(values.pop('checkpoint.reentrant'))}")
    lines += [f"{path}: {json.dumps(value)}" for path, value in values.items()]
    return _finish(lines, ignored, Backend.HF)


_comment = yaml_comment  # keys come from the user's file: a key cannot end the comment


# --- Lightning --------------------------------------------------------------------------------


def import_strategy_keywords(data: Any, *, modules: list[str] | None = None, external: bool = False,
                             num_checkpoints: int | None = None) -> TrainerImport:
    """The actcfg policy equivalent to Lightning `DeepSpeedStrategy` keywords (a mapping; its
    `config` a mapping too), listing what Lightning would ignore and what it drops. `modules`,
    `external` and `num_checkpoints` mean what they mean for a ds_config (`import_ds_config`)."""
    if not isinstance(data, dict):
        raise TranslationError("DeepSpeedStrategy", Backend.LIGHTNING.value,
                               f"DeepSpeedStrategy keywords are a mapping, got {type(data).__name__}")
    # Lightning names each keyword after its ds_config key. `contiguous` has a keyword too,
    # though the lightning table refuses it (Lightning's configure() call then fails).
    keywords = [entry.key for entry in LIGHTNING_TABLE.values()
                if isinstance(entry, Key) and not entry.key.startswith(f"{CONFIG_SECTION}.")]
    keywords.append(DS_TABLE["contiguous"].key)
    ignored: list[tuple[str, str]] = []
    config = data.get("config")
    if config is not None:
        if not isinstance(config, dict):
            raise TranslationError(
                "config", Backend.LIGHTNING.value,
                f"config= is {type(config).__name__} {json.dumps(config)}: import that DeepSpeed "
                "config with `actcfg import FILE`, or write it here as a mapping")
        for key in data:
            if key in keywords:
                ignored.append((key, "DeepSpeedStrategy ignores its keywords once config= is given"))
        section = config.get(SECTION)
    else:
        section = {key: data[key] for key in keywords if key in data}
        for key in data:
            if _near(key, keywords):
                ignored.append((key, "not a DeepSpeedStrategy keyword (DeepSpeedStrategy(...) raises "
                                     f"TypeError){_close(key, keywords)}"))
    source = "the DeepSpeedStrategy config" if config is not None else "the DeepSpeedStrategy keywords"
    imported = import_ds_config({SECTION: section} if section is not None else {}, modules=modules,
                                external=external, num_checkpoints=num_checkpoints, source=source)
    errors = [f for f in imported.findings if f.severity == "error"]
    if errors or imported.yaml is None:
        raise TranslationError(".".join(map(str, errors[0].path)) if errors else SECTION,
                               Backend.LIGHTNING.value,
                               f"{errors[0].message}; {errors[0].hint}" if errors else "not importable")
    for f in imported.findings:
        if f.code in ("ignored-key", "truthy-value") and len(f.path) == 2:
            key = f.path[1] if config is None else f"{SECTION}.{f.path[1]}"
            ignored.append((key, f.message.removeprefix(f"`{f.path[1]}`: ")))
    lines = ["# actcfg policy imported from Lightning DeepSpeedStrategy keywords "
             "(actcfg import --backend lightning)"]
    lines += [_comment(f"ignored {key}: {why}") for key, why in ignored]
    lines += [line for line in imported.yaml.splitlines()
              if not line.startswith("#") or "checkpoint.modules" in line]
    return _finish(lines, ignored, Backend.LIGHTNING)

