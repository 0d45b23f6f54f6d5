"""`actcfg translate --backend lightning` and `actcfg import --backend lightning` against the real
`lightning.pytorch.strategies.DeepSpeedStrategy`: its config, and what its own
`_set_deepspeed_activation_checkpointing` (the call Lightning makes in setup) leaves in
DeepSpeed's globals, so each warning about a dropped setting is proven against Lightning itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import actcfg
from actcfg.translators import to_lightning
from actcfg.translators.trainer_import import import_strategy_keywords

try:
    from tests._deepspeed_env import ds_env, ds_globals
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env, ds_globals

__all__ = ["ds_env"]

BASE = "version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\n"
# configure() kwarg -> actcfg field.
FIELD_BY_KWARG = {"partition_activations": "partition", "contiguous_checkpointing": "contiguous",
                  "num_checkpoints": "num_checkpoints", "checkpoint_in_cpu": "cpu_checkpointing",
                  "synchronize": "synchronize", "profile": "profile"}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- translate: pure ---------------------------------------------------------------------


def test_keywords_when_every_setting_has_one():
    out = to_lightning(actcfg.load(BASE + "cpu_checkpointing: true\nsynchronize: true\n"))
    assert out["strategy_kwargs"] == {"partition_activations": False, "cpu_checkpointing": True,
                                      "synchronize_checkpoint_boundary": True}
    assert out["config"] is None
    assert out["usage"] == "DeepSpeedStrategy(**strategy_kwargs)"
    assert out["warnings"] == [
        "synchronize: `synchronize`: Lightning 2.6.6 never passes synchronize_checkpoint_boundary to "
        "configure(); run the policy with actcfg.integrations.lightning.ActivationPolicy, which "
        "passes it on"]


def test_a_whole_config_section_when_a_setting_has_no_keyword():
    out = to_lightning(actcfg.load(BASE + "cpu_checkpointing: true\nprofile: true\n"))
    assert out["strategy_kwargs"] is None
    assert out["config"] == {"activation_checkpointing": {
        "partition_activations": False, "number_checkpoints": None, "cpu_checkpointing": True,
        "synchronize_checkpoint_boundary": False, "profile": True}}
    assert "ignores all its keywords once config= is given" in out["usage"]


def test_translate_cli_refuses_contiguous_and_warns_for_each_dropped_setting(run_cli, tmp_path):
    contiguous = write(tmp_path, "c.yaml", BASE + "partition: true\ncontiguous: true\nnum_checkpoints: 4\n")
    run = run_cli("translate", contiguous, "--backend", "lightning")
    assert run.code == 1 and run.out == ""
    assert re.search(r":5:13: error fails-in-lightning: `contiguous` fails in Lightning 2\.6\.6", run.err)
    dropped = write(tmp_path, "d.yaml", BASE + "cpu_checkpointing: true\nsynchronize: true\n")
    run = run_cli("translate", dropped, "--backend", "lightning")
    assert run.code == 0
    assert re.findall(r"warning dropped-by-backend: `(\w+)`", run.err) == ["synchronize"]
    assert json.loads(run.out)["strategy_kwargs"]["synchronize_checkpoint_boundary"] is True


# --- translate: accepted by the real DeepSpeedStrategy, and what Lightning passes on --------


@pytest.fixture
def lightning_ds(ds_env):
    """DeepSpeedStrategy, with DeepSpeed's checkpointing module at its defaults around the test."""
    strategies = pytest.importorskip("lightning.pytorch.strategies")
    ds_env._configure_defaults()
    yield strategies.DeepSpeedStrategy
    ds_env._configure_defaults()


def strategy_for(deepspeed_strategy: Any, out: dict[str, Any]) -> Any:
    if out["config"] is None:
        return deepspeed_strategy(**out["strategy_kwargs"])
    return deepspeed_strategy(config={"train_micro_batch_size_per_gpu": 1, **out["config"]})


POLICIES = [
    "cpu_checkpointing: true\n",
    "cpu_checkpointing: true\nsynchronize: true\n",
    "profile: true\n",
    "synchronize: true\nprofile: true\nnum_checkpoints: 12\n",
]


