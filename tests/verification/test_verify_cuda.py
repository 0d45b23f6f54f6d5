"""verify on a real GPU: it passes working policies of both backends and fails, with the right
sentence, the broken ones that motivated actcfg. Nothing is mocked: the broken cases are broken
`apply` functions and a broken model, measured like any other.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/verification/test_verify_cuda.py
Sizes are moderate (one block input 64 MiB) so the file runs in well under two minutes.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from actcfg.verification import Verdict, VerifyReport, verify  # noqa: E402
from actcfg.verification.render import render_text  # noqa: E402

try:
    from tests._deepspeed_env import ds_env  # noqa: F401 (a fixture)
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _deepspeed_env import ds_env  # noqa: F401

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SEED = CONFIGS / "seed-linear-offload.yaml"  # torch, full checkpoint of Linear, cpu_checkpointing
DS_OFFLOAD = {"version": 1, "backend": "deepspeed",
              "checkpoint": {"mode": "full", "modules": ["Linear"]}, "cpu_checkpointing": True}
ONE_INPUT = 64 * 512 * 1024 * 2  # bytes of one block input of `chain`: 64 MiB


def chain():
    from actcfg.probes import linear_chain

    torch.manual_seed(0)
    return linear_chain(width=1024, shape=(64, 512))


def block_stack():
    from actcfg.probes import blocks

    torch.manual_seed(0)
    return blocks(n=6, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)


def verdicts(report: VerifyReport) -> dict[str, Verdict]:
    return {v.promise: v for v in report.verdicts}


def grows_by_one_input_per_block(held: tuple[int, ...]) -> bool:
    # within 1 MiB: the caching allocator may hand out a block a little larger than asked
    return all(abs(b - a - ONE_INPUT) < 2**20 for a, b in zip(held, held[1:]))


# --- working policies pass -----------------------------------------------------------------------


def test_torch_checkpoint_with_cpu_offload_passes_on_the_seed_chain():
    report = verify(chain, SEED)
    m = report.measurements
    assert report.ok, render_text(report)
    assert list(verdicts(report)) == ["cpu_checkpointing", "held inputs", "peak", "recompute", "gradients"]
    # backward holds the input in use and the one being prefetched: keep_last (1) + 1
    assert m.keep_last == 1 and m.backward_held_bytes <= 2 * ONE_INPUT
    assert m.blocks == tuple(str(i) for i in range(10))
    assert m.block_input_bytes == ONE_INPUT
    assert m.dtype == "float16"
    # Plain, each Linear keeps its input: exactly one block input more per block.
    assert grows_by_one_input_per_block(m.plain.held), m.plain.held
    # With the policy the offloaded inputs live in pinned host memory instead.
    assert m.host_pinned_bytes is not None and m.host_pinned_bytes >= 5 * ONE_INPUT
    assert m.policy.peak < m.plain.peak - 2 * ONE_INPUT


def test_torch_checkpoint_with_cpu_offload_passes_on_transformer_blocks():
    report = verify(block_stack, CONFIGS / "torch-checkpoint-offload.yaml")
    assert report.ok, render_text(report)
    assert report.measurements.blocks == tuple(f"blocks.{i}" for i in range(6))
    assert report.measurements.dtype == "bfloat16"


def test_deepspeed_checkpoint_with_cpu_checkpointing_passes(ds_env):
    report = verify(chain, DS_OFFLOAD)
    assert report.backend == "deepspeed"
    assert report.ok, render_text(report)
    assert list(verdicts(report)) == ["cpu_checkpointing", "peak", "recompute", "gradients"]
    assert grows_by_one_input_per_block(report.measurements.plain.held)


class DropBlock(nn.Module):
    """Linear then dropout: a new random mask each forward in train mode."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.fc(x))


def dropout_chain():
    torch.manual_seed(0)
    model = nn.Sequential(*(DropBlock(1024) for _ in range(6))).cuda().train()
    return model, torch.randn(64, 256, 1024, device="cuda")


def test_dropout_in_train_mode_gives_equal_gradients():
    # Both runs are seeded alike each step: unseeded, the policy run drew other dropout masks
    # than the plain run and the gradient verdict failed a working policy.
    policy = {"version": 1, "backend": "torch",
              "checkpoint": {"mode": "full", "modules": ["DropBlock"]}}
    grads = verdicts(verify(dropout_chain, policy))["gradients"]
    assert grads.ok, grads.message


# --- broken ones fail with the right sentence ------------------------------------------------------

NOT_OFFLOADED = re.compile(
    r"cpu_checkpointing is on but GPU memory grew by 67\.1 MB per block, the size of one block "
    r"input: the offload did not take effect")


