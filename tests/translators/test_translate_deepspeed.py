"""actcfg.translators.deepspeed against the real DeepSpeed: its config parser and configure()."""

from __future__ import annotations

import inspect
import json

import pytest

from actcfg.errors import TranslationError
from actcfg.backends.deepspeed import TABLE
from actcfg.backends.table import Key, Meta, RoutedBy, Unsupported
from actcfg.policy.schema import Policy, policy_field_paths
from actcfg.translators import TRANSLATORS, translate
from actcfg.translators.deepspeed import to_deepspeed

try:
    from tests._deepspeed_env import ds_env, ds_globals
    from tests._translate_cases import CASES, case_policies, check_golden, golden_names, orphan_goldens
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env, ds_globals
    from _translate_cases import CASES, case_policies, check_golden, golden_names, orphan_goldens

__all__ = ["ds_env"]  # the fixture is used by name

SIX_JSON = ["partition_activations", "contiguous_memory_optimization", "number_checkpoints",
            "cpu_checkpointing", "synchronize_checkpoint_boundary", "profile"]
SIX_KWARGS = ["partition_activations", "contiguous_checkpointing", "num_checkpoints",
              "checkpoint_in_cpu", "synchronize", "profile"]
FIELDS = ["partition", "contiguous", "num_checkpoints", "cpu_checkpointing", "synchronize",
          "profile"]


def _ds_ok() -> dict[str, Policy]:
    """Case policies and configs/ files that DeepSpeed can express."""
    out = {}
    for name, policy in golden_names().items():
        try:
            to_deepspeed(policy)
        except TranslationError:
            continue
        out[name] = policy
    return out


DS_OK = _ds_ok()


def test_ds_ok_covers_every_setting() -> None:
    """The parametrized DeepSpeed cases turn every one of the six settings on somewhere."""
    for name in FIELDS:
        assert any(getattr(p, name) not in (False, None) for p in DS_OK.values()), name


