"""Hugging Face Transformers: the `TrainingArguments` keywords that turn on its own checkpointing.

`activation_checkpointing=True` (5.x; `gradient_checkpointing` before) checkpoints every
`GradientCheckpointingLayer` of the model; `activation_checkpointing_kwargs` takes `use_reentrant`
and `offload` (`save_on_cpu(pin_memory=True)` around each checkpointed call). What it cannot
express is refused here; the `actcfg.integrations.hf` callback runs any policy instead.
"""

from __future__ import annotations

from actcfg.backends._deepspeed_only import deepspeed_only
from actcfg.backends._torch_only import per_module_rejections, plan_fields
from actcfg.backends.table import Entry, Key, Meta, Rejection, RoutedBy, Unsupported

__all__ = ["ARGUMENT", "KWARGS", "OLD_NAMES", "TABLE"]

ARGUMENT = "activation_checkpointing"
"""The TrainingArguments switch (transformers 5.24; `gradient_checkpointing` before, see OLD_NAMES)."""
KWARGS = "activation_checkpointing_kwargs"
"""The TrainingArguments dict passed on to `activation_checkpointing_enable()`."""
OLD_NAMES = {ARGUMENT: "gradient_checkpointing", KWARGS: "gradient_checkpointing_kwargs"}
"""The names transformers used before 5.24 renamed them (5.17 knows only these; 5.24 takes them
as deprecated aliases, the new name winning when both are set)."""

_CALLBACK = "or run the policy with actcfg.integrations.hf.ActivationPolicyCallback"
_PER_MODULE = ("run the policy with actcfg.integrations.hf.ActivationPolicyCallback, which applies "
               "it with torch")

TABLE: dict[str, Entry] = {
    "version": Meta("schema version of the policy file"),
    "backend": Meta("chooses the translator"),
    "checkpoint.mode": RoutedBy(
        "transformers", ARGUMENT,
        rejects=(
            Rejection(
                "selective", "not-in-hf",
                "checkpoint.mode `selective` has no TrainingArguments equivalent: transformers "
                "checkpoints whole layers", f"use `mode: full`, {_CALLBACK}"),
            *per_module_rejections(_PER_MODULE, code="not-in-hf"),
        ),
    ),
    "checkpoint.modules": RoutedBy(
        "transformers", "(every GradientCheckpointingLayer)",
        rejects=(
            Rejection(
                lambda patterns: any("." in p for p in patterns), "not-in-hf",
                "`checkpoint.modules` names qualified module names; transformers checkpoints every "
                "decoder layer of the model (its GradientCheckpointingLayer subclasses) and cannot "
                "choose by name", f"name the decoder layer class, such as `[LlamaDecoderLayer]`, {_CALLBACK}"),
            Rejection(
                lambda patterns: any(c in p for p in patterns for c in "*?["), "not-in-hf",
                "`checkpoint.modules` uses a wildcard; transformers checkpoints every decoder layer "
                "of the model (its GradientCheckpointingLayer subclasses), whatever a pattern "
                "matches, so only the layer class's own name says the same",
                f"name the decoder layer class, such as `[LlamaDecoderLayer]`, {_CALLBACK}"),
        ),
    ),
    "checkpoint.every": Unsupported(
        "not-in-hf",
        "`checkpoint.every` has no exact TrainingArguments equivalent: transformers' "
        "`every_n_layers` checkpoints layers 0, n, 2n, ..., actcfg's `every` the n-th, 2n-th, ...",
        f"remove `every`, {_CALLBACK}"),
    "checkpoint.reentrant": Key(f"{KWARGS}.use_reentrant"),
    "checkpoint.save_ops": Unsupported(
        "not-in-hf", "`checkpoint.save_ops` has no TrainingArguments equivalent (op-level saving)",
        f"remove `save_ops`, {_CALLBACK}"),
    "cpu_checkpointing": Key(f"{KWARGS}.offload", needs_checkpoint=True,
                             hint_without_checkpoint="offloading every activation needs actcfg's engine"),
    "pin": Unsupported(
        "not-in-hf", "`pin: false` has no TrainingArguments equivalent: transformers' offload "
        "always pins", f"remove `pin`, {_CALLBACK}"),
    "pin_budget": Unsupported(
        "not-in-hf", "`pin_budget` has no TrainingArguments equivalent: transformers' offload "
        "(torch's save_on_cpu) cannot bound its pinned memory", f"remove `pin_budget`, {_CALLBACK}"),
    "pin_budget_per_node": Unsupported(
        "not-in-hf", "`pin_budget_per_node` has no TrainingArguments equivalent: transformers' "
        "offload (torch's save_on_cpu) cannot bound the pinned memory of a node's ranks",
        f"remove `pin_budget_per_node`, {_CALLBACK}"),
    **plan_fields("not-in-hf", _PER_MODULE),
    **deepspeed_only(),
}
"""Policy field -> TrainingArguments keyword (dotted: a key of `activation_checkpointing_kwargs`)."""
