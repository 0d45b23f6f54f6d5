"""`checkpoint.mode: auto` in the trainer callbacks, on the CPU with real trainers: the plan is
made on the first batch with the trainer's own loss, planning changes nothing the run sees (a
planned run's steps equal those of a run given the plan it wrote), the written plan is reused
with `plan_file=` and refused for another model, and what cannot be planned in the run is
refused before the first step. CPU profiles are wall-clock with counted bytes (the loopback
engine adds the offload choices); the budgets below are between the counted peaks of
checkpointing every candidate and of keeping everything, so a plan must checkpoint some.

The `cuda` test plans GPT-2 in a Hugging Face Trainer and holds the first step to the budget.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402
from transformers import (  # noqa: E402
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from actcfg.errors import PolicyApplyError  # noqa: E402
from actcfg.integrations.hf import ActivationPolicyCallback  # noqa: E402
from actcfg.integrations.lightning import ActivationPolicy  # noqa: E402
from actcfg.runtime.offload import host_loopback  # noqa: E402
from actcfg.probes import BlockStack  # noqa: E402
from _helpers import tiny_llama  # noqa: E402

STEPS = 3
HF_AUTO = "version: 1\ncheckpoint: {mode: auto, modules: [LlamaDecoderLayer]}\nmemory_budget: 600KiB\n"
PL_AUTO = "version: 1\ncheckpoint: {mode: auto, modules: [Block]}\nmemory_budget: 250KiB\n"

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:GPU available but not used"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:Starting from v1.9.0, `tensorboardX`"),
]


# --- Hugging Face Trainer -------------------------------------------------------------------------


def dropout_llama(layers: int = 3) -> LlamaForCausalLM:
    """The tiny Llama with attention dropout: every step draws from the CPU generator."""
    return tiny_llama(layers, attention_dropout=0.2)


class Tokens(Dataset):
    """Token rows that record the order the Trainer reads them in."""

    def __init__(self, n: int = 12, seq: int = 16) -> None:
        self.ids = torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(1))
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(i)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_arguments(out: Path, **extra: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        dataloader_pin_memory=False, use_cpu=True, **extra,
    )


class Steps(TrainerCallback):
    """What the run saw after each step: weights, the CPU RNG state, the step count."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append({
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rng": torch.get_rng_state(),
            "step": state.global_step,
        })


def hf_run(out: Path, callback: ActivationPolicyCallback, layers: int = 3) -> dict[str, Any]:
    data, steps = Tokens(), Steps()
    trainer = Trainer(model=dropout_llama(layers), args=hf_arguments(out), train_dataset=data,
                      callbacks=[callback, steps])
    trainer.train()
    return {"steps": steps.seen, "read": data.read,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "optimizer": trainer.optimizer.state_dict()["state"]}


def assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["read"] == b["read"]
    assert a["losses"] == b["losses"]
    assert len(a["steps"]) == len(b["steps"]) == STEPS
    for x, y in zip(a["steps"], b["steps"]):
        assert x["step"] == y["step"]
        assert torch.equal(x["rng"], y["rng"])
        assert x["weights"].keys() == y["weights"].keys()
        assert all(torch.equal(x["weights"][k], y["weights"][k]) for k in x["weights"])
    for k, state in a["optimizer"].items():
        assert all(torch.equal(v, b["optimizer"][k][n]) for n, v in state.items() if torch.is_tensor(v))


