"""actcfg.integrations.hf.ActivationPolicyCallback in a real Hugging Face `Trainer` (transformers
with accelerate, on the CPU; DeepSpeed through its CPU accelerator on a one-process gloo group),
on a tiny randomly initialised Llama: recompute, equal weights, unchanged names, refusals before
the first step, removal at the end, DeepSpeed's globals, and the README's snippet.

Tests marked `cuda` measure memory held per decoder layer on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from actcfg.errors import ConfigLoadError, PolicyApplyError  # noqa: E402
from actcfg.integrations.hf import ActivationPolicyCallback  # noqa: E402

try:
    from tests._deepspeed_env import ds_env, ds_globals
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env, ds_globals
from _helpers import readme_snippet, tiny_llama  # noqa: E402

__all__ = ["ds_env"]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
LAYERS = 3
FULL = "version: 1\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"
EXTERNAL = "version: 1\ncheckpoint: {mode: external}\n"
STACKED = (
    "TrainingArguments(gradient_checkpointing=True) and the actcfg policy's "
    "`checkpoint: {mode: full}` would stack two recomputes of each layer in backward: set "
    "gradient_checkpointing=False (or activation_checkpointing=False, its new name), or write "
    "`checkpoint: {mode: external}` to keep HF's own checkpointing and let actcfg offload around it"
)


# transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing* (the old names
# warn); 5.17, on the GPU image, knows only the old ones.
NEW_NAMES = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
HF_CHECKPOINTING = {"activation_checkpointing" if NEW_NAMES else "gradient_checkpointing": True}


def enable_hf_checkpointing(model: Any) -> None:
    """transformers' own activation checkpointing, under the name this version has."""
    if NEW_NAMES:
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def dataset(n: int = 12, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: Path, **extra: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        dataloader_pin_memory=False, **extra,
    )


def count_mlp_calls(model: LlamaForCausalLM) -> list[list[int]]:
    """A forward pre-hook on each decoder layer's MLP: it fires in forward and in the recompute."""
    counts: list[list[int]] = []
    for layer in model.model.layers:
        count = [0]
        layer.mlp.register_forward_pre_hook(lambda m, a, count=count: count.__setitem__(0, count[0] + 1))
        counts.append(count)
    return counts


def module_state(model: torch.nn.Module) -> list[tuple[Any, ...]]:
    """Per module: hook counts, an instance forward, and keys actcfg or torch's checkpoint add."""
    return [(name, len(m._forward_pre_hooks), len(m._forward_hooks), "forward" in m.__dict__,
             sorted(k for k in m.__dict__ if k.startswith(("_actcfg", "__composable_api"))))
            for name, m in model.named_modules()]


