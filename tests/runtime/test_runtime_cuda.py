"""actcfg.apply on a GPU at the runtime issue's sizes: both backends x {checkpoint,
cpu_checkpointing, both} on the seed model (10 x Linear(2000, 2000), input 256x256x2000, fp16)
and the block stack (8 Blocks, d_model 2048, batch 8, sequence 2048, bf16).

Each case checks: gradients match the plain model within the dtype's tolerance; peak memory is
below the plain model's; with cpu_checkpointing, memory held after each block
(`torch.cuda.memory_allocated` in a forward hook) is flat over the second half of the stack;
pinned host memory stays within `pin_budget`; no pinned allocation after the first step.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/runtime/test_runtime_cuda.py
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch
from torch import nn

from actcfg.errors import PolicyApplyError
from actcfg.probes import blocks, linear_chain
from actcfg.api import apply
from _helpers import assert_grads_within, grads_of

try:
    from tests._deepspeed_env import ds_env
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env

__all__ = ["ds_env"]

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Gradient agreement, as the relative L2 error of each parameter's gradient. Checkpointing and
# offload are lossless; what differs is kernel nondeterminism (attention backward) in the dtype.
GRAD_RTOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
STEPS = 3


@dataclasses.dataclass
class Probe:
    """A model at the issue's sizes with its input, a fixed cotangent and the plain run."""

    name: str
    model: nn.Module
    x: torch.Tensor
    cotangent: torch.Tensor
    pattern: str
    blocks: list[nn.Module]
    input_bytes: int
    plain: Run | None = None


@dataclasses.dataclass
class Run:
    grads: dict[str, torch.Tensor]
    per_block: list[int]  # memory_allocated after each block's forward, last step
    peak: int  # max_memory_allocated over the last step above what was allocated before it


def _blocks_of(model: nn.Module, probe: str) -> list[nn.Module]:
    return list(model) if probe == "seed" else list(model.blocks)


def make_probe(name: str) -> Probe:
    torch.manual_seed(0)
    if name == "seed":
        model, x = linear_chain()
        pattern = "Linear"
    else:
        model, x = blocks()
        pattern = "Block"
    out_shape = x.shape
    cotangent = torch.randn(out_shape, device=x.device, dtype=x.dtype)
    probe = Probe(name, model, x, cotangent, pattern, _blocks_of(model, name),
                  x.numel() * x.element_size())
    probe.plain = run(model, probe, steps=1)
    return probe


def run(model: nn.Module, probe: Probe, steps: int = STEPS, each_step=None) -> Run:
    """`steps` forward+backward passes with the probe's cotangent; measures the last one."""
    per_block: list[int] = []
    recording = [False]

    def record(module, args, output):
        if recording[0]:
            per_block.append(torch.cuda.memory_allocated())

    hooks = [b.register_forward_hook(record) for b in _blocks_of(model, probe.name)]
    try:
        for i in range(steps):
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # Relative to the step's start: the plain model and its gradients are still on the
            # GPU while the policy's copy runs, and must not count against the policy.
            start = torch.cuda.memory_allocated()
            per_block.clear()
            recording[0] = True
            out = model(probe.x)
            recording[0] = False  # recomputation in backward calls the blocks again
            out.backward(probe.cotangent)
            del out
            torch.cuda.synchronize()
            if each_step is not None:
                each_step(i)
        peak = torch.cuda.max_memory_allocated() - start
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return Run(grads, list(per_block), peak)


@pytest.fixture(scope="module", params=["seed", "blocks"])
def probe(request) -> Probe:
    p = make_probe(request.param)
    yield p
    del p
    gc.collect()
    torch.cuda.empty_cache()


