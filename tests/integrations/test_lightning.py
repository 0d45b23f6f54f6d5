"""actcfg.integrations.lightning.ActivationPolicy in a real Lightning `Trainer` on the CPU, over
actcfg.probes.BlockStack and a tiny randomly initialised Llama: recompute, equal weights,
unchanged names, refusals before training, removal at teardown and on exceptions, the
DeepSpeedStrategy config check, and the README's snippet.

Lightning 2.6.6's DeepSpeedStrategy refuses every accelerator but CUDA ("The DeepSpeed strategy
is only supported on CUDA GPUs"), so training through it is tested under `cuda`; on the CPU its
config check is driven through the callback's `setup` on a real Trainer built with the strategy.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from actcfg.errors import ConfigLoadError, PolicyApplyError  # noqa: E402
from actcfg.integrations.lightning import ActivationPolicy  # noqa: E402
from actcfg.probes import BlockStack  # noqa: E402
from _helpers import readme_snippet, tiny_llama  # noqa: E402

STEPS = 3
BLOCKS = 3
FULL = "version: 1\ncheckpoint: {mode: full, modules: [Block]}\n"

pytestmark = [
    # Lightning 2.6.6 flattens batches with torch's LeafSpec, which torch 2.13 deprecates.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # With no DataLoader workers, Lightning suggests adding some.
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    # These tests train on the CPU on purpose, also where a GPU is present.
    pytest.mark.filterwarnings("ignore:GPU available but not used"),
]


class Blocks(pl.LightningModule):
    """A LightningModule over a stack of transformer `Block`s; training_step calls the stack."""

    def __init__(self, n: int = BLOCKS, build_late: bool = False) -> None:
        super().__init__()
        self.n = n
        self.model: nn.Module | None = None if build_late else self._build()

    def _build(self) -> nn.Module:
        torch.manual_seed(0)
        return BlockStack(self.n, d_model=32, heads=4, ffn=64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.model(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LateBlocks(Blocks):
    """The same stack, built in configure_model (after the callback's setup)."""

    def __init__(self) -> None:
        super().__init__(build_late=True)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()


def loader() -> DataLoader:
    x = torch.randn(4 * STEPS, 8, 32, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x), batch_size=4)


def trainer(*callbacks: pl.Callback, **extra: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks), **extra)


def count_fc1_calls(blocks: nn.Module) -> list[list[int]]:
    """A forward pre-hook on each block's first MLP layer: it fires in forward and in the recompute."""
    counts: list[list[int]] = []
    for block in blocks:
        count = [0]
        block.fc1.register_forward_pre_hook(lambda m, a, count=count: count.__setitem__(0, count[0] + 1))
        counts.append(count)
    return counts


def module_state(model: nn.Module) -> list[tuple[Any, ...]]:
    """Per module: hook counts, an instance forward, and keys actcfg or torch's checkpoint add."""
    return [(name, len(m._forward_pre_hooks), len(m._forward_hooks), "forward" in m.__dict__,
             sorted(k for k in m.__dict__ if k.startswith(("_actcfg", "__composable_api"))))
            for name, m in model.named_modules()]


class Spy(pl.Callback):
    """Records, at each training batch, what the module and the callback under test look like."""

    def __init__(self, policy_callback: ActivationPolicy | None = None) -> None:
        self.policy_callback = policy_callback
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({
            "parameters": [n for n, _ in pl_module.named_parameters()],
            "state_dict": list(pl_module.state_dict()),
            "applied": None if self.policy_callback is None else self.policy_callback.applied,
        })


# --- recompute, weights, names, removal --------------------------------------------------


def test_each_checkpointed_block_recomputes_once_per_step():
    plain, policy = Blocks(), Blocks()
    plain_calls, policy_calls = count_fc1_calls(plain.model.blocks), count_fc1_calls(policy.model.blocks)
    trainer().fit(plain, loader())
    trainer(ActivationPolicy(FULL)).fit(policy, loader())
    assert [c[0] for c in plain_calls] == [STEPS] * BLOCKS
    assert [c[0] for c in policy_calls] == [2 * STEPS] * BLOCKS