def test_translators_import_no_torch() -> None:
    """The translate path stays light: no torch, no deepspeed, even after translating."""
    import subprocess
    import sys

    code = (
        "import sys, actcfg.translators as t\n"
        "from actcfg.policy.schema import Policy\n"
        "p = Policy.model_validate({'version': 1, 'checkpoint': {'mode': 'full', 'modules': ['B']},"
        " 'cpu_checkpointing': True})\n"
        "t.translate(p, 'deepspeed'); t.translate(p, 'torch')\n"
        "t.import_ds_config({'activation_checkpointing': {'cpu_checkpointing': True}})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


# --- the table --------------------------------------------------------------------------


def test_table_covers_every_schema_field() -> None:
    paths = policy_field_paths()
    assert "checkpoint.save_ops" in paths and "checkpoint.reentrant" in paths
    assert [p for p in paths if p not in TABLE] == []
    assert [p for p in TABLE if p not in paths] == []
    assert all(isinstance(e, (Key, RoutedBy, Unsupported, Meta)) for e in TABLE.values())


@pytest.mark.deepspeed
def test_table_keys_are_deepspeeds_six(ds_env) -> None:
    """The JSON keys are exactly DeepSpeed's own defaults' keys, the kwargs exactly
    configure()'s keyword parameters."""
    configure = ds_env.configure
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT

    keys = [e for e in TABLE.values() if isinstance(e, Key)]
    assert sorted(k.key for k in keys) == sorted(ACT_CHKPT_DEFAULT)
    params = list(inspect.signature(configure).parameters)
    assert params[:2] == ["mpu_", "deepspeed_config"]
    assert [k.kwarg for k in keys] == params[2:] == SIX_KWARGS


# --- output shape -------------------------------------------------------------------------


def test_output_shape_and_order() -> None:
    policy = Policy.model_validate(CASES["ds-cpu"])
    out = to_deepspeed(policy)
    assert list(out) == ["activation_checkpointing", "configure_kwargs", "route"]
    assert list(out["activation_checkpointing"]) == SIX_JSON
    assert list(out["configure_kwargs"]) == SIX_KWARGS
    assert out["route"] == {"function": "deepspeed.checkpointing.checkpoint",
                            "modules": ["Block"], "every": 1}
    assert out["activation_checkpointing"]["cpu_checkpointing"] is True
    assert out["configure_kwargs"]["checkpoint_in_cpu"] is True


def test_no_checkpointing_routes_nothing() -> None:
    out = to_deepspeed(Policy.model_validate({"version": 1, "backend": "deepspeed"}))
    assert out["route"] is None
    assert out["activation_checkpointing"] == dict.fromkeys(SIX_JSON, False) | {
        "number_checkpoints": None}


def test_every_value_comes_from_the_policy() -> None:
    policy = Policy.model_validate(CASES["ds-everything"])
    out = to_deepspeed(policy)
    for name, key, kwarg in zip(FIELDS, SIX_JSON, SIX_KWARGS):
        assert out["activation_checkpointing"][key] == getattr(policy, name)
        assert out["configure_kwargs"][kwarg] == getattr(policy, name)


def test_translate_registry_and_str_backend() -> None:
    policy = Policy.model_validate(CASES["torch-full"])
    assert set(TRANSLATORS) == {"deepspeed", "hf", "lightning", "torch"}
    assert translate(policy, "deepspeed") == to_deepspeed(policy)
    assert json.loads(json.dumps(translate(policy, "deepspeed"))) == to_deepspeed(policy)
    assert translate(Policy.model_validate(CASES["ds-cpu"])) == to_deepspeed(
        Policy.model_validate(CASES["ds-cpu"]))


def test_translate_unknown_backend() -> None:
    from actcfg.errors import ActcfgError

    with pytest.raises(ActcfgError, match=r"^unknown backend 'jax': choose one of deepspeed, hf, lightning, torch$"):
        translate(Policy.model_validate({"version": 1}), "jax")


# --- what DeepSpeed cannot express -------------------------------------------------------

REFUSED = {
    "selective": (
        {"version": 1, "checkpoint": {"mode": "selective", "modules": ["Block"]}},
        "checkpoint.mode",
        "checkpoint.mode `selective` is torch-only: DeepSpeed recomputes whole modules (got "
        "'selective'); use `mode: full`, or set `backend: torch`",
    ),
    "reentrant-true": (
        {"version": 1, "checkpoint": {"mode": "full", "modules": ["B"], "reentrant": True}},
        "checkpoint.reentrant",
        "`checkpoint.reentrant` is torch-only: DeepSpeed always routes through "
        "deepspeed.checkpointing.checkpoint, which has no reentrant switch (got True); remove "
        "`reentrant`, or set `backend: torch`",
    ),
    "reentrant-false-explicit": (
        {"version": 1, "checkpoint": {"mode": "full", "modules": ["B"], "reentrant": False}},
        "checkpoint.reentrant",
        "`checkpoint.reentrant` is torch-only: DeepSpeed always routes through "
        "deepspeed.checkpointing.checkpoint, which has no reentrant switch (got False); remove "
        "`reentrant`, or set `backend: torch`",
    ),
    "pin-false": (
        {"version": 1, "checkpoint": {"mode": "full", "modules": ["B"]}, "pin": False},
        "pin",
        "`pin: false` is torch-only: DeepSpeed always offloads into pinned host memory (got "
        "False); remove `pin`, or set `backend: torch`",
    ),
    "pin-budget": (
        {"version": 1, "checkpoint": {"mode": "full", "modules": ["B"]},
         "cpu_checkpointing": True, "pin_budget": "1GiB"},
        "pin_budget",
        "`pin_budget` is torch-only: DeepSpeed cannot bound its pinned host memory (got "
        "1073741824); remove `pin_budget`, or set `backend: torch`",
    ),
    "cpu-without-checkpointing": (
        {"version": 1, "cpu_checkpointing": True},
        "cpu_checkpointing",
        "`cpu_checkpointing` acts only inside deepspeed.checkpointing.checkpoint, but "
        "checkpoint.mode is none: it would do nothing (got True); set `checkpoint: {mode: full, "
        "modules: [...]}`, or remove `cpu_checkpointing` (offloading every activation is "
        "torch-only)",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refuses_what_deepspeed_cannot_express(name: str) -> None:
    """Policies valid for torch that DeepSpeed cannot run raise, naming the field."""
    data, field, reason = REFUSED[name]
    policy = Policy.model_validate(data)  # valid: backend torch
    with pytest.raises(TranslationError) as info:
        to_deepspeed(policy)
    assert (info.value.field, info.value.backend) == (field, "deepspeed")
    assert str(info.value) == f"{field}: the deepspeed backend cannot express this: {reason}"


def test_refuses_deepspeed_knob_without_checkpointing() -> None:
    """Bypassing validation cannot smuggle a knob DeepSpeed would ignore."""
    policy = Policy.model_construct(**{**Policy.model_validate({"version": 1}).__dict__,
                                       "synchronize": True})
    with pytest.raises(TranslationError, match=r"^synchronize: the deepspeed backend cannot"):
        to_deepspeed(policy)


# --- goldens -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(golden_names()))
def test_golden(name: str) -> None:
    check_golden(name, golden_names()[name], "deepspeed")


def test_no_orphan_goldens() -> None:
    assert orphan_goldens("deepspeed") == []


# --- through the real DeepSpeed ------------------------------------------------------------


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", sorted(DS_OK))
def test_section_through_deepspeeds_config_parser(name: str, ds_env) -> None:
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    policy = DS_OK[name]
    section = to_deepspeed(policy)["activation_checkpointing"]
    parsed = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    for field, key in zip(FIELDS, SIX_JSON):
        got = getattr(parsed, key)
        assert got == getattr(policy, field) and type(got) is type(getattr(policy, field)), key


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", sorted(DS_OK))
def test_configure_kwargs_set_deepspeeds_globals(name: str, ds_env) -> None:
    """configure() resets, then applies: start from every setting ON and check the
    translated kwargs put each global where the policy says."""
    import deepspeed

    deepspeed.checkpointing.configure(None, partition_activations=True,
                                      contiguous_checkpointing=True, num_checkpoints=99,
                                      checkpoint_in_cpu=True, synchronize=True, profile=True)
    policy = DS_OK[name]
    kwargs = to_deepspeed(policy)["configure_kwargs"]
    deepspeed.checkpointing.configure(None, **kwargs)
    assert deepspeed.checkpointing.is_configured()
    expected = {kwarg: getattr(policy, field) for kwarg, field in zip(SIX_KWARGS, FIELDS)}
    assert ds_globals(ds_env) == expected


@pytest.mark.deepspeed
def test_seed_bug_cpu_checkpointing_reaches_deepspeed(ds_env) -> None:
    """Regression: `cpu_checkpointing: true` must turn DeepSpeed's CPU_CHECKPOINT on through
    both surfaces; the old Lightning lookup of `checkpoint_in_cpu` in the JSON found nothing."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    out = to_deepspeed(Policy.model_validate(CASES["ds-cpu"]))
    section = out["activation_checkpointing"]

    # Surface 1: the ds_config section, through DeepSpeed's own parser.
    parsed = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    assert parsed.cpu_checkpointing is True
    # Surface 2: the configure() kwargs, into DeepSpeed's module state.
    deepspeed.checkpointing.configure(None, **out["configure_kwargs"])
    assert ds_env.CPU_CHECKPOINT is True

    # The bug: Lightning read the kwarg name from the JSON section, got None, and
    # configure() kept the default: CPU checkpointing silently off.
    old_lookup = section.get("checkpoint_in_cpu")
    assert old_lookup is None
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=old_lookup)
    assert ds_env.CPU_CHECKPOINT is False


@pytest.mark.deepspeed
def test_deepspeed_parser_accepts_what_actcfg_refuses(ds_env) -> None:
    """Why actcfg checks: DeepSpeed keeps a typo'd key's setting at default and a string
    "false" as truthy."""
    from deepspeed.runtime.activation_checkpointing.config import (
        DeepSpeedActivationCheckpointingConfig,
    )

    parsed = DeepSpeedActivationCheckpointingConfig(
        {"activation_checkpointing": {"checkpoint_in_cpu": True, "partition_activations": "false"}})
    assert parsed.cpu_checkpointing is False
    assert parsed.partition_activations == "false" and bool(parsed.partition_activations)


@pytest.mark.deepspeed
def test_checkpoint_runs_with_translated_partition_cpu(ds_env) -> None:
    """The translated kwargs drive a real deepspeed.checkpointing.checkpoint forward and
    backward on the CPU (partition + cpu: the CPU path DeepSpeed 0.19.8 supports), with
    gradients equal to the plain run."""
    import deepspeed
    import torch

    out = to_deepspeed(Policy.model_validate(CASES["ds-partition-cpu"]))
    deepspeed.checkpointing.configure(None, **out["configure_kwargs"])
    assert (ds_env.PARTITION_ACTIVATIONS, ds_env.CPU_CHECKPOINT) == (True, True)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x0 = torch.randn(4, 8, requires_grad=True)

    block(x0 * 2).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x0.grad.clone()]
    block.zero_grad()
    x0.grad = None
    # A non-leaf input: DeepSpeed empties the caller's input under partition/cpu and
    # rejects leaves that require grad (BACKENDS 1.4).
    deepspeed.checkpointing.checkpoint(block, x0 * 2).sum().backward()
    got = [p.grad for p in block.parameters()] + [x0.grad]
    assert all(g is not None for g in got)
    for g, want in zip(got, plain):
        torch.testing.assert_close(g, want)
    deepspeed.checkpointing.reset()