def assert_flat(per_block: list[int], unit: int, fluctuation: int, label: str) -> None:
    """Over the second half of the stack, less the last block (its activations stay on the GPU
    for backward, which needs them first): growth per block under 5% of one block input, and
    at most `fluctuation` bytes above the flat level while copies drain."""
    half = per_block[len(per_block) // 2:-1]
    assert len(half) >= 2, per_block
    growth = (half[-1] - half[0]) / (len(half) - 1)
    mib = [round(m / 2**20) for m in per_block]
    assert growth < 0.05 * unit, f"{label}: grows {growth / 2**20:.1f} MiB per block: {mib} MiB"
    assert max(half) - min(half) <= fluctuation, f"{label}: not flat: {mib} MiB"


# backend -> combo -> the policy's fields besides `version` and `backend`
COMBOS = {
    "torch": {
        "checkpoint": lambda p: {"checkpoint": {"mode": "full", "modules": [p]}},
        "cpu_checkpointing": lambda p: {"cpu_checkpointing": True},
        "both": lambda p: {"checkpoint": {"mode": "full", "modules": [p]}, "cpu_checkpointing": True},
    },
    # DeepSpeed's cpu_checkpointing acts only inside its checkpoint(), so for DeepSpeed
    # "cpu_checkpointing" and "both" are the same policy (the schema refuses cpu without it).
    "deepspeed": {
        "checkpoint": lambda p: {"checkpoint": {"mode": "full", "modules": [p]}},
        "cpu_checkpointing": lambda p: {"checkpoint": {"mode": "full", "modules": [p]},
                                        "cpu_checkpointing": True},
    },
}
CASES = [(b, c) for b, combos in COMBOS.items() for c in combos]


@pytest.mark.parametrize(("backend", "combo"), CASES, ids=[f"{b}-{c}" for b, c in CASES])
def test_policy_on_probe(probe, backend, combo, request):
    if backend == "deepspeed":
        request.getfixturevalue("ds_env")
    model = copy.deepcopy(probe.model)
    cfg = {"version": 1, "backend": backend, **COMBOS[backend][combo](probe.pattern)}
    plain = probe.plain
    with apply(model, cfg) as handle:
        engine = handle.engine
        pinned_after_first: list[int] = []

        def each_step(i: int) -> None:
            if engine is not None and i == 0:
                pinned_after_first.append(engine.stats.pinned_allocations)

        got = run(model, probe, each_step=each_step)
        label = f"{probe.name} {backend} {combo}"
        assert_grads_within(got.grads, plain.grads, GRAD_RTOL[probe.x.dtype])
        offloads = cfg.get("cpu_checkpointing", False)
        if probe.name == "seed" and not offloads:
            # A checkpointed Linear saves exactly what a plain one saves (its input), so the
            # policy promises no drop here; recomputation may add one layer output in backward.
            assert got.peak <= plain.peak + probe.input_bytes, (
                f"{label}: peak {got.peak} above plain {plain.peak} + one layer input")
        else:
            assert got.peak < plain.peak, f"{label}: peak {got.peak} not below plain {plain.peak}"
        if offloads:
            checkpointed = "checkpoint" in cfg
            # With checkpointing only block inputs are offloaded; without, each block's whole
            # saved set is one group, so draining may hold one group (what a block saves).
            saved_per_block = max(b - a for a, b in zip(plain.per_block, plain.per_block[1:]))
            fluctuation = probe.input_bytes if checkpointed else max(saved_per_block, probe.input_bytes)
            assert_flat(got.per_block, probe.input_bytes, fluctuation, label)
        if engine is not None:
            stats = engine.stats
            assert stats.offloaded_bytes > 0, label
            assert stats.pinned_bytes > 0 and stats.pageable_bytes == 0, label
            assert stats.pinned_allocations == pinned_after_first[0], (
                f"{label}: pinned allocations after step 1 {pinned_after_first[0]}, "
                f"after step {STEPS} {stats.pinned_allocations}")
        else:
            assert not (backend == "torch" and offloads)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def test_plain_memory_grows_per_block(probe):
    """The flatness criterion has teeth: without a policy memory grows by what a block saves."""
    per = probe.plain.per_block
    assert all(b - a >= probe.input_bytes for a, b in zip(per, per[1:])), per


# --- offload engine settings through apply --------------------------------------------------


def seed_small(n: int = 6) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return linear_chain(n=n, width=1024, shape=(64, 64), dtype=torch.float16)


def plain_grads(model: nn.Module, x: torch.Tensor, cot: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward(cot)
    return grads_of(model)


def test_pinned_memory_never_exceeds_pin_budget():
    from actcfg.runtime.offload import OffloadWarning

    model, x = seed_small()
    cot = torch.randn_like(x)
    want = plain_grads(copy.deepcopy(model), x, cot)
    block_input = x.numel() * x.element_size()
    budget = 2 * block_input + block_input // 2
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Linear"]},
           "cpu_checkpointing": True, "pin_budget": budget}
    with apply(model, cfg) as handle:
        assert handle.offload.pin_budget == budget
        with pytest.warns(OffloadWarning):
            for _ in range(STEPS):
                got = plain_grads(model, x, cot)
                assert handle.engine.stats.pinned_bytes <= budget
        stats = handle.engine.stats
        assert 0 < stats.pinned_bytes <= budget
        assert stats.pageable_bytes > 0 and stats.pinned_fallbacks > 0
    assert_grads_within(got, want, GRAD_RTOL[torch.float16])


def test_pin_false_uses_pageable_memory_only():
    model, x = seed_small()
    cot = torch.randn_like(x)
    want = plain_grads(copy.deepcopy(model), x, cot)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Linear"]},
           "cpu_checkpointing": True, "pin": False}
    with apply(model, cfg) as handle:
        got = plain_grads(model, x, cot)
        assert handle.engine.stats.pinned_bytes == 0
        assert handle.engine.stats.pageable_bytes > 0
    assert_grads_within(got, want, GRAD_RTOL[torch.float16])