def test_trained_weights_and_names_equal_the_plain_run():
    plain, policy = Blocks(), Blocks()
    names = [n for n, _ in policy.named_parameters()]
    keys = list(policy.state_dict())
    callback = ActivationPolicy(FULL)
    spy = Spy(callback)
    trainer().fit(plain, loader())
    trainer(callback, spy).fit(policy, loader())
    assert len(spy.steps) == STEPS
    assert all(s["parameters"] == names and s["state_dict"] == keys for s in spy.steps)
    assert [n for n, _ in policy.named_parameters()] == names
    assert list(policy.state_dict()) == keys
    want = dict(plain.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.allclose(p, want[name], rtol=1e-6, atol=1e-7), name
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), Blocks().parameters()))


def test_the_policy_is_live_during_fit_and_removed_at_teardown():
    module = Blocks()
    callback = ActivationPolicy(FULL)
    spy = Spy(callback)
    before = module_state(module)
    trainer(callback, spy).fit(module, loader())
    handle = spy.steps[0]["applied"]
    assert handle is not None and all(s["applied"] is handle for s in spy.steps)
    assert handle.checkpointed == tuple(f"model.blocks.{i}" for i in range(BLOCKS))
    assert handle.removed
    assert callback.applied is None
    assert module_state(module) == before


def test_the_policy_is_removed_when_fit_raises():
    class Failing(Blocks):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    module = Failing()
    callback = ActivationPolicy(FULL)
    spy = Spy(callback)
    before = module_state(module)
    with pytest.raises(RuntimeError, match="^boom$"):
        trainer(callback, spy).fit(module, loader())
    assert spy.steps[0]["applied"].removed
    assert callback.applied is None
    assert module_state(module) == before


def test_layers_built_in_configure_model_are_checkpointed():
    module = LateBlocks()
    counts: list[list[int]] = []

    class Count(pl.Callback):
        def on_fit_start(self, trainer, pl_module):  # after configure_model built the stack
            counts.extend(count_fc1_calls(pl_module.model.blocks))

    callback = ActivationPolicy(FULL)
    spy = Spy(callback)
    trainer(Count(), callback, spy).fit(module, loader())
    assert [c[0] for c in counts] == [2 * STEPS] * BLOCKS
    assert spy.steps[0]["applied"].checkpointed == tuple(f"model.blocks.{i}" for i in range(BLOCKS))