def test_hf_plans_on_the_first_batch_and_changes_nothing_the_run_sees(tmp_path, capsys):
    planning = ActivationPolicyCallback(HF_AUTO)
    planned = hf_run(tmp_path / "planned", planning)
    written = tmp_path / "planned" / "actcfg-plan.yaml"
    assert planning.plan_written == written and written.is_file()
    out = capsys.readouterr().out
    assert re.search(r"^actcfg: planned 3 modules within memory_budget .*; planning took [\d.]+ s "
                     r"\(counts [\d.]+, keep [\d.]+, .*, rest [\d.]+ s\)\); planned in [\d.]+ s on the "
                     r"first batch \([\d.]+ s of it outside the profile, [\d.]+ s of that solving\); plan written to "
                     rf"{re.escape(str(written))}$", out, re.M)
    assert re.search(r"^actcfg: after the first step: \d+ checkpointed forwards", out, re.M)
    text = written.read_text()
    assert "mode: full" in text or "mode: selective" in text  # the budget makes it checkpoint

    reusing = ActivationPolicyCallback(HF_AUTO, plan_file=written)
    given = hf_run(tmp_path / "given", reusing)
    assert not (tmp_path / "given" / "actcfg-plan.yaml").exists()  # nothing planned, nothing written
    assert f"actcfg: plan {written} applied; backend torch; per-module rules over 3 modules" \
        in capsys.readouterr().out
    assert_same_run(planned, given)


def test_hf_plan_file_for_another_model_is_refused_naming_the_candidates(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\ncheckpoint:\n  mode: rules\n  rules:\n"
                    "    - {modules: [model.layers.0, model.layers.1, model.layers.2], mode: full}\n"
                    "  predicted: {step_time_ms: 1.0, peak: 1MiB}\n")
    callback = ActivationPolicyCallback(HF_AUTO, plan_file=plan)
    trainer = Trainer(model=dropout_llama(layers=2), args=hf_arguments(tmp_path / "out"),
                      train_dataset=Tokens(), callbacks=[callback])
    with pytest.raises(PolicyApplyError, match=re.escape(
            f"{plan} was planned for another model: it names `model.layers.2`, which this model's "
            "candidates (`LlamaDecoderLayer`) do not include; delete plan_file= to plan this model "
            "on its first batch, or pass the plan written for it")):
        trainer.train()
    more = Trainer(model=dropout_llama(layers=4), args=hf_arguments(tmp_path / "out"),
                   train_dataset=Tokens(), callbacks=[ActivationPolicyCallback(HF_AUTO, plan_file=plan)])
    with pytest.raises(PolicyApplyError, match=re.escape(
            "was planned for another model: candidates `model.layers.3` of this model are not in it;")):
        more.train()


def test_hf_plan_file_refusals_before_training(tmp_path):
    with pytest.raises(PolicyApplyError, match=re.escape(
            "plan_file= reuses a plan of `checkpoint.mode: auto`, and this policy's mode is full:")):
        ActivationPolicyCallback("version: 1\ncheckpoint: {mode: full, modules: [X]}\n",
                                 plan_file=tmp_path / "p.yaml")
    with pytest.raises(PolicyApplyError, match=r"^plan_file='.*missing.yaml' does not exist: "):
        ActivationPolicyCallback(HF_AUTO, plan_file=tmp_path / "missing.yaml")
    hand = tmp_path / "hand.yaml"
    hand.write_text("version: 1\ncheckpoint: {mode: full, modules: [X]}\n")
    with pytest.raises(PolicyApplyError, match=re.escape(
            f"{hand}: plan_file= takes a plan (`checkpoint.mode: rules`, as actcfg writes it), "
            "and this file's checkpoint.mode is full")):
        ActivationPolicyCallback(HF_AUTO, plan_file=hand)
    big = tmp_path / "big.yaml"
    big.write_text("version: 1\ncheckpoint:\n  mode: rules\n  rules:\n"
                   "    - {modules: [LlamaDecoderLayer], mode: full}\n"
                   "  predicted: {step_time_ms: 1.0, peak: 4MiB}\n")
    trainer = Trainer(model=dropout_llama(), args=hf_arguments(tmp_path / "out"), train_dataset=Tokens(),
                      callbacks=[ActivationPolicyCallback(HF_AUTO, plan_file=big)])
    with pytest.raises(PolicyApplyError, match=re.escape(
            f"{big} predicts a peak of 4MiB, above this policy's memory_budget 600KiB: it was "
            "planned for a larger budget")):
        trainer.train()