class Spy(TrainerCallback):
    """Records, at each step, what the model and the callback under test look like."""

    def __init__(self, policy_callback: ActivationPolicyCallback | None = None) -> None:
        self.policy_callback = policy_callback
        self.steps: list[dict[str, Any]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.steps.append({
            "parameters": [n for n, _ in model.named_parameters()],
            "state_dict": list(model.state_dict()),
            "use_cache": model.config.use_cache,
            "applied": None if self.policy_callback is None else self.policy_callback.applied,
        })


def train(out: Path, model: LlamaForCausalLM, *callbacks: TrainerCallback, **extra: Any) -> Trainer:
    trainer = Trainer(model=model, args=arguments(out, **extra), train_dataset=dataset(),
                      callbacks=list(callbacks))
    trainer.train()
    return trainer


# --- the light path ----------------------------------------------------------------------


def test_import_actcfg_leaves_transformers_and_lightning_out():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, actcfg, actcfg.integrations; actcfg.load('version: 1\\n');"
         "print(sorted(m for m in ('transformers', 'lightning', 'torch') if m in sys.modules))"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    assert out.stdout.strip() == "[]"


# --- recompute, weights, names, removal --------------------------------------------------


def test_each_checkpointed_layer_recomputes_once_per_step(tmp_path):
    plain, policy = tiny_llama(LAYERS), tiny_llama(LAYERS)
    plain_calls, policy_calls = count_mlp_calls(plain), count_mlp_calls(policy)
    train(tmp_path / "plain", plain)
    train(tmp_path / "policy", policy, ActivationPolicyCallback(FULL))
    assert [c[0] for c in plain_calls] == [STEPS] * LAYERS
    assert [c[0] for c in policy_calls] == [2 * STEPS] * LAYERS


def test_trained_weights_and_names_equal_the_plain_run(tmp_path):
    plain, policy = tiny_llama(LAYERS), tiny_llama(LAYERS)
    names = [n for n, _ in policy.named_parameters()]
    keys = list(policy.state_dict())
    callback = ActivationPolicyCallback(FULL)
    spy = Spy(callback)
    train(tmp_path / "plain", plain)
    train(tmp_path / "policy", policy, callback, spy)
    assert len(spy.steps) == STEPS
    assert all(s["parameters"] == names and s["state_dict"] == keys for s in spy.steps)
    assert [n for n, _ in policy.named_parameters()] == names
    assert list(policy.state_dict()) == keys
    want = dict(plain.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.allclose(p, want[name], rtol=1e-6, atol=1e-7), name
    assert any(not torch.equal(p, q.to(p.device)) for p, q in zip(policy.parameters(), tiny_llama(LAYERS).parameters()))


def test_the_policy_is_live_during_training_and_removed_at_the_end(tmp_path):
    model = tiny_llama(LAYERS)
    callback = ActivationPolicyCallback(FULL)
    spy = Spy(callback)
    before = module_state(model)
    train(tmp_path, model, callback, spy)
    handles = {id(s["applied"]) for s in spy.steps}
    handle = spy.steps[0]["applied"]
    assert len(handles) == 1 and handle is not None
    assert handle.checkpointed == tuple(f"model.layers.{i}" for i in range(LAYERS))
    assert handle.removed
    assert callback.applied is None
    assert module_state(model) == before


def test_a_second_train_after_a_failed_one_starts_from_a_clean_model(tmp_path):
    model = tiny_llama(LAYERS)
    callback = ActivationPolicyCallback(FULL)
    before = module_state(model)

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="^boom$"):
        train(tmp_path / "a", model, callback, Boom())
    failed = callback.applied
    assert failed is not None and not failed.removed  # Trainer has no hook for the exception
    train(tmp_path / "b", model, callback)
    assert failed.removed
    assert module_state(model) == before
    callback.remove()  # a no-op now


def test_checkpointed_layers_that_no_gradient_reaches_are_refused_after_the_first_step(tmp_path):
    model = tiny_llama(LAYERS)
    model.model.requires_grad_(False)  # only lm_head trains: backward never enters the layers
    steps = Spy()
    want = (
        "checkpoint: a training step ran 3 checkpointed forwards and backward recomputed none of "
        "them, so checkpointing saved nothing: no gradient flows through `model.layers.0`, "
        "`model.layers.1`, `model.layers.2` (frozen, or outside the loss); narrow "
        "checkpoint.modules to the modules that train"
    )
    before = module_state(model)
    callback = ActivationPolicyCallback(FULL)
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, model, callback, steps)
    assert len(steps.steps) == 1
    assert callback.applied is None and module_state(model) == before  # removed before raising


# --- refusals before the first step ------------------------------------------------------


def test_gradient_checkpointing_true_is_refused_before_the_first_step(tmp_path):
    model = tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        args = arguments(tmp_path, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                      callbacks=[ActivationPolicyCallback(FULL)])
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(STACKED)}$"):
        trainer.train()
    assert [c[0] for c in calls] == [0] * LAYERS


@pytest.mark.skipif(not NEW_NAMES, reason="this transformers has no activation_checkpointing argument")
def test_activation_checkpointing_true_is_refused_the_same_way(tmp_path):
    model = tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(STACKED)}$"):
        train(tmp_path, model, ActivationPolicyCallback(FULL), activation_checkpointing=True)
    assert [c[0] for c in calls] == [0] * LAYERS


def test_a_model_with_hf_checkpointing_already_on_is_refused(tmp_path):
    model = tiny_llama(LAYERS)
    enable_hf_checkpointing(model)
    calls = count_mlp_calls(model)
    want = (
        "the model's Hugging Face activation checkpointing (on in `model.layers.0`, "
        "`model.layers.1` and 1 more; activation_checkpointing_enable() or "
        "gradient_checkpointing_enable() was called) and the actcfg policy's "
        "`checkpoint: {mode: full}` would stack two recomputes of each layer in backward: call "
        "model.activation_checkpointing_disable() before training, or write "
        "`checkpoint: {mode: external}` to keep HF's own checkpointing and let actcfg offload "
        "around it"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, model, ActivationPolicyCallback(FULL))
    assert [c[0] for c in calls] == [0] * LAYERS


