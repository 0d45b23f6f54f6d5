"""suggest: foreign names with their origin, keys of another level, then near spellings."""

from __future__ import annotations

import pytest

from actcfg.policy.schema import Policy
from actcfg.policy.suggest import FOREIGN_NAMES, keys_at, suggest

TOP = keys_at(())
CKPT = keys_at(("checkpoint",), "full")


@pytest.mark.parametrize(
    ("key", "valid", "at", "expected"),
    [
        ("checkpoint_in_cpu", TOP, (),
         "`checkpoint_in_cpu` is the keyword of deepspeed.checkpointing.configure(); "
         "in actcfg it is `cpu_checkpointing`"),
        ("partition_activations", TOP, (),
         "`partition_activations` is the DeepSpeed ds_config `activation_checkpointing` key and "
         "the keyword of deepspeed.checkpointing.configure(); in actcfg it is `partition`"),
        ("contiguous_checkpointing", TOP, (),
         "`contiguous_checkpointing` is the keyword of deepspeed.checkpointing.configure(); "
         "in actcfg it is `contiguous`"),
        ("use_reentrant", TOP, (),
         "`use_reentrant` is the keyword of torch.utils.checkpoint.checkpoint(); "
         "in actcfg it is `reentrant`, under `checkpoint:`"),
        ("use_reentrant", CKPT, ("checkpoint",),
         "`use_reentrant` is the keyword of torch.utils.checkpoint.checkpoint(); "
         "in actcfg it is `reentrant`"),
        ("Pin-Memory", TOP, (),
         "`Pin-Memory` is the keyword of torch.autograd.graph.save_on_cpu(); in actcfg it is `pin`"),
        ("every", TOP, (), "`every` belongs under `checkpoint:`"),
        ("partition", CKPT, ("checkpoint",), "`partition` belongs at the top level, not under `checkpoint:`"),
        ("modules", ("mode",), ("checkpoint",), "`modules` is valid only with `mode: full`, `mode: selective` or `mode: auto`"),
        ("save_ops", CKPT, ("checkpoint",), "`save_ops` is valid only with `mode: selective`"),
        ("cpu_checkpoint", TOP, (), "did you mean `cpu_checkpointing`?"),
        ("Version", TOP, (), "did you mean `version`?"),
        ("zzz", TOP, (), None),
    ],
)
def test_suggest(key, valid, at, expected):
    assert suggest(key, valid, at) == expected


def test_every_foreign_name_points_at_a_real_key():
    for name, (target, origin) in FOREIGN_NAMES.items():
        parent, _, leaf = target.rpartition(".")
        assert leaf in (keys_at((parent,)) if parent else tuple(Policy.model_fields)), name
        assert origin and name not in keys_at(()) and name not in keys_at(("checkpoint",))


def test_the_brief_names_are_all_curated():
    assert {
        "checkpoint_in_cpu", "partition_activations", "partitioned_activations",
        "contiguous_memory_optimization", "contiguous_checkpointing", "number_checkpoints",
        "num_layers", "synchronize_checkpoint_boundary", "gradient_checkpointing",
        "activation_checkpointing", "enable_activation_checkpointing",
        "enable_activation_offloading", "activation_cpu_offload", "offload", "offload_to_cpu",
        "pin_memory", "use_reentrant", "recompute_granularity", "every_n_layers",
    } <= set(FOREIGN_NAMES)


def test_keys_at_levels():
    assert keys_at(("checkpoint",), "none") == ("mode",)
    assert keys_at(("checkpoint",), "full") == ("modules", "every", "reentrant", "mode")
    assert set(keys_at(("checkpoint",), "selective")) == {"mode", "modules", "every", "reentrant", "save_ops"}
    assert keys_at(("pin",)) == ()


@pytest.mark.parametrize("mode", [None, "fulll"])
def test_keys_at_checkpoint_without_a_known_mode_is_every_modes_keys(mode):
    assert keys_at(("checkpoint",), mode) == ("mode", "modules", "every", "reentrant", "save_ops",
                                             "rules", "keep_last", "max_inflight", "predicted",
                                             "submodules")


def test_keys_at_a_rule_and_a_prediction():
    assert keys_at(("checkpoint", "rules", 0)) == ("modules", "mode", "cpu_checkpointing", "save_ops")
    assert keys_at(("checkpoint", "predicted")) == ("step_time_ms", "peak")
    assert keys_at(("checkpoint",), "rules") == ("mode", "rules", "keep_last", "max_inflight", "predicted")