def test_hf_torch_compile_is_refused_before_the_first_step_pointing_at_compile(tmp_path):
    callback = ActivationPolicyCallback(HF_AUTO)
    trainer = Trainer(model=dropout_llama(), args=hf_arguments(tmp_path, torch_compile=True,
                                                               torch_compile_backend="aot_eager"),
                      train_dataset=Tokens(), callbacks=[callback])
    with pytest.raises(PolicyApplyError, match=re.escape(
            "TrainingArguments(torch_compile=True) compiles the model, and a plan profiled in "
            "eager is not what runs compiled (to plan compiled, set torch_compile=False and write "
            "`compile: {scope: model}` beside memory_budget: actcfg then profiles and applies the "
            "plan compiled): plan once")):
        trainer.train()
    assert trainer.state.global_step == 0 and callback.applied is None


@pytest.mark.slow
def test_hf_plans_compiled_on_the_first_batch_when_the_policy_says_compile(tmp_path, capsys):
    import torch._dynamo

    torch._dynamo.reset()
    policy = HF_AUTO + "compile: {scope: blocks, backend: aot_eager}\n"
    planning = ActivationPolicyCallback(policy)
    planned = hf_run(tmp_path / "planned", planning)
    written = tmp_path / "planned" / "actcfg-plan.yaml"
    assert "compile: {scope: blocks, backend: aot_eager}" in written.read_text()
    out = capsys.readouterr().out
    assert re.search(r"^actcfg: planned 3 modules .* compiled \(blocks with aot_eager\); planning "
                     r"took [\d.]+ s \(counts [\d.]+, .*, rest [\d.]+ s\) \+ [\d.]+ s compiling\)", out, re.M), out
    assert len(planned["steps"]) == STEPS and all(map(math.isfinite, planned["losses"]))
    torch._dynamo.reset()


def test_hf_label_smoothing_is_refused_before_the_first_step(tmp_path):
    callback = ActivationPolicyCallback(HF_AUTO)
    trainer = Trainer(model=dropout_llama(), args=hf_arguments(tmp_path, label_smoothing_factor=0.1),
                      train_dataset=Tokens(), callbacks=[callback])
    with pytest.raises(PolicyApplyError, match=re.escape(
            "checkpoint.mode auto plans on the first batch, in the training process, and "
            "TrainingArguments(label_smoothing_factor) takes the labels out of the batch before "
            "the model sees it, so the profile has no loss to run backward from: plan once")):
        trainer.train()
    assert trainer.state.global_step == 0 and callback.applied is None
    assert not tmp_path.joinpath("actcfg-plan.yaml").exists()


