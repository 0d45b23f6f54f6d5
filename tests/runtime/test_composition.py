"""actcfg.apply inside the stacks people train with, on the CPU: FSDP2, torch.compile, Hugging Face
models, the DeepSpeed engine; and the inputs and uses that once gave silently wrong results.

Offload runs through the real engine on the host (`host_loopback`), so these tests see its
counters move; the GPU tests (tests/runtime/test_composition_cuda.py) measure memory.
"""

from __future__ import annotations

import copy
import io
import logging
import threading
import warnings

import pytest
import torch
from torch import nn

import actcfg
from actcfg.errors import ActcfgError, OffloadError, PolicyApplyError
from actcfg.runtime.offload import OffloadWarning, host_loopback
from _helpers import assert_grads_close, grads_of, offload_blocks, saved_bytes, train_step

try:
    from tests._deepspeed_env import ds_env
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env

__all__ = ["ds_env"]

FULL = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
REENTRANT = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"], "reentrant": True}}
SELECTIVE = {"version": 1, "checkpoint": {"mode": "selective", "modules": ["Block"]}}
FULL_OFFLOAD = {**FULL, "cpu_checkpointing": True}
OFFLOAD_ALL = {"version": 1, "cpu_checkpointing": True}
SMALL = 1 << 14  # min_offload_bytes for these small models: a block input is 64 KiB


def moved_bytes(cfg: dict, x: torch.Tensor) -> int:
    """What one step of `cfg` on offload_blocks(4)'s four blocks moves to the host: with checkpointing, the
    inputs of blocks 1 and 2 (block 0's is x, the caller's batch; block 3 is the last group);
    without, everything blocks 0-2 save, measured on a plain model."""
    if "checkpoint" in cfg:
        return 2 * x.nbytes
    plain, _ = offload_blocks(4)
    return sum(saved_bytes(plain, x, list(plain.blocks), SMALL)[:-1])


def applied(model: nn.Module, cfg: dict) -> actcfg.AppliedPolicy:
    handle = actcfg.apply(model, cfg)
    if handle.engine is not None:
        handle.engine.min_offload_bytes = SMALL
    return handle


@pytest.fixture
def loopback():
    with host_loopback():
        yield