def test_offload_report_names_groups():
    model, _ = seed_small(4)
    with apply(model, {"version": 1, "cpu_checkpointing": True}) as handle:
        assert handle.offload.scope == "all_saved"
        assert handle.offload.groups == ("0", "1", "2", "3")
        assert handle.offload.grouping == "children of the model"
    model, _ = blocks(n=3, d_model=64, heads=4, ffn=128, batch=2, seq=16)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True}
    with apply(model, cfg) as handle:
        assert handle.offload.scope == "checkpoint_inputs"
        assert handle.offload.groups == ("blocks.0", "blocks.1", "blocks.2")
        assert handle.offload.grouping == "the checkpointed modules"


@pytest.mark.parametrize("ckpt", [{"mode": "none"}, {"mode": "full", "modules": ["Linear"]}])
def test_no_grad_forwards_offload_nothing_and_eval_forwards_leak_nothing(ckpt):
    model, x = seed_small()
    with apply(model, {"version": 1, "checkpoint": ckpt, "cpu_checkpointing": True}) as handle:
        plain_grads(model, x, torch.randn_like(x))  # one training step warms the pool
        steps = handle.engine.stats.steps
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pinned = handle.engine.stats.pinned_bytes
        for _ in range(50):
            with torch.no_grad():
                model(x)
        torch.cuda.synchronize()
        assert handle.engine.stats.steps == steps
        # eval() with grad on saves for backward, so it is offloaded (by grad mode, issue 20);
        # forwards never followed by backward give everything back and reuse the pool.
        model.eval()
        for _ in range(50):
            model(x).sum()
        torch.cuda.synchronize()
        assert handle.engine.stats.steps == steps + 50
        assert torch.cuda.memory_allocated() == before
        assert handle.engine.stats.pinned_bytes == pinned


