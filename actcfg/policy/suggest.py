"""Did-you-mean for unknown keys: names other tools use, keys of another level, near spellings.

The seed bug of actcfg was a key read under another tool's name (`checkpoint_in_cpu` for
`cpu_checkpointing`), so foreign names come first and say where they come from.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from actcfg.policy.schema import (
    AutoCheckpoint,
    ExternalCheckpoint,
    FullCheckpoint,
    NoCheckpoint,
    Policy,
    Prediction,
    Rule,
    RulesCheckpoint,
    SelectiveCheckpoint,
)

__all__ = ["FOREIGN_NAMES", "keys_at", "suggest"]

_DS_KWARG = "the keyword of deepspeed.checkpointing.configure()"
_DS_JSON = "the DeepSpeed ds_config `activation_checkpointing` key"

FOREIGN_NAMES: dict[str, tuple[str, str]] = {
    # DeepSpeed: ds_config JSON keys and configure() keywords (they differ; see BACKENDS.md 1.1)
    "checkpoint_in_cpu": ("cpu_checkpointing", _DS_KWARG),
    "partition_activations": ("partition", f"{_DS_JSON} and {_DS_KWARG}"),
    "partitioned_activations": (
        "partition",
        "a misspelling in DeepSpeed's own ACTIVATION_CHKPT_FORMAT that DeepSpeed never reads",
    ),
    "partition_activation": (
        "partition", "from DeepSpeed's Megatron tutorial; configure() rejects it with TypeError"
    ),
    "contiguous_memory_optimization": ("contiguous", _DS_JSON),
    "contiguous_checkpointing": ("contiguous", _DS_KWARG),
    "number_checkpoints": ("num_checkpoints", _DS_JSON),
    "num_layers": (
        "num_checkpoints", "Megatron's --num-layers, from which Megatron-DeepSpeed derives number_checkpoints"
    ),
    "synchronize_checkpoint_boundary": ("synchronize", _DS_JSON),
    "contigious_checkpointing": (
        "contiguous", "Megatron-DeepSpeed's misspelt --contigious-checkpointing flag"
    ),
    "synchronize_each_layer": ("synchronize", "Megatron-DeepSpeed's --synchronize-each-layer"),
    "profile_backward": ("profile", "Megatron-DeepSpeed's --profile-backward"),
    # torch, Hugging Face, Lightning, torchtune, torchtitan, Megatron-Core, NeMo, Composer, Axolotl
    "gradient_checkpointing": (
        "checkpoint", "the Hugging Face Transformers / Axolotl switch (`checkpoint: {mode: full, modules: [...]}`)"
    ),
    "activation_checkpointing": (
        "checkpoint",
        "the DeepSpeed ds_config section and the HF Transformers / Composer switch "
        "(`checkpoint: {mode: full, modules: [...]}`)",
    ),
    "enable_activation_checkpointing": ("checkpoint", "torchtune's switch"),
    "fsdp_activation_checkpointing": ("checkpoint", "HF Accelerate's FSDP switch"),
    "activations_checkpoint_granularity": ("checkpoint.mode", "NeMo 1.x"),
    "recompute_granularity": ("checkpoint.mode", "Megatron-Core (full | selective)"),
    "ac_mode": ("checkpoint.mode", "torchtune"),
    "recompute_modules": ("checkpoint.modules", "Megatron-Core"),
    "recompute_num_layers": ("checkpoint.every", "Megatron-Core (closest actcfg setting)"),
    "every_n_layers": ("checkpoint.every", "HF Transformers' activation_checkpointing_kwargs"),
    "selective_ac_option": ("checkpoint.every", "torchtitan's layer-frequency option"),
    "save_list": ("checkpoint.save_ops", "torchtitan's selective-AC op list"),
    "use_reentrant": ("checkpoint.reentrant", "the keyword of torch.utils.checkpoint.checkpoint()"),
    "activation_checkpointing_reentrant": ("checkpoint.reentrant", "Composer's FSDP setting"),
    "distribute_saved_activations": ("partition", "Megatron-Core"),
    "enable_activation_offloading": ("cpu_checkpointing", "torchtune's switch"),
    "activation_offloading": ("cpu_checkpointing", "Axolotl's switch"),
    "activation_cpu_offload": ("cpu_checkpointing", "Composer's FSDP setting"),
    "cpu_offloading": ("cpu_checkpointing", "Megatron-Core / NeMo"),
    "cpu_offload": ("cpu_checkpointing", "a common trainer spelling"),
    "offload": ("cpu_checkpointing", "HF Transformers' activation_checkpointing_kwargs"),
    "offload_to_cpu": ("cpu_checkpointing", "torch FSDP's naming for host offload"),
    "offload_activations": ("cpu_checkpointing", "a common trainer spelling"),
    "pin_memory": ("pin", "the keyword of torch.autograd.graph.save_on_cpu()"),
    "pinned": ("pin", "a common spelling"),
    "schema_version": ("version", "a common spelling"),
    "activation_memory_budget": (
        "memory_budget",
        "torch.compile's budget (torch._functorch.config), a fraction of the activations; "
        "actcfg's is a size, with `checkpoint: {mode: auto, modules: [...]}`",
    ),
}
"""Names other tools use for an actcfg setting: foreign name -> (actcfg dotted key, origin)."""


_CHECKPOINT_BY_MODE = {"none": NoCheckpoint, "full": FullCheckpoint, "selective": SelectiveCheckpoint,
                       "external": ExternalCheckpoint, "rules": RulesCheckpoint, "auto": AutoCheckpoint}


def keys_at(at_path: tuple[str | int, ...], mode: str | None = None) -> tuple[str, ...]:
    """The valid keys of the mapping at `at_path` (the top level, or `checkpoint` in `mode`).

    Under `checkpoint` with a missing or unknown `mode`, the union of every mode's keys: the
    mode the user meant is not known, so no key of any mode is called invalid.
    """
    if not at_path:
        return tuple(Policy.model_fields)
    if tuple(at_path) == ("checkpoint",):
        model = _CHECKPOINT_BY_MODE.get(mode) if mode is not None else None
        if model is None:
            return tuple(dict.fromkeys(k for m in _CHECKPOINT_BY_MODE.values() for k in m.model_fields))
        return tuple(model.model_fields)
    if len(at_path) == 3 and tuple(at_path[:2]) == ("checkpoint", "rules") and isinstance(at_path[2], int):
        return tuple(Rule.model_fields)
    if tuple(at_path) == ("checkpoint", "predicted"):
        return tuple(Prediction.model_fields)
    return ()


def _under(dotted: str) -> str:
    parent, _, _ = dotted.rpartition(".")
    return f"under `{parent}:`" if parent else "at the top level"


def suggest(key: str, valid_keys: Iterable[str], at_path: tuple[str | int, ...] = ()) -> str | None:
    """A did-you-mean sentence for the unknown `key` in the mapping at `at_path`, or None."""
    valid = tuple(valid_keys)
    here = ".".join(str(p) for p in at_path)
    name = str(key)
    folded = name.strip().lower().replace("-", "_")
    if folded in FOREIGN_NAMES:
        target, origin = FOREIGN_NAMES[folded]
        leaf = target.rpartition(".")[2]
        where = "" if target.rpartition(".")[0] == here else f", {_under(target)}"
        return f"`{name}` is {origin}; in actcfg it is `{leaf}`{where}"
    if folded != name and folded in valid:
        return f"did you mean `{folded}`?"
    # A key of another level: `every` at the top level, `partition` under `checkpoint`.
    if here == "checkpoint" and folded in Policy.model_fields:
        return f"`{folded}` belongs at the top level, not under `checkpoint:`"
    checkpoint_keys = keys_at(("checkpoint",))
    if not at_path and folded in checkpoint_keys:
        return f"`{folded}` belongs under `checkpoint:`"
    if here == "checkpoint" and folded in checkpoint_keys:
        modes = [f"`mode: {m}`" for m, model in _CHECKPOINT_BY_MODE.items() if folded in model.model_fields]
        needs = modes[0] if len(modes) == 1 else ", ".join(modes[:-1]) + " or " + modes[-1]
        return f"`{folded}` is valid only with {needs}"
    close = difflib.get_close_matches(folded, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return None