@pytest.mark.deepspeed
@pytest.mark.parametrize("extra", POLICIES)
def test_lightning_passes_on_exactly_what_the_warnings_do_not_name(lightning_ds, ds_env, extra):
    policy = actcfg.load(BASE + extra)
    out = to_lightning(policy)
    strategy = strategy_for(lightning_ds, out)
    section = strategy.config["activation_checkpointing"]
    for key, value in (out["strategy_kwargs"] or out["config"]["activation_checkpointing"]).items():
        assert section[key] == value
    strategy._set_deepspeed_activation_checkpointing()  # what DeepSpeedStrategy.setup runs
    state = ds_globals(ds_env)
    lost = {FIELD_BY_KWARG[k] for k, v in state.items() if v != getattr(policy, FIELD_BY_KWARG[k])}
    assert lost == {w.split(":")[0] for w in out["warnings"]}


@pytest.mark.deepspeed
def test_contiguous_through_lightning_fails_as_the_table_says(lightning_ds):
    strategy = lightning_ds(config={"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
        "partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 4}})
    with pytest.raises(AssertionError, match="number of layers"):
        strategy._set_deepspeed_activation_checkpointing()


# --- import ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", POLICIES)
def test_import_round_trips_what_translate_wrote(extra):
    policy = actcfg.load(BASE + extra)
    out = to_lightning(policy)
    imported = import_strategy_keywords(out["strategy_kwargs"] or {"config": out["config"]})
    assert imported.ignored == []
    assert [k for k, _ in imported.dropped] == [w.split(":")[0] for w in out["warnings"]]
    back = actcfg.load(imported.yaml.replace("CHANGE_ME", "Block"))
    assert {f: getattr(back, f) for f in FIELD_BY_KWARG.values()} == \
        {f: getattr(policy, f) for f in FIELD_BY_KWARG.values()}


def test_import_cli_reports_ignored_and_dropped_keywords(run_cli, tmp_path):
    path = write(tmp_path, "strategy.yaml", "stage: 3\ncpu_checkpointing: true\n"
                                            "synchronize_checkpoint_boundary: true\ncheckpoint_in_cpu: true\n")
    run = run_cli("import", path, "--backend", "lightning")
    assert run.code == 0
    assert run.err.splitlines() == [
        f"{path}:4:1: warning ignored-key: `checkpoint_in_cpu`: not a DeepSpeedStrategy keyword "
        "(DeepSpeedStrategy(...) raises TypeError); did you mean `cpu_checkpointing`? (not imported)",
        f"{path}: warning dropped-by-backend: `synchronize`: Lightning 2.6.6 never passes "
        "synchronize_checkpoint_boundary to configure(); run the policy with "
        "actcfg.integrations.lightning.ActivationPolicy, which passes it on (imported: the policy "
        "keeps what Lightning would lose)",
        f"{path}: warning placeholder: the DeepSpeedStrategy keywords cannot say which modules the model "
        "checkpoints: the policy holds `modules: [CHANGE_ME]`, which validate refuses until it is replaced "
        "(run import with --modules CLASSNAME... (the checkpointed modules' class names), or --external "
        "if the model calls deepspeed.checkpointing.checkpoint itself)",
    ]
    policy = actcfg.load(run.out.replace("CHANGE_ME", "Block"))
    assert (policy.backend, policy.cpu_checkpointing, policy.synchronize) == ("deepspeed", True, True)


def test_import_with_config_reports_the_keywords_lightning_ignores(run_cli, tmp_path):
    path = write(tmp_path, "strategy.json", json.dumps({
        "cpu_checkpointing": True,
        "config": {"activation_checkpointing": {"partition_activations": True, "synchronize": True}},
    }))
    run = run_cli("import", path, "--backend", "lightning")
    assert run.code == 0
    assert "`cpu_checkpointing`: DeepSpeedStrategy ignores its keywords once config= is given" in run.err
    assert "`activation_checkpointing.synchronize`: DeepSpeed reads only its six keys" in run.err
    assert "warning dropped-by-backend: `partition`: Lightning 2.6.6 passes it to configure() " \
           "without a model-parallel unit" in run.err
    policy = actcfg.load(run.out.replace("CHANGE_ME", "Block"))
    assert (policy.partition, policy.cpu_checkpointing, policy.synchronize) == (True, False, False)


def test_import_cli_refuses_a_config_path(run_cli, tmp_path):
    run = run_cli("import", write(tmp_path, "s.yaml", "config: ds_config.json\n"), "--backend", "lightning")
    assert run.code == 1
    assert "config= is str \"ds_config.json\": import that DeepSpeed config with `actcfg import FILE`" in run.err