# --- FSDP2 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(ds_env):
    """A one-rank CPU DeviceMesh on the session's gloo group (started once, by DeepSpeed)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def shard(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["apply-then-shard", "shard-then-apply"])
@pytest.mark.parametrize("name", ["full", "reentrant", "full+offload", "offload"])
def test_fsdp2_in_either_order_gives_fsdp2s_gradients_and_the_policy_acts(mesh, loopback, order, name):
    cfg = {"full": FULL, "reentrant": REENTRANT, "full+offload": FULL_OFFLOAD, "offload": OFFLOAD_ALL}[name]
    reference, x = offload_blocks(4)
    shard(reference, mesh)
    want = train_step(reference, x)
    model, _ = offload_blocks(4)
    if order == "apply-then-shard":
        handle = applied(model, cfg)
        shard(model, mesh)
    else:
        shard(model, mesh)
        handle = applied(model, cfg)  # FSDP2 made each Block an FSDPBlock: still a Block
    assert type(model.blocks[0]).__name__ == "FSDPBlock"
    for _ in range(2):
        got = train_step(model, x)
    assert_grads_close(got, want, 1e-6)
    if "checkpoint" in cfg:
        assert handle.checkpointed == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
        assert handle.counters.recomputes == 2 * 4
    if cfg.get("cpu_checkpointing"):
        stats = handle.engine.stats
        assert stats.offloaded_bytes == moved_bytes(cfg, x) and stats.reloaded_bytes == stats.offloaded_bytes
        # FSDP2's unsharded parameters are saved too; they stay (their storage is freed and
        # refilled by FSDP2 around backward), recognised when saved; so does the batch.
        assert set(stats.kept_bytes_by_reason) <= {"parameter", "input"}
    handle.remove()


@pytest.mark.slow
def test_fsdp2_errors_name_the_class_the_user_wrote(mesh):
    model, _ = offload_blocks(2)
    shard(model, mesh)
    with pytest.raises(PolicyApplyError) as info:
        actcfg.apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block", "Linear"]}})
    assert str(info.value).startswith("checkpoint.modules: `blocks.0` (Block) and its submodule "
                                      "`blocks.0.qkv` (Linear) are both matched")


# --- torch.compile ----------------------------------------------------------------------------


def compiled_run(order: str, cfg: dict) -> tuple[actcfg.AppliedPolicy, nn.Module, nn.Module]:
    torch._dynamo.reset()
    model, _ = offload_blocks(4)
    if order == "compile-blocks-then-apply":
        for block in model.blocks:
            block.compile(backend="aot_eager")
        handle = applied(model, cfg)
        return handle, model, model
    handle = applied(model, cfg)
    if order == "apply-then-compile-model":
        return handle, model, torch.compile(model, backend="aot_eager")
    for block in model.blocks:
        block.compile(backend="aot_eager")
    return handle, model, model


ORDERS = ["apply-then-compile-model", "apply-then-compile-blocks", "compile-blocks-then-apply"]


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["full", "selective", "full+offload", "offload"])
def test_compile_in_every_order_gives_eager_gradients_and_really_offloads(loopback, order, name):
    from torch._dynamo.utils import counters

    cfg = {"full": FULL, "selective": SELECTIVE, "full+offload": FULL_OFFLOAD, "offload": OFFLOAD_ALL}[name]
    plain, x = offload_blocks(4)
    want = train_step(plain, x)
    eager = None
    if cfg.get("cpu_checkpointing"):
        eager_model, _ = offload_blocks(4)
        eager = applied(eager_model, cfg)
        train_step(eager_model, x)
    counters.clear()
    handle, model, run = compiled_run(order, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)  # a no-op offload would warn
        for _ in range(3):
            got = train_step(model, x, run)
    assert_grads_close(got, want, 1e-5)
    assert counters["stats"]["unique_graphs"] >= 1  # it really compiled...
    assert counters["stats"]["unique_graphs"] <= 4  # ...without a recompile storm
    if eager is not None:
        # The same bytes leave the device as in eager mode: the hooks saw the compiled graphs'
        # saved tensors, group by group.
        assert handle.engine.stats.offloaded_bytes == eager.engine.stats.offloaded_bytes == moved_bytes(cfg, x)
        assert handle.engine.stats.groups == eager.engine.stats.groups
        eager.remove()
    handle.remove()
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_of_a_reentrant_policy_runs_eager_checkpoint_with_eager_gradients():
    """torch traces only the non-reentrant checkpoint: a reentrant one breaks the graph and runs
    eagerly (documented in the README), with the same gradients."""
    torch._dynamo.reset()
    plain, x = offload_blocks(4)
    want = train_step(plain, x)
    model, _ = offload_blocks(4)
    actcfg.apply(model, REENTRANT)
    got = train_step(model, x, torch.compile(model, backend="aot_eager"))
    assert_grads_close(got, want, 1e-5)
    torch._dynamo.reset()


# --- Hugging Face -----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def lm_step(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=IDS, labels=IDS).loss.backward()
    return grads_of(model)


def count_calls(model: nn.Module, submodule: str) -> list[int]:
    """How often `submodule` of each decoder layer runs: a forward pre-hook counter."""
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        def hook(*_, i=i):
            calls[i] += 1
        layer.get_submodule(submodule).register_forward_pre_hook(hook)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [
    {"mode": "full", "modules": ["LlamaDecoderLayer"]},
    {"mode": "full", "modules": ["LlamaDecoderLayer"], "reentrant": True},
    {"mode": "selective", "modules": ["LlamaDecoderLayer"]},
    {"mode": "full", "modules": ["GradientCheckpointingLayer"]},  # by base class: the MRO
])
def test_hf_llama_recomputes_each_layer_with_plain_gradients_and_no_kv_cache(caplog, checkpoint):
    plain = llama()
    want = lm_step(plain)
    model = llama()
    calls = count_calls(model, "mlp")
    assert model.config.use_cache is True
    with caplog.at_level(logging.INFO, logger="actcfg"):
        handle = actcfg.apply(model, {"version": 1, "checkpoint": checkpoint})
    assert model.config.use_cache is False
    assert [r.getMessage() for r in caplog.records][0] == (
        "actcfg: turned off use_cache on LlamaForCausalLM's config, as transformers does when it "
        "checkpoints (a KV cache built in training keeps two block inputs per layer)")
    assert_grads_close(lm_step(model), want, 1e-6)
    assert calls == [2, 2, 2, 2]  # forward, then the recompute in backward
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    handle.remove()
    assert model.config.use_cache is True


@pytest.mark.slow
def test_hf_activation_checkpointing_already_on_is_refused_and_external_keeps_it(loopback):
    model = llama()
    model.activation_checkpointing_enable()
    with pytest.raises(PolicyApplyError) as info:
        actcfg.apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": ["LlamaDecoderLayer"]}})
    assert str(info.value).startswith(
        "`model.layers.0` (LlamaDecoderLayer) already has Hugging Face activation checkpointing on "
        "(gradient_checkpointing=True), and the policy checkpoints too")
    # mode external: Hugging Face checkpoints, actcfg offloads what its checkpoints keep.
    want = lm_step(llama())
    calls = count_calls(model, "mlp")
    handle = actcfg.apply(model, {"version": 1, "checkpoint": {"mode": "external"}, "cpu_checkpointing": True})
    handle.engine.min_offload_bytes = 1 << 12
    assert handle.offload.groups == tuple(f"model.layers.{i}" for i in range(4))
    assert_grads_close(lm_step(model), want, 1e-6)
    assert calls == [2, 2, 2, 2]
    # layers 0-2's hidden_states (2 x 32 x 64 floats); layer 3 is the last group, kept
    assert handle.engine.stats.offloaded_bytes == 3 * 2 * 32 * 64 * 4
    handle.remove()


class KeywordStack(nn.Module):
    """Calls its decoder layers with every tensor by keyword, as some models do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model.model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        cos_sin = self.inner.rotary_emb(h, position_ids=position_ids)
        for layer in self.inner.layers:
            h = layer(hidden_states=h, position_embeddings=cos_sin, position_ids=position_ids)
        return self.inner.norm(h)


