"""The plan's predicted peak against what the Hugging Face Trainer's planned step measures, on the
CPU under bf16 autocast (`TrainingArguments(bf16=True, use_cpu=True)`: accelerate wraps the
model's forward in autocast and hands back fp32 outputs), on the same meter (`LiveBytes`, from
`on_step_begin` to `on_pre_optimizer_step`, as `memory_budget` is defined in a trainer).

What the profile once got wrong about the Trainer's step: it held the model's outputs through
backward (`compute_loss` returns only the loss: accelerate's fp32 copy of the logits is gone by
then), and with gradient accumulation it left out the gradients every later micro-batch starts
with.

And about Lightning's (the blocks stack in a `LightningModule`, fp32 and `bf16-mixed`): automatic
optimization sets the gradients to None after `training_step`, before backward, so from the
second step on the previous step's gradients live through the forward. Read above the step's
start less those gradients (so that they are inside `memory_budget`, as in the Trainer), a later
step peaked 17% above its plan; read above the start with them (as the benchmark read it), 8%
below (an H200 measured 9% below)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from actcfg import probes  # noqa: E402
from actcfg.integrations.hf import ActivationPolicyCallback  # noqa: E402
from actcfg.integrations.lightning import ActivationPolicy  # noqa: E402
from actcfg.plan.probe import LiveBytes, gradient_bytes  # noqa: E402
from actcfg.plan.solve import MIXED_HEADROOM  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # a CPU profile of a training step per choice
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:GPU available but not used"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:Starting from v1.9.0, `tensorboardX`"),
]

VOCAB = 1024  # fp32 logits of a batch (4 x 128 x 1024 x 4 bytes = 2 MiB) as large as 2/5 of a kept block
BUDGET = 15_000_000  # between checkpointing every block (~8 MB) and plain (~27 MB): a mix


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    # use_cache stays at GPT-2's default (True), as a Trainer leaves it
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0))


class StepPeaks(TrainerCallback):
    """Each optimizer step's peak of live tensor bytes, before the optimizer step, and the plan's
    predicted peak once planned."""

    def __init__(self, policy: ActivationPolicyCallback, count: bool = True) -> None:
        self.policy = policy
        self.peaks: list[int] = []
        self.predicted: int | None = None
        self.meter = LiveBytes() if count else None  # on a GPU the callback measures

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None:
            self.meter.start()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None:
            self.meter.stop()
            self.peaks.append(self.meter.peak)
        if self.policy.applied is not None and self.policy.applied.plan is not None:
            self.predicted = self.policy.applied.plan.predicted_peak


@pytest.mark.parametrize("accumulation", [1, 2])
def test_hf_trainer_step_under_bf16_peaks_where_its_plan_predicts(tmp_path: Path, accumulation: int):
    """Within 1% (they agree to a few bytes); the outputs held through the profile's backward
    over-predicted by the fp32 logits, and with accumulation 2 the plan was 6.4% under."""
    ids = torch.randint(0, VOCAB, (16, 128), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    policy = ActivationPolicyCallback(
        f"version: 1\ncheckpoint: {{mode: auto, modules: [GPT2Block]}}\nmemory_budget: {BUDGET}\n")
    peaks = StepPeaks(policy)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             gradient_accumulation_steps=accumulation, report_to=[], save_strategy="no",
                             disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True, bf16=True,
                             seed=0)
    Trainer(model=gpt2(), args=args, train_dataset=rows, callbacks=[policy, peaks]).train()
    plan = (tmp_path / "actcfg-plan.yaml").read_text()
    assert "mode: full" in plan or "mode: selective" in plan  # the budget makes it checkpoint
    measured = peaks.peaks[-1]  # the first step also ran the profile
    assert peaks.predicted is not None
    assert measured <= BUDGET
    assert abs(peaks.predicted - measured) <= 0.01 * measured, (peaks.predicted, measured)


@pytest.mark.cuda
@pytest.mark.parametrize("accumulation", [1, 2])
def test_gpu_hf_trainer_step_under_bf16_peaks_where_its_plan_predicts(tmp_path: Path, accumulation: int):
    """GPT-2 (6 layers, n_embd 768, GPT-2's vocabulary, batch 4 x 1024) in the Trainer with
    `bf16=True` on one GPU, the budget halfway between checkpointing every block and plain (both
    measured under bf16 autocast): the first step's peak (`first_step_peak`, from the step's
    start to the optimizer step) within 2% of the plan's prediction, and within the budget."""
    from actcfg.api import apply
    from actcfg.plan.profile import measure_steps

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def big() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=1024)).cuda()

    ids = torch.randint(0, 50257, (16, 1024), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    batch = {"input_ids": ids[:4].cuda(), "labels": ids[:4].cuda()}
    model = big()

    def loss(outputs: Any) -> torch.Tensor:  # as compute_loss: the outputs go before backward
        return outputs["loss"]

    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:  # as accelerate wraps it for bf16
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    _, plain = measure_steps(model, batch, loss_fn=loss, outputs_held=False)
    with apply(model, "version: 1\ncheckpoint: {mode: full, modules: [GPT2Block]}\n"):
        _, full = measure_steps(model, batch, loss_fn=loss, outputs_held=False)
    del model
    budget = (plain + full) // 2
    policy = ActivationPolicyCallback(
        f"version: 1\ncheckpoint: {{mode: auto, modules: [GPT2Block]}}\nmemory_budget: {budget}\n")
    peaks = StepPeaks(policy, count=False)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             gradient_accumulation_steps=accumulation, report_to=[], save_strategy="no",
                             disable_tqdm=True, dataloader_pin_memory=False, bf16=True, seed=0)
    Trainer(model=big(), args=args, train_dataset=rows, callbacks=[policy, peaks]).train()
    measured = policy.first_step_peak
    assert measured is not None and peaks.predicted is not None
    assert measured <= budget, (measured, budget)
    assert abs(peaks.predicted - measured) <= 0.02 * measured, (peaks.predicted, measured)