def test_hf_outputs_without_a_loss_are_refused_on_the_first_batch(tmp_path):
    """A compute_loss_func takes the labels out of the batch: the model returns no loss."""
    callback = ActivationPolicyCallback(HF_AUTO)

    def loss_of(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().square().mean()

    trainer = Trainer(model=dropout_llama(), args=hf_arguments(tmp_path), train_dataset=Tokens(),
                      callbacks=[callback], compute_loss_func=loss_of)
    with pytest.raises(PolicyApplyError, match=re.escape(
            "checkpoint.mode auto profiles steps with the loss Trainer.compute_loss takes from the "
            "model's outputs, and they hold no `loss` (keys: logits): the model got no labels")):
        trainer.train()
    assert trainer.state.global_step == 0 and callback.applied is None and callback._pending is None


def test_hf_auto_beside_the_trainers_own_checkpointing_is_refused(tmp_path):
    import dataclasses

    new_name = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
    on = {"activation_checkpointing" if new_name else "gradient_checkpointing": True}
    trainer = Trainer(model=dropout_llama(), args=hf_arguments(tmp_path, **on), train_dataset=Tokens(),
                      callbacks=[ActivationPolicyCallback(HF_AUTO)])
    with pytest.raises(PolicyApplyError, match=re.escape(
            "TrainingArguments(gradient_checkpointing=True) and the actcfg policy's "
            "`checkpoint: {mode: auto}` would stack two recomputes of each layer in backward")):
        trainer.train()


# --- Lightning ------------------------------------------------------------------------------------


class Blocks(pl.LightningModule):
    """A stack of `Block`s; training_step drops out its input (a draw from the CPU generator) and
    logs its loss per step and per epoch."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BlockStack(3, d_model=32, heads=4, ffn=64)
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.model(nn.functional.dropout(x, 0.2)).square().mean()
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class PlSteps(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append({
            "weights": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "rng": torch.get_rng_state(),
            "step": trainer.global_step,
            "batch": batch[0].clone(),
        })


def pl_run(root: Path, callback: ActivationPolicy, module: pl.LightningModule | None = None) -> dict[str, Any]:
    x = torch.randn(4 * STEPS, 8, 32, generator=torch.Generator().manual_seed(1))
    steps = PlSteps()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", default_root_dir=str(root),
                         callbacks=[callback, steps], enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(module or Blocks(), DataLoader(TensorDataset(x), batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(2)))
    return {"steps": steps.seen, "metrics": dict(trainer.callback_metrics),
            "optimizer": trainer.optimizers[0].state_dict()["state"]}


# Lightning says this whenever a process group is up, and the DeepSpeed session fixture of an
# earlier test keeps a one-rank gloo group: both runs compared here see it alike.
@pytest.mark.filterwarnings("ignore:It is recommended to use `self.log")
def test_lightning_plans_on_the_first_batch_and_changes_nothing_the_run_sees(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    planning = ActivationPolicy(PL_AUTO)
    with host_loopback():
        planned = pl_run(tmp_path / "planned", planning)
    written = tmp_path / "planned" / "actcfg-plan.yaml"  # log_dir is default_root_dir without a logger
    assert planning.plan_written == written and written.is_file()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("actcfg:")]
    assert len(said) == 2
    assert re.match(r"actcfg: planned 3 modules within memory_budget .*; planned in [\d.]+ s on the "
                    r"first batch \([\d.]+ s of it outside the profile, [\d.]+ s of that solving\); plan written to "
                    rf"{re.escape(str(written))}$", said[0])
    assert said[1].startswith("actcfg: after the first step: ")

    caplog.clear()
    with host_loopback():
        given = pl_run(tmp_path / "given", ActivationPolicy(PL_AUTO, plan_file=written))
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("actcfg: plan ")] \
        == [r.getMessage() for r in caplog.records if "applied; backend torch" in r.getMessage()] != []
    assert not (tmp_path / "given" / "actcfg-plan.yaml").exists()
    assert [s["step"] for s in planned["steps"]] == [s["step"] for s in given["steps"]] == [1, 2, 3]
    for a, b in zip(planned["steps"], given["steps"]):
        assert torch.equal(a["batch"], b["batch"]) and torch.equal(a["rng"], b["rng"])
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    # the epoch's logged mean holds the real steps only, not the profile's training_step runs
    assert planned["metrics"].keys() == given["metrics"].keys()
    assert all(torch.equal(planned["metrics"][k], given["metrics"][k]) for k in planned["metrics"])
    for k, state in planned["optimizer"].items():
        assert all(torch.equal(v, given["optimizer"][k][n]) for n, v in state.items())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:It is recommended to use `self.log")
def test_lightning_plans_compiled_on_the_first_batch_when_the_policy_says_compile(tmp_path, caplog):
    import torch._dynamo

    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    planning = ActivationPolicy(PL_AUTO + "compile: {scope: blocks, backend: aot_eager}\n")
    planned = pl_run(tmp_path / "planned", planning)
    written = tmp_path / "planned" / "actcfg-plan.yaml"
    assert "compile: {scope: blocks, backend: aot_eager}" in written.read_text()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("actcfg: planned")]
    assert len(said) == 1 and "compiled (blocks with aot_eager)" in said[0]
    assert [s["step"] for s in planned["steps"]] == [1, 2, 3]
    assert all(torch.isfinite(v).all() for v in planned["metrics"].values())
    torch._dynamo.reset()


def test_lightning_refuses_whole_model_compile_where_the_trainer_is_built():
    with pytest.raises(PolicyApplyError, match=re.escape(
            "compile.scope: `model` compiles the forward of the module the policy is applied to, "
            "and the Lightning callback applies it to the LightningModule, whose forward Lightning "
            "does not call (it calls training_step): nothing would run compiled; write "
            "`compile: {scope: blocks}` to compile each candidate module")):
        ActivationPolicy(PL_AUTO + "compile: {scope: model}\n")


def test_lightning_manual_optimization_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(PolicyApplyError, match=re.escape(
            "checkpoint.mode auto plans on the first batch, in the training process, and the "
            "LightningModule steps its optimizers itself (automatic_optimization is off), so "
            "running training_step to profile it would step them: plan once")):
        pl_run(tmp_path, ActivationPolicy(PL_AUTO), Blocks(manual=True))


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_gpu_hf_trainer_plans_gpt2_within_the_budget_halfway_to_plain(tmp_path):
    """GPT-2 (4 layers, n_embd 512, batch 8 x 512): the budget halfway between checkpointing every
    block and plain; the plan fits it in the Trainer's first step, measured before the optimizer
    step, and the written plan is reused by a second run."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from actcfg.plan.profile import measure_steps
    from actcfg.api import apply

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def gpt2() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512,
                                          vocab_size=8192)).cuda()

    ids = torch.randint(0, 8192, (32, 512), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    batch = {"input_ids": ids[:8].cuda(), "labels": ids[:8].cuda()}
    model = gpt2()
    _, plain = measure_steps(model, batch)
    with apply(model, "version: 1\ncheckpoint: {mode: full, modules: [GPT2Block]}\n"):
        _, full = measure_steps(model, batch)
    del model
    budget = (plain + full) // 2
    policy = f"version: 1\ncheckpoint: {{mode: auto, modules: [GPT2Block]}}\nmemory_budget: {budget}\n"
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                             report_to=[], save_strategy="no", disable_tqdm=True,
                             dataloader_pin_memory=False)
    callback = ActivationPolicyCallback(policy)
    Trainer(model=gpt2(), args=args, train_dataset=rows, callbacks=[callback]).train()
    assert callback.first_step_peak is not None and callback.first_step_peak <= budget
    plan = tmp_path / "actcfg-plan.yaml"
    again = ActivationPolicyCallback(policy, plan_file=plan)
    Trainer(model=gpt2(), args=args, train_dataset=rows, callbacks=[again]).train()
    assert again.first_step_peak is not None and again.first_step_peak <= budget