def test_decoder_layer_inputs_passed_by_keyword_are_offloaded(loopback):
    base = llama()
    plain, model = KeywordStack(copy.deepcopy(base)), KeywordStack(base)
    plain(IDS).square().mean().backward()
    handle = actcfg.apply(model, {"version": 1, "cpu_checkpointing": True,
                                  "checkpoint": {"mode": "full", "modules": ["LlamaDecoderLayer"]}})
    handle.engine.min_offload_bytes = 1 << 12
    model(IDS).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Layers 0-2 keep their hidden_states (2 x 32 x 64 floats) on the host: passed by keyword,
    # they still reached the checkpoint function, and the offload hooks, as positional tensors.
    assert handle.engine.stats.offloaded_bytes == 3 * 2 * 32 * 64 * 4
    # The enclosing module (`inner`, a LlamaModel) is never called here: the step opened at the
    # first layer's entry and closed after the last layer's forward.
    assert handle.offload.within == "inner" and handle.engine._step is None


class TrainsThroughAStep(nn.Module):
    """Like a LightningModule: its own forward is never called; training_step calls the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model, _ = offload_blocks(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never called")

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).square().mean()


@pytest.mark.slow
def test_the_offload_step_is_the_innermost_module_enclosing_every_group(loopback):
    root = TrainsThroughAStep()
    plain, x = offload_blocks(4)
    reference = copy.deepcopy(plain)
    plain(x).square().mean().backward()
    handle = applied(root, OFFLOAD_ALL)
    assert handle.offload.within == "model"
    root.training_step(x).backward()
    # what blocks 0-2 save (block 3 is the last group), measured on a plain copy
    saved = saved_bytes(reference, x, list(reference.blocks), SMALL)
    assert handle.engine.stats.steps == 1 and handle.engine.stats.offloaded_bytes == sum(saved[:-1])
    for (name, p), q in zip(root.model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


# --- the DeepSpeed engine -----------------------------------------------------------------------


def _engine_losses(ds_env, stage: int, cfg: dict | None, backend: str | None) -> tuple[list[float], int]:
    import deepspeed

    model, x = offload_blocks(4)
    handle = actcfg.apply(model, cfg, backend=backend) if cfg else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage}})
    losses = []
    for _ in range(3):
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    recomputes = handle.counters.recomputes if handle else 0
    if handle:
        handle.remove()
    return losses, recomputes


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_deepspeed_engine_trains_to_the_same_losses_under_a_policy(ds_env, monkeypatch, stage, backend):
    # ZeRO-3 replaces torch.nn.functional.linear process-wide (deepspeed.runtime.zero.linear)
    # and never puts it back; monkeypatch restores it for the tests after this one.
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    want, _ = _engine_losses(ds_env, stage, None, None)
    got, recomputes = _engine_losses(ds_env, stage, FULL, backend)
    assert got == pytest.approx(want, rel=1e-5)
    assert recomputes == 3 * 4  # every block recomputed in each of the three steps


# --- never silently wrong -----------------------------------------------------------------------


class TakesDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, state: dict) -> dict:
        return {"h": torch.tanh(self.lin(state["h"])), "aux": state["h"].sum()}


class TakesList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hs: list) -> torch.Tensor:
        return torch.tanh(self.lin(hs[0]))


class DictChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a, self.b = TakesDict(), TakesDict()
        self.c = TakesList()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        state = self.b(self.a({"h": self.emb(ids)}))
        return self.c([state["h"]]) + state["aux"]


CASES = {
    "container inputs and dict outputs": ["TakesDict", "TakesList"],
    "integer-only inputs (token ids)": ["Embedding"],
}


@pytest.mark.parametrize("backend", ["torch", "torch-reentrant", "deepspeed"])
@pytest.mark.parametrize("case", list(CASES))
def test_containers_integer_inputs_and_dict_outputs_get_every_gradient(request, backend, case):
    if backend == "deepspeed":
        request.getfixturevalue("ds_env")
    torch.manual_seed(0)
    plain = DictChain()
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 16, (4, 3))
    checkpoint = {"mode": "full", "modules": CASES[case]}
    if backend == "torch-reentrant":
        checkpoint["reentrant"] = True
    handle = actcfg.apply(model, {"version": 1, "checkpoint": checkpoint},
                          backend="deepspeed" if backend == "deepspeed" else "torch")
    for m in (plain, model):
        m(ids).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    out = model.a({"h": torch.ones(2, 8)})
    assert isinstance(out, dict) and set(out) == {"h", "aux"}  # a dict comes back a dict
    handle.remove()


def test_a_small_saved_tensor_changed_in_place_raises_as_autograd_does(loopback):
    class Inplace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.sin()  # saves x (small: stays on the device, version-checked)
            x.add_(1.0)
            return y

    model = nn.Sequential(nn.Linear(4, 4), Inplace(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"one of the variables needed for gradient computation has been "
                                           r"modified by an inplace operation"):
        model(x).sum().backward()  # plain autograd raises too
    handle = actcfg.apply(model, OFFLOAD_ALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        out = model(x).sum()
    with pytest.raises(RuntimeError, match=r"^one of the variables needed for gradient computation has been "
                                           r"modified by an inplace operation: a saved tensor of shape \[2, 4\]"):
        out.backward()
    handle.remove()


def test_an_offload_that_moves_nothing_warns_once_with_the_reason(loopback):
    model, x = offload_blocks(1)  # one block: its group is the last, which stays for backward
    handle = applied(model, OFFLOAD_ALL)
    with pytest.warns(OffloadWarning) as record:
        train_step(model, x)
        train_step(model, x)
    assert [str(w.message) for w in record] == [
        "actcfg offload: a training forward offloaded nothing: all 0.3 MB of offloadable "
        "activations fell into one group, the last, which stays on the GPU for backward: no "
        "block boundary was seen during the forward (are the checkpointed or grouped modules "
        "ever called?)."] if handle.engine.stats.groups <= 1 else [
        "actcfg offload: a training forward offloaded nothing: the only offloadable activations "
        f"({handle.engine.stats.kept_bytes / 1e6:.1f} MB) were saved in the last group, which stays "
        "on the GPU for backward."]
    assert handle.report()["effect"]["offload"]["offloaded_bytes"] == 0
    handle.remove()


@pytest.mark.parametrize("cfg", [FULL, OFFLOAD_ALL])
def test_pickling_an_applied_model_is_refused_with_the_fix_and_works_after_remove(loopback, cfg):
    model, x = offload_blocks(2)
    handle = applied(model, cfg)
    copy.deepcopy(model)  # copies still work
    with pytest.raises(ActcfgError, match=r"^this model carries an actcfg policy, which cannot be "
                                         r"pickled with it \(torch.save of the whole model\): save "
                                         r"model.state_dict\(\) instead"):
        torch.save(model, io.BytesIO())
    handle.remove()
    torch.save(model, io.BytesIO())


def test_a_torchscript_module_is_refused_before_anything_is_wrapped():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = nn.Sequential(scripted, nn.Linear(4, 4))
    with pytest.raises(PolicyApplyError, match=r"^checkpoint.modules: `0` \(RecursiveScriptModule\) is a "
                                               r"TorchScript module, whose forward actcfg cannot wrap"):
        actcfg.apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": ["0"]}})
    assert not any("_actcfg" in k for m in model.modules() for k in m.__dict__)


def test_concurrent_forwards_of_a_checkpointed_model_each_get_their_own_gradients():
    plain, _ = offload_blocks(4)
    model = copy.deepcopy(plain)
    actcfg.apply(model, FULL)
    inputs = [torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    barrier = threading.Barrier(4)
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        x = inputs[i].requires_grad_()
        barrier.wait()
        out = model(x).square().mean()
        results[i] = torch.autograd.grad(out, [x, model.blocks[0].fc1.weight])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(inputs):
        x = x.detach().requires_grad_()
        want = torch.autograd.grad(plain(x).square().mean(), [x, plain.blocks[0].fc1.weight])
        for got, expected in zip(results[i], want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_second_thread_entering_an_offloading_forward_is_refused_with_a_sentence(loopback):
    entered, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if threading.current_thread().name == "first":
                entered.set()
                release.wait(10)
            return self.lin(x)

    model = nn.Sequential(Waits(), Waits())
    handle = actcfg.apply(model, OFFLOAD_ALL)
    handle.engine.min_offload_bytes = 0
    first = threading.Thread(target=lambda: model(torch.randn(2, 8)).sum().backward(), name="first")
    first.start()
    entered.wait(10)
    try:
        with pytest.raises(OffloadError, match=r"^a second thread ran a training forward of this model "
                                               r"while another thread's forward was being offloaded"):
            model(torch.randn(2, 8))
    finally:
        release.set()
        first.join()
    assert handle.engine.stats.steps == 1
    handle.remove()