def test_a_pattern_that_matches_no_layer_is_refused_before_training_starts(tmp_path):
    model = tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    before = module_state(model)
    callback = ActivationPolicyCallback("version: 1\ncheckpoint: {mode: full, modules: [GPT2Block]}\n")
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.modules: pattern 'GPT2Block' matches no module"):
        train(tmp_path, model, callback)
    assert [c[0] for c in calls] == [0] * LAYERS
    assert callback.applied is None
    assert module_state(model) == before


def test_a_bad_policy_fails_when_the_callback_is_built():
    with pytest.raises(ConfigLoadError, match="modules"):
        ActivationPolicyCallback("version: 1\ncheckpoint: {mode: full}\n")


# --- use_cache (the runtime turns it off on Hugging Face models and back on at remove) ---


def test_use_cache_is_off_while_the_policy_is_on_and_restored_after(tmp_path):
    model = tiny_llama(LAYERS)
    callback = ActivationPolicyCallback(FULL)
    spy = Spy(callback)
    train(tmp_path, model, callback, spy, use_cache=True)
    assert [s["use_cache"] for s in spy.steps] == [False] * STEPS
    assert model.config.use_cache is True


# --- checkpoint: {mode: external}: HF checkpoints, actcfg wraps nothing ------------------


def test_external_mode_keeps_hf_checkpointing_and_wraps_nothing(tmp_path):
    model = tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    callback = ActivationPolicyCallback(EXTERNAL)
    spy = Spy(callback)
    train(tmp_path, model, callback, spy, **HF_CHECKPOINTING)
    assert [c[0] for c in calls] == [2 * STEPS] * LAYERS  # HF's own recompute
    assert spy.steps[0]["applied"].checkpointed == ()


def test_external_mode_without_hf_checkpointing_is_refused(tmp_path):
    want = (
        "the actcfg policy's `checkpoint: {mode: external}` leaves checkpointing to the model, but "
        "its Hugging Face activation checkpointing is off (TrainingArguments("
        "gradient_checkpointing=False)), so nothing would recompute: set gradient_checkpointing=True, "
        "or write `checkpoint: {mode: full, modules: [...]}`"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, tiny_llama(LAYERS), ActivationPolicyCallback(EXTERNAL))


def test_external_mode_refuses_a_second_offload_by_transformers(tmp_path):
    kwargs = "activation_checkpointing_kwargs" if NEW_NAMES else "gradient_checkpointing_kwargs"
    want = (
        "TrainingArguments(gradient_checkpointing_kwargs={'offload': True}) and the actcfg policy's "
        "cpu_checkpointing would both offload the checkpointed inputs: remove offload from "
        "gradient_checkpointing_kwargs (actcfg offloads around HF's checkpointing), or set "
        "`cpu_checkpointing: false`"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, tiny_llama(LAYERS), ActivationPolicyCallback(EXTERNAL + "cpu_checkpointing: true\n"),
              **HF_CHECKPOINTING, **{kwargs: {"offload": True}})


def test_external_mode_with_backend_deepspeed_is_refused_when_hf_checkpoints(tmp_path):
    want = (
        "the actcfg policy's `checkpoint: {mode: external}` with backend deepspeed configures "
        "DeepSpeed's activation checkpointing, but HF's own checkpointing calls "
        "torch.utils.checkpoint, which ignores it: pass backend='torch' to ActivationPolicyCallback, "
        "or write `checkpoint: {mode: full, modules: [...]}` so actcfg routes the layers through "
        "deepspeed.checkpointing.checkpoint"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, tiny_llama(LAYERS), ActivationPolicyCallback(EXTERNAL, backend="deepspeed"),
              **HF_CHECKPOINTING)


# --- Hugging Face's DeepSpeed integration (DeepSpeed's CPU accelerator) ------------------

DS_POLICY = ("version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"
             "synchronize: true\nprofile: true\n")
DS_DEFAULTS = {"partition_activations": False, "contiguous_checkpointing": False,
               "num_checkpoints": None, "checkpoint_in_cpu": False, "synchronize": False,
               "profile": False}