@pytest.mark.cuda
def test_gpu_lightning_plans_the_blocks_stack_within_the_budget_halfway_to_plain(tmp_path):
    """The blocks stack (4 blocks, d_model 1024, batch 4 x 1024, bf16) in Lightning's default
    strategy: the budget halfway between checkpointing every block and plain; the first step's
    peak, measured before the optimizer step, stays within it."""
    from actcfg import probes
    from actcfg.plan.profile import measure_steps
    from actcfg.api import apply

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shape = dict(n=4, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)
    model, x = probes.blocks(**shape)
    _, plain = measure_steps(model, x)
    with apply(model, "version: 1\ncheckpoint: {mode: full, modules: [Block]}\n"):
        _, full = measure_steps(model, x)
    del model
    budget = (plain + full) // 2

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, _ = probes.blocks(**shape, device="cpu")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.blocks(batch[0]).float().square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callback = ActivationPolicy(f"version: 1\ncheckpoint: {{mode: auto, modules: [Block]}}\n"
                                f"memory_budget: {budget}\n")
    trainer = pl.Trainer(max_steps=2, accelerator="gpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=str(tmp_path), callbacks=[callback])
    trainer.fit(Stack(), DataLoader(TensorDataset(x.cpu().repeat(2, 1, 1)), batch_size=shape["batch"]))
    assert callback.plan_written == tmp_path / "actcfg-plan.yaml"
    assert callback.first_step_peak is not None and callback.first_step_peak <= budget