def test_an_apply_that_drops_cpu_checkpointing_fails_the_offload_promise():
    # The seed bug: the translator lost cpu_checkpointing; the report checks the original.
    from actcfg.api import apply

    def dropping(model, policy, **kwargs):
        return apply(model, policy.model_copy(update={"cpu_checkpointing": False}), **kwargs)

    report = verify(chain, SEED, apply=dropping)
    assert not report.ok
    offload = verdicts(report)["cpu_checkpointing"]
    assert not offload.ok
    assert NOT_OFFLOADED.fullmatch(offload.message), offload.message
    assert verdicts(report)["gradients"].ok  # checkpointing itself still works


def test_deepspeed_configured_but_not_routed_fails_the_offload_promise(ds_env):
    # DeepSpeed's JSON section (or configure()) does nothing unless modules route through
    # deepspeed.checkpointing.checkpoint (BACKENDS.md 1.3): configure exactly as actcfg would,
    # route nothing.
    from actcfg.translators import to_deepspeed

    def configure_only(model, policy, *, backend=None, mpu=None):
        ds_env.configure(None, **to_deepspeed(policy)["configure_kwargs"])
        assert ds_env.CPU_CHECKPOINT is True
        names = tuple(name for name, _ in model.named_children())
        return SimpleNamespace(checkpointed=names, offload=None, engine=None, deepspeed=None,
                               remove=ds_env._configure_defaults)

    report = verify(chain, DS_OFFLOAD, apply=configure_only)
    found = verdicts(report)
    assert not found["cpu_checkpointing"].ok
    assert NOT_OFFLOADED.fullmatch(found["cpu_checkpointing"].message), found["cpu_checkpointing"].message
    assert not found["peak"].ok
    assert found["peak"].message.startswith("checkpointing is on but the peak was ")


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class ResidualStack(nn.Module):
    """`h = h + block(h)`; with `through_deepspeed` the block runs in
    deepspeed.checkpointing.checkpoint, which empties `h` before the addition reads it."""

    def __init__(self, n: int = 6, d: int = 512) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.through_deepspeed = False

    def forward(self, x):
        import deepspeed

        h = self.stem(x)
        for layer in self.layers:
            if self.through_deepspeed:
                h = h + deepspeed.checkpointing.checkpoint(layer, h)
            else:
                h = h + layer(h)
        return h


def residual_stack():
    torch.manual_seed(0)
    return ResidualStack().cuda(), torch.randn(16, 256, 512, device="cuda")


def test_a_residual_reusing_a_deepspeed_emptied_input_fails_the_gradient_promise(ds_env):
    # BACKENDS.md 1.4: after checkpoint() returns, DeepSpeed's cpu path has replaced the input's
    # data with torch.empty([]); `h + ...` broadcasts that garbage scalar without an error.
    from actcfg.translators import to_deepspeed

    def route_by_hand(model, policy, *, backend=None, mpu=None):
        ds_env.configure(None, **to_deepspeed(policy)["configure_kwargs"])
        model.through_deepspeed = True

        def remove():
            model.through_deepspeed = False
            ds_env._configure_defaults()

        names = tuple(f"layers.{i}" for i in range(len(model.layers)))
        return SimpleNamespace(checkpointed=names, offload=None, engine=None, deepspeed=None,
                               remove=remove)

    policy = {**DS_OFFLOAD, "checkpoint": {"mode": "full", "modules": ["Layer"]}}
    report = verify(residual_stack, policy, apply=route_by_hand)
    grads = verdicts(report)["gradients"]
    assert not grads.ok
    assert grads.message.startswith("gradients differ from the plain run: "), grads.message


def test_a_compiled_policy_is_timed_after_its_warm_up_and_its_recompute_proven_by_memory():
    """`compile:` in a rules policy (as `actcfg plan --compile` writes it): verify applies it
    compiled, warms it up until its step time settles, times the steps after, and says how long
    compiling took. The recompute runs inside the compiled backward, where actcfg's counter
    cannot see it (0 on the H200): the memory held after the blocks proves it instead."""
    policy = {"version": 1,
              "checkpoint": {"mode": "rules", "rules": [{"modules": ["Block"], "mode": "full",
                                                         "cpu_checkpointing": True}]},
              "compile": {"scope": "blocks", "backend": "aot_eager"}}
    report = verify(block_stack, policy)
    m = report.measurements
    assert report.ok, render_text(report)
    assert m.compile_ms is not None and m.compile_ms > 0
    assert "after compiling:" in render_text(report)
    recompute = verdicts(report)["recompute"]
    assert recompute.ok and "the checkpointed blocks kept no activations" in recompute.message
    assert m.policy.held[-1] * 2 <= m.plain.held[-1]