def test_checkpointed_blocks_that_no_gradient_reaches_are_refused_after_the_first_step():
    class FrozenBlocks(Blocks):
        def __init__(self) -> None:
            super().__init__()
            self.model.requires_grad_(False)
            self.head = nn.Linear(32, 1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.head(self.model(x)).square().mean()

    module = FrozenBlocks()
    before = module_state(module)
    want = (
        "checkpoint: a training step ran 3 checkpointed forwards and backward recomputed none of "
        "them, so checkpointing saved nothing: no gradient flows through `model.blocks.0`, "
        "`model.blocks.1`, `model.blocks.2` (frozen, or outside the loss); narrow "
        "checkpoint.modules to the modules that train"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        trainer(ActivationPolicy(FULL)).fit(module, loader())
    assert module_state(module) == before  # removed by on_exception


# --- refusals before training ------------------------------------------------------------


def test_a_pattern_that_matches_no_layer_is_refused_before_training_starts():
    module = Blocks()
    calls = count_fc1_calls(module.model.blocks)
    before = module_state(module)
    callback = ActivationPolicy("version: 1\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n")
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.modules: pattern 'LlamaDecoderLayer' matches no module"):
        trainer(callback).fit(module, loader())
    assert [c[0] for c in calls] == [0] * BLOCKS
    assert callback.applied is None
    assert module_state(module) == before


def test_a_bad_policy_fails_when_the_callback_is_built():
    with pytest.raises(ConfigLoadError, match="modules"):
        ActivationPolicy("version: 1\ncheckpoint: {mode: full}\n")


def test_blocks_already_in_torchs_checkpoint_wrapper_are_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from actcfg.probes import Block

    module = Blocks()
    apply_activation_checkpointing(module.model, check_fn=lambda m: isinstance(m, Block))
    want = (
        "torch's checkpoint_wrapper on `model.blocks.0` and 2 more (FSDPStrategy's "
        "activation_checkpointing_policy, or your own apply_activation_checkpointing) and the actcfg "
        "policy's `checkpoint: {mode: full}` would stack two recomputes of each layer in backward: "
        "remove activation_checkpointing_policy from the strategy, or write "
        "`checkpoint: {mode: external}` to keep HF's own checkpointing and let actcfg offload around it"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        trainer(ActivationPolicy(FULL)).fit(module, loader())


# --- a Hugging Face model inside a LightningModule -----------------------------------------


class Llama(pl.LightningModule):
    """A LightningModule over a tiny randomly initialised Hugging Face Llama."""

    def __init__(self) -> None:
        super().__init__()
        pytest.importorskip("transformers")
        self.llama = tiny_llama()
        self.use_cache_seen: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        self.use_cache_seen.append(self.llama.config.use_cache)
        return self.llama(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_loader() -> DataLoader:
    ids = torch.randint(0, 96, (4 * STEPS, 16), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=4)


LLAMA_FULL = "version: 1\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"


def test_a_hugging_face_model_with_its_checkpointing_on_is_refused():
    module = Llama()
    enable = getattr(module.llama, "activation_checkpointing_enable", None)
    (enable or module.llama.gradient_checkpointing_enable)()  # transformers 5.17 has only the old name
    want = (
        "Hugging Face activation checkpointing on `llama.model.layers.0` and 1 more and the actcfg "
        "policy's `checkpoint: {mode: full}` would stack two recomputes of each layer in backward: "
        "call activation_checkpointing_disable() on the Hugging Face model, or write "
        "`checkpoint: {mode: external}` to keep HF's own checkpointing and let actcfg offload around it"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        trainer(ActivationPolicy(LLAMA_FULL)).fit(module, token_loader())


def test_a_hugging_face_model_trains_with_use_cache_off_and_gets_it_back():
    module = Llama()
    assert module.llama.config.use_cache is True
    trainer(ActivationPolicy(LLAMA_FULL)).fit(module, token_loader())
    assert module.use_cache_seen == [False] * STEPS
    assert module.llama.config.use_cache is True


# --- DeepSpeedStrategy's config section (checked in setup, before any model work) ----------


def deepspeed_trainer(strategy: DeepSpeedStrategy, callback: ActivationPolicy) -> pl.Trainer:
    """A real Trainer with the strategy; fitting it needs CUDA, so the tests call setup."""
    return pl.Trainer(accelerator="cpu", strategy=strategy, logger=False, callbacks=[callback])


DS_POLICY = ("version: 1\nbackend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\n"
             "cpu_checkpointing: true\nsynchronize: true\n")


@pytest.mark.deepspeed
def test_a_strategy_section_that_disagrees_is_refused_naming_both():
    callback = ActivationPolicy(DS_POLICY)
    strategy = DeepSpeedStrategy(partition_activations=True, cpu_checkpointing=True)
    want = (
        "the DeepSpeedStrategy config's `activation_checkpointing` section disagrees with the actcfg "
        "policy, which configures DeepSpeed in its place: activation_checkpointing.partition_activations "
        "is true in the DeepSpeedStrategy config, policy field partition is false; "
        "activation_checkpointing.synchronize_checkpoint_boundary is false in the DeepSpeedStrategy "
        "config, policy field synchronize is true; remove the section from the DeepSpeedStrategy "
        "config, or make it agree with the policy"
    )
    with pytest.raises(PolicyApplyError, match=rf"^{re.escape(want)}$"):
        callback.setup(deepspeed_trainer(strategy, callback), Blocks(), "fit")


@pytest.mark.deepspeed
@pytest.mark.parametrize("strategy", [
    pytest.param(lambda: DeepSpeedStrategy(), id="keyword-defaults"),
    pytest.param(lambda: DeepSpeedStrategy(cpu_checkpointing=True, synchronize_checkpoint_boundary=True),
                 id="agreeing-keywords"),
    pytest.param(lambda: DeepSpeedStrategy(config={
        "train_micro_batch_size_per_gpu": 1,
        "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": None}}),
        id="agreeing-config"),
])
def test_a_strategy_section_that_agrees_or_is_lightnings_default_is_accepted(strategy):
    callback = ActivationPolicy(DS_POLICY)
    callback.setup(deepspeed_trainer(strategy(), callback), Blocks(), "fit")
    assert callback.applied is None  # applied later, in on_fit_start


# --- the README ---------------------------------------------------------------------------


def test_the_readme_lightning_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(readme_snippet("With Lightning"), "README.md", "exec"), namespace)
    assert namespace["trainer"].global_step == 2
    assert namespace["policy"].applied is None  # applied for fit, removed at teardown


# --- on the GPU: DeepSpeedStrategy -------------------------------------------------------

GPU_BLOCKS = 8


class GpuBlocks(Blocks):
    """Eight blocks (d 1024) on batches of 8 x 1024 tokens: one block input is 32 MiB in fp32.
    Records memory allocated at the entry of each block in training forwards."""

    def __init__(self) -> None:
        super().__init__(build_late=True)
        torch.manual_seed(0)
        self.model = BlockStack(GPU_BLOCKS, d_model=1024, heads=16, ffn=4096)
        self.held: list[tuple[int, int]] = []
        for block in self.model.blocks:
            block.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled():
            self.held.append((torch.cuda.memory_allocated(), args[0].nbytes))


def gpu_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 1024, 1024)), batch_size=8)