def ds_config(section: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                           "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 0}}
    if section is not None:
        cfg["activation_checkpointing"] = section
    return cfg


@pytest.fixture
def hf_deepspeed(ds_env):
    """DeepSpeed's checkpointing module at its defaults; the environment as it was before
    (accelerate leaves ACCELERATE_USE_DEEPSPEED=true behind, which would turn every later
    Trainer into a DeepSpeed one)."""
    saved = dict(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    ds_env._configure_defaults()
    yield ds_env
    ds_env._configure_defaults()
    os.environ.clear()
    os.environ.update(saved)


class DeepSpeedSpy(TrainerCallback):
    """DeepSpeed's activation-checkpointing globals at the start of every step."""

    def __init__(self, ckpt: Any) -> None:
        self.ckpt = ckpt
        self.seen: list[dict[str, Any]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append({**ds_globals(self.ckpt), "is_configured": self.ckpt.is_configured()})


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_globals_equal_the_policy_during_training(tmp_path, hf_deepspeed):
    plain, model = tiny_llama(LAYERS), tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    spy = DeepSpeedSpy(hf_deepspeed)
    train(tmp_path / "plain", plain, deepspeed=ds_config())
    trainer = train(tmp_path / "policy", model, ActivationPolicyCallback(DS_POLICY), spy,
                    deepspeed=ds_config())
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    want = {**DS_DEFAULTS, "synchronize": True, "profile": True, "is_configured": True}
    assert spy.seen == [want] * STEPS
    assert [c[0] for c in calls] == [2 * STEPS] * LAYERS
    want_weights = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p, want_weights[name], rtol=1e-6, atol=1e-7), name
    assert ds_globals(hf_deepspeed) == DS_DEFAULTS  # removed at train end


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_configure_call_after_actcfgs_is_caught_after_the_first_step(tmp_path, hf_deepspeed):
    class Reconfigure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hf_deepspeed.configure(None, synchronize=False)

    want = (
        "DeepSpeed's activation-checkpointing settings after the first step differ from what "
        "actcfg configured (deepspeed.checkpointing.configure was called again after it, which "
        "resets all six settings): synchronize: policy True, DeepSpeed has False; profile: policy "
        "True, DeepSpeed has False; remove the other configure() call, or the trainer's "
        "activation_checkpointing settings"
    )
    callback = ActivationPolicyCallback(DS_POLICY)
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, tiny_llama(LAYERS), callback, Reconfigure(), deepspeed=ds_config())
    assert callback.applied is None


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_ds_config_section_that_agrees_is_accepted(tmp_path, hf_deepspeed):
    spy = DeepSpeedSpy(hf_deepspeed)
    section = {"synchronize_checkpoint_boundary": True, "profile": True, "cpu_checkpointing": False}
    train(tmp_path, tiny_llama(LAYERS), ActivationPolicyCallback(DS_POLICY), spy, deepspeed=ds_config(section))
    assert [s["synchronize"] for s in spy.seen] == [True] * STEPS


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_ds_config_section_that_disagrees_is_refused_naming_both(tmp_path, hf_deepspeed):
    model = tiny_llama(LAYERS)
    calls = count_mlp_calls(model)
    section = {"synchronize_checkpoint_boundary": False, "cpu_checkpointing": "false", "checkpoint_in_cpu": True}
    want = (
        "the ds_config's `activation_checkpointing` section disagrees with the actcfg policy, which "
        "configures DeepSpeed in its place: activation_checkpointing.synchronize_checkpoint_boundary "
        "is false in the ds_config, policy field synchronize is true; "
        "activation_checkpointing.cpu_checkpointing is \"false\" in the ds_config, policy field "
        "cpu_checkpointing is false; activation_checkpointing.checkpoint_in_cpu is not a key "
        "DeepSpeed reads (it reads partition_activations, contiguous_memory_optimization, "
        "number_checkpoints, cpu_checkpointing, synchronize_checkpoint_boundary, profile) and would "
        "be ignored; remove the section from the ds_config, or make it agree with the policy"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, model, ActivationPolicyCallback(DS_POLICY), deepspeed=ds_config(section))
    assert [c[0] for c in calls] == [0] * LAYERS
    assert ds_globals(hf_deepspeed) == DS_DEFAULTS


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_torch_policy_under_deepspeed_refuses_a_section_nobody_would_read(tmp_path, hf_deepspeed):
    policy = "version: 1\nbackend: torch\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"
    want = (
        "the ds_config's `activation_checkpointing` section disagrees with the actcfg policy, which "
        "does not configure DeepSpeed (backend torch): activation_checkpointing.profile is true in "
        "the ds_config, but the policy is applied with backend torch, which leaves DeepSpeed's "
        "profile at false; remove the section from the ds_config, or make it agree with the policy"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        train(tmp_path, tiny_llama(LAYERS), ActivationPolicyCallback(policy),
              deepspeed=ds_config({"profile": True}))


# --- the README ---------------------------------------------------------------------------


def test_the_readme_hugging_face_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(readme_snippet("With Hugging Face"), "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2
    assert namespace["callback"].applied is None  # applied for the run, removed at its end


# --- on the GPU: memory held per decoder layer stays flat ---------------------------------

GPU_LAYERS = 12


def held_per_layer(model: LlamaForCausalLM) -> list[tuple[int, int, int]]:
    """(layer index, torch.cuda.memory_allocated(), bytes of the layer's input) at the entry of
    each decoder layer in training mode (recomputes in backward included; see `last_forward`)."""
    seen: list[tuple[int, int, int]] = []

    for index, layer in enumerate(model.model.layers):
        def record(module, args, index=index):
            if module.training and torch.is_grad_enabled():
                seen.append((index, torch.cuda.memory_allocated(), args[0].nbytes))

        layer.register_forward_pre_hook(record)
    return seen


def last_forward(seen: list[tuple[int, int, int]], layers: int) -> tuple[list[int], int]:
    """Memory added between consecutive layers in the last forward pass (the last run of
    records for layers 0, 1, ..., n-1 in order: a recompute in backward runs them in reverse),
    and the size of one layer input."""
    starts = [i for i in range(len(seen) - layers + 1)
              if [r[0] for r in seen[i:i + layers]] == list(range(layers))]
    run = seen[starts[-1]:starts[-1] + layers]
    return [b[1] - a[1] for a, b in zip(run, run[1:])], run[0][2]


def gpu_llama() -> LlamaForCausalLM:
    """A Llama decoder stack sized so one layer input (4 x 2048 x 1024, bf16) is 16 MiB."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=GPU_LAYERS,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
    ))


def gpu_train(out: Path, model: LlamaForCausalLM, *callbacks: TrainerCallback, **extra: Any) -> Trainer:
    ids = torch.randint(0, 256, (8, 2048), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
    trainer.train()
    return trainer


@pytest.mark.cuda
def test_gpu_cpu_checkpointing_holds_memory_per_layer_flat(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # bf16 weights and no autocast: autocast would cache a cast copy of each layer's weights
    # for the whole forward, which grows per layer whatever the policy does.
    checkpoint_only, offloaded = gpu_llama().to(torch.bfloat16), gpu_llama().to(torch.bfloat16)
    seen_ckpt, seen_off = held_per_layer(checkpoint_only), held_per_layer(offloaded)
    gpu_train(tmp_path / "a", checkpoint_only, ActivationPolicyCallback(FULL))
    callback = ActivationPolicyCallback(FULL + "cpu_checkpointing: true\n")
    spy = Spy(callback)
    gpu_train(tmp_path / "b", offloaded, callback, spy)
    growth_ckpt, one_input = last_forward(seen_ckpt, GPU_LAYERS)
    growth_off, _ = last_forward(seen_off, GPU_LAYERS)
    print(f"growth per layer, one input {one_input}: checkpoint {growth_ckpt}, offload {growth_off}")
    # Checkpointing alone keeps one layer input per layer; with the offload, the layers past
    # the first few add (almost) nothing: at most one layer's copies are in flight.
    assert all(abs(g - one_input) < one_input // 10 for g in growth_ckpt[1:]), growth_ckpt
    assert all(abs(g) < one_input // 10 for g in growth_off[3:]), growth_off
    handle = spy.steps[-1]["applied"]
    assert handle.engine.stats.offloaded_bytes >= (GPU_LAYERS - 2) * one_input
    assert handle.removed


@pytest.mark.cuda
@pytest.mark.deepspeed
def test_gpu_deepspeed_cpu_checkpointing_globals_and_flat_memory(tmp_path, hf_deepspeed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = gpu_llama()
    seen = held_per_layer(model)
    spy = DeepSpeedSpy(hf_deepspeed)
    policy = ("version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"
              "cpu_checkpointing: true\nsynchronize: true\n")
    section = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}
    cfg = {**ds_config(section), "bf16": {"enabled": "auto"}}
    gpu_train(tmp_path, model, ActivationPolicyCallback(policy), spy, deepspeed=cfg, bf16=True)
    want = {**DS_DEFAULTS, "checkpoint_in_cpu": True, "synchronize": True, "is_configured": True}
    assert spy.seen == [want] * 2
    growth, one_input = last_forward(seen, GPU_LAYERS)
    print(f"growth per layer, one input {one_input}: deepspeed cpu_checkpointing {growth}")
    # DeepSpeed's offload engine keeps the newest inputs on the GPU while their copies run:
    # the first layers add one input each, the rest nothing.
    assert all(abs(g) < one_input // 10 for g in growth[3:]), growth
    assert ds_globals(hf_deepspeed) == DS_DEFAULTS