# --- Lightning ------------------------------------------------------------------------------------

PL_SHAPE = dict(n=4, d_model=64, heads=4, ffn=256, batch=4, seq=64)
PL_BUDGET = 3_200_000  # between checkpointing every block (~2.4 MB with the gradients) and plain (~5.4 MB)


class Blocks(pl.LightningModule):
    """The blocks stack, its output squared into the loss in fp32 (as benchmarks/trainer_bench.py)."""

    def __init__(self, dtype: torch.dtype = torch.float32, **shape: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks, _ = probes.blocks(**(shape or PL_SHAPE), dtype=dtype, device="cpu")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.blocks(x).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class LightningStepPeaks(pl.Callback):
    """Each step's peak, from `on_train_batch_start` to `on_after_backward`, above its start less
    the gradients alive then (on the CPU `LiveBytes`, counting their frees, as
    `memory_allocated()` does; on a GPU the allocator's statistics); the gradient bytes each
    step started with; the plan's predicted peak. Listed after the policy, which plans first."""

    def __init__(self, policy: ActivationPolicy, cuda: bool = False) -> None:
        self.policy = policy
        self.cuda = cuda
        self.meter = None if cuda else LiveBytes()
        self.started_with: list[int] = []
        self.peaks: list[int] = []
        self.predicted: int | None = None
        self._base = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        grads = gradient_bytes(pl_module)
        self.started_with.append(grads)
        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated() - grads
            torch.cuda.reset_peak_memory_stats()
        else:
            self.meter.start(held=[p.grad for p in pl_module.parameters() if p.grad is not None])

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - self._base)
        else:
            self.meter.stop()
            self.peaks.append(self.meter.peak + self.started_with[-1])
        if self.policy.applied is not None and self.policy.applied.plan is not None:
            self.predicted = self.policy.applied.plan.predicted_peak