class DeepSpeedSpy(pl.Callback):
    """DeepSpeed's activation-checkpointing globals at train start and at every batch."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def _read(self) -> None:
        from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

        try:
            from tests._deepspeed_env import ds_globals
        except ImportError:
            from _deepspeed_env import ds_globals
        self.seen.append({**ds_globals(ckpt), "is_configured": ckpt.is_configured()})

    def on_train_start(self, trainer, pl_module):
        self._read()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._read()


@pytest.mark.cuda
@pytest.mark.deepspeed
def test_gpu_deepspeed_strategy_gets_all_six_settings_and_holds_memory_flat():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    def fit(*callbacks: pl.Callback) -> GpuBlocks:
        module = GpuBlocks()
        pl.Trainer(accelerator="cuda", devices=1, max_steps=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   strategy=DeepSpeedStrategy(stage=0, cpu_checkpointing=True,
                                              synchronize_checkpoint_boundary=True),
                   callbacks=list(callbacks)).fit(module, gpu_loader())
        return module

    want = {"partition_activations": False, "contiguous_checkpointing": False, "num_checkpoints": None,
            "checkpoint_in_cpu": True, "synchronize": True, "profile": False, "is_configured": True}
    lightning_alone = DeepSpeedSpy()
    fit(lightning_alone)
    # Lightning 2.6.6 alone drops synchronize_checkpoint_boundary on its way to configure().
    assert lightning_alone.seen == [{**want, "synchronize": False}] * 3
    spy = DeepSpeedSpy()
    module = fit(ActivationPolicy(DS_POLICY), spy)
    assert spy.seen == [want] * 3
    last = module.held[-GPU_BLOCKS:]  # DeepSpeed recomputes through forward(), not the hooks
    one_input = last[0][1]
    growth = [b[0] - a[0] for a, b in zip(last, last[1:])]
    print(f"growth per block, one input {one_input}: DeepSpeedStrategy + policy {growth}")
    # DeepSpeed's offload engine keeps the newest inputs on the GPU while their copies run:
    # the first blocks add one input each, the rest nothing.
    assert all(abs(g) < one_input // 10 for g in growth[3:]), growth


@pytest.mark.cuda
@pytest.mark.deepspeed
def test_gpu_deepspeed_strategy_with_a_disagreeing_section_is_refused_before_the_first_step():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module = GpuBlocks()
    with pytest.raises(PolicyApplyError, match=r"^the DeepSpeedStrategy config's `activation_checkpointing` "
                                               r"section disagrees .*policy field partition is false"):
        pl.Trainer(accelerator="cuda", devices=1, max_steps=2, logger=False,
                   strategy=DeepSpeedStrategy(stage=0, partition_activations=True),
                   callbacks=[ActivationPolicy(DS_POLICY)]).fit(module, gpu_loader())
    assert module.held == []