@pytest.mark.parametrize("combo", ["cpu_checkpointing", "both"])
def test_an_exception_in_forward_closes_the_offload_step(combo):
    model, x = blocks(n=4, d_model=256, heads=4, ffn=512, batch=8, seq=512)  # 2 MiB inputs: offloaded
    cot = torch.randn_like(x)
    want = plain_grads(copy.deepcopy(model), x, cot)
    before = [(n, sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks))
              for n, m in model.named_modules()]
    cfg = {"version": 1, "cpu_checkpointing": True}
    if combo == "both":
        cfg["checkpoint"] = {"mode": "full", "modules": ["Block"]}
    fail = [True]

    def boom(module, args):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("boom")

    h = model.blocks[2].fc1.register_forward_pre_hook(boom)
    handle = apply(model, cfg)
    with pytest.raises(RuntimeError, match="^boom$"):
        model(x)
    for _ in range(2):
        got = plain_grads(model, x, cot)
        assert handle.engine.stats.offloaded_bytes > 0
    assert_grads_within(got, want, GRAD_RTOL[torch.bfloat16])
    h.remove()
    handle.remove()
    assert [(n, sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks))
            for n, m in model.named_modules()] == before


def test_a_deepcopy_of_an_offloaded_model_evaluates_with_its_own_weights():
    model, x = seed_small(4)
    with apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": ["Linear"]},
                       "cpu_checkpointing": True}):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
            expected = seed_small(4)[0]
            expected.load_state_dict(twin.state_dict())
            torch.testing.assert_close(twin(x), expected(x), rtol=0, atol=0)
            assert not torch.equal(twin(x), model(x))


def test_remove_then_training_the_copy_is_a_clear_error():
    model, x = seed_small(4)
    handle = apply(model, {"version": 1, "cpu_checkpointing": True})
    twin = copy.deepcopy(model)
    handle.remove()
    with pytest.raises(PolicyApplyError, match=r"^this model is a copy of a model whose actcfg "
                       r"policy was removed"):
        twin(x)


# --- DeepSpeed's input-emptying hazard (BACKENDS.md 1.4) -------------------------------------


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def residual_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 512),
        *(Residual(nn.Sequential(nn.Linear(512, 512), nn.GELU())) for _ in range(4)),
    ).cuda()
    return model, torch.randn(64, 512, device="cuda")


def test_deepspeed_cpu_checkpointing_empties_the_callers_tensor_without_actcfg(ds_env):
    """The hazard is real here: calling DeepSpeed directly, `x + checkpoint(f, x)` is garbage."""
    ckpt = ds_env
    model, x = residual_model()
    inner = model[1].inner
    h = model[0](x)
    want = h + inner(h)
    ckpt.configure(None, partition_activations=False, contiguous_checkpointing=False,
                   num_checkpoints=None, checkpoint_in_cpu=True, synchronize=False, profile=False)
    try:
        h = model[0](x)
        y = ckpt.checkpoint(inner, h)
        assert h.numel() <= 1  # DeepSpeed emptied the caller's tensor
        assert not torch.allclose(h + y, want)
    finally:
        ckpt.reset()  # drain DeepSpeed's offload engine: this forward gets no backward
        ckpt._configure_defaults()


def test_actcfg_guards_the_residual_around_a_deepspeed_checkpoint(ds_env):
    model, x = residual_model()
    plain = copy.deepcopy(model)
    cot = torch.randn(64, 512, device="cuda")
    want_out = plain(x)
    want = plain_grads(plain, x, cot)
    cfg = {"version": 1, "backend": "deepspeed", "cpu_checkpointing": True,
           "checkpoint": {"mode": "full", "modules": ["*.inner"]}}
    with apply(model, cfg) as handle:
        assert handle.checkpointed == ("1.inner", "2.inner", "3.inner", "4.inner")
        torch.testing.assert_close(model(x), want_out, rtol=1e-6, atol=1e-6)
        for _ in range(2):
            got = plain_grads(model, x, cot)
            assert_grads_within(got, want, GRAD_RTOL[torch.float32])