def fit_planned(root: Path, budget: int, module: pl.LightningModule, x: torch.Tensor, batch: int,
                precision: str, accumulation: int = 1, cuda: bool = False) -> LightningStepPeaks:
    policy = ActivationPolicy(f"version: 1\ncheckpoint: {{mode: auto, modules: [Block]}}\nmemory_budget: {budget}\n")
    peaks = LightningStepPeaks(policy, cuda)
    trainer = pl.Trainer(max_steps=2, accumulate_grad_batches=accumulation, precision=precision,
                         accelerator="gpu" if cuda else "cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), callbacks=[policy, peaks])
    trainer.fit(module, DataLoader(TensorDataset(x), batch_size=batch))
    return peaks


@pytest.mark.parametrize(("precision", "accumulation"), [("32-true", 1), ("bf16-mixed", 1), ("32-true", 2)])
def test_lightning_step_peaks_where_its_plan_predicts(tmp_path: Path, precision: str, accumulation: int):
    """The steps after the first (which starts without gradients) peak within 1% of the plan's
    prediction (they agree to a few bytes), and within the budget; the plan counted the previous
    step's gradients through the forward (17% over it without, in the 32-true case). With
    `accumulate_grad_batches` 2 the later micro-batch keeps the gradients through its backward,
    where they are counted whole (`Profile.accumulated_grads`): an upper bound there (17% over
    this plan, whose peak is in a recompute)."""
    x = torch.randn(4 * PL_SHAPE["batch"], PL_SHAPE["seq"], PL_SHAPE["d_model"],
                    generator=torch.Generator().manual_seed(1))
    peaks = fit_planned(tmp_path, PL_BUDGET, Blocks(), x, PL_SHAPE["batch"], precision, accumulation)
    plan = (tmp_path / "actcfg-plan.yaml").read_text()
    assert "mode: full" in plan or "mode: selective" in plan  # the budget makes it checkpoint
    # Lightning's order, which the plan counts: a step starts with the previous step's gradients
    assert peaks.started_with[0] == 0 and all(g > 0 for g in peaks.started_with[1:])
    measured = max(peaks.peaks[1:])
    assert peaks.predicted is not None
    assert measured <= PL_BUDGET
    if accumulation == 1:
        assert abs(peaks.predicted - measured) <= 0.01 * measured, (peaks.predicted, measured)
    else:
        # An upper bound, to within the few bytes a composed plan's terms do not see
        # (`MIXED_HEADROOM`, which the budget keeps free for them): in one full CI run of 2026-12-03
        # this step measured 2970892 bytes against 2970888 predicted (a 4-byte scalar; the same
        # test alone, three times, measured at or under the prediction).
        assert measured <= peaks.predicted * (1 + MIXED_HEADROOM), (peaks.predicted, measured)


@pytest.mark.cuda
@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.bfloat16), ("bf16-mixed", torch.float32)],
                         ids=["bf16-weights-32-true", "fp32-weights-bf16-mixed"])
def test_gpu_lightning_step_peaks_where_its_plan_predicts(tmp_path: Path, precision: str, dtype: torch.dtype):
    """The blocks stack (8 blocks, d_model 1024, batch 4 x 1024) in Lightning's default strategy
    on one GPU, bf16 weights in `32-true` (as benchmarks/trainer_bench.py) and fp32 weights under
    `bf16-mixed` (autocast): the budget halfway between checkpointing every block and plain
    (each step's memory with the previous gradients through its forward); the steps after the
    first peak within 3% of the plan's prediction either way, and within the budget."""
    from actcfg.api import apply
    from actcfg.plan.profile import measure_steps

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shape = dict(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)
    x = torch.randn(5 * shape["batch"], shape["seq"], shape["d_model"],
                    generator=torch.Generator().manual_seed(1)).to(dtype)

    class Step(torch.nn.Module):  # training_step as a forward, under the precision's autocast
        def __init__(self, module: pl.LightningModule) -> None:
            super().__init__()
            self.module = module

        def forward(self, batch: Any) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed",
                                cache_enabled=False):
                return self.module.training_step(batch, 0)

    module = Blocks(dtype, **shape).cuda()
    step = Step(module)
    batch = ((x[:shape["batch"]].cuda(),),)
    _, plain = measure_steps(step, batch, loss_fn=lambda loss: loss)
    with apply(module, "version: 1\ncheckpoint: {mode: full, modules: [Block]}\n"):
        _, full = measure_steps(step, batch, loss_fn=lambda loss: loss)
    grads = sum(p.numel() * p.element_size() for p in module.parameters())
    del module, step, batch
    # a step's forward meets the previous step's gradients: plain's and full's forwards with them
    budget = (plain + full) // 2 + grads // 2
    peaks = fit_planned(tmp_path, budget, Blocks(dtype, **shape), x, shape["batch"], precision, cuda=True)
    assert all(g > 0 for g in peaks.started_with[1:])
    measured = max(peaks.peaks[1:])
    assert peaks.predicted is not None
    assert measured <= budget, (measured, budget)
    assert abs(peaks.predicted - measured) <= 0.03 * measured, (peaks.predicted, measured)
