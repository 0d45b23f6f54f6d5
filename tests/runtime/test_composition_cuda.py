"""Offload inside the stacks people train with, on the GPU: FSDP2, torch.compile (inductor) and a
Hugging Face Llama. Each case: bytes really offloaded, GPU memory held per block flat over the
second half of the stack, and gradients equal to the same stack without the policy.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/runtime/test_composition_cuda.py
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
from torch import nn

import actcfg
from actcfg.probes import blocks
from _helpers import FLAT_GROWTH, assert_grads_within, growth_per_block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

FULL_OFFLOAD = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True}
OFFLOAD_ALL = {"version": 1, "cpu_checkpointing": True}


def stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return blocks(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024, dtype=torch.bfloat16)


def held_per_block(modules: list[nn.Module]) -> tuple[list[int], list]:
    """memory_allocated after each module's first forward call; the hooks to remove."""
    held: list[int] = []
    hooks = [m.register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated()) if
                                     len(held) < len(modules) else None) for m in modules]
    return held, hooks


def step(model: nn.Module, x: torch.Tensor, run: nn.Module | None = None,
         watch: list[nn.Module] | None = None) -> tuple[dict[str, torch.Tensor], list[int]]:
    model.zero_grad(set_to_none=True)
    held, hooks = held_per_block(watch or [])
    try:
        out = (model if run is None else run)(x)
    finally:
        for h in hooks:
            h.remove()
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).float()
    return grads, held


def assert_flat(held: list[int], one_input: int) -> None:
    """Held memory stops growing from block to block (see `growth_per_block`)."""
    growth = growth_per_block(held)
    assert growth < FLAT_GROWTH * one_input, f"memory grew {growth / 2**20:.1f} MiB per block: {held}"


@pytest.fixture(scope="module")
def nccl_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        started = True
    yield init_device_mesh("cuda", (1,))
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize("order", ["apply-then-shard", "shard-then-apply"])
@pytest.mark.parametrize("cfg", [FULL_OFFLOAD, OFFLOAD_ALL], ids=["full+offload", "offload"])
def test_fsdp2_offload_is_flat_and_exact(nccl_mesh, order, cfg):
    from torch.distributed.fsdp import fully_shard

    def shard(m):
        for b in m.blocks:
            fully_shard(b, mesh=nccl_mesh)
        fully_shard(m, mesh=nccl_mesh)

    reference, x = stack()
    shard(reference)
    want, _ = step(reference, x)
    model, _ = stack()
    if order == "apply-then-shard":
        handle = actcfg.apply(model, cfg)
        shard(model)
    else:
        shard(model)
        handle = actcfg.apply(model, cfg)
    for _ in range(2):
        got, held = step(model, x, watch=list(model.blocks))
    assert_grads_within(got, want, 2e-2, check_keys=False)  # bf16 attention backward
    assert handle.engine.stats.offloaded_bytes > 0
    assert_flat(held, x.numel() * x.element_size())
    handle.remove()


@pytest.mark.parametrize("order", ["apply-then-compile-model", "compile-blocks-then-apply"])
@pytest.mark.parametrize("cfg", [FULL_OFFLOAD, OFFLOAD_ALL], ids=["full+offload", "offload"])
def test_compiled_offload_is_flat_and_exact(order, cfg):
    torch._dynamo.reset()
    plain, x = stack()
    want, _ = step(plain, x)
    model, _ = stack()
    run = None
    if order == "apply-then-compile-model":
        handle = actcfg.apply(model, cfg)
        run = torch.compile(model)
    else:
        for b in model.blocks:
            b.compile()
        handle = actcfg.apply(model, cfg)
    for _ in range(3):
        got, held = step(model, x, run, watch=list(model.blocks))
    assert_grads_within(got, want, 2e-2, check_keys=False)  # bf16 attention backward
    assert handle.engine.stats.offloaded_bytes > 0
    assert_flat(held, x.numel() * x.element_size())
    handle.remove()
    torch._dynamo.reset()


def test_hf_llama_offload_is_flat_and_exact():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 1024, (4, 1024), device="cuda")

    def lm_step(m, watch=None):
        m.zero_grad(set_to_none=True)
        held, hooks = held_per_block(watch or [])
        loss = m(input_ids=ids, labels=ids).loss
        for h in hooks:
            h.remove()
        loss.backward()
        return {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}, held

    want, _ = lm_step(plain)
    handle = actcfg.apply(model, {"version": 1, "cpu_checkpointing": True,
                                  "checkpoint": {"mode": "full", "modules": ["LlamaDecoderLayer"]}})
    assert model.config.use_cache is False
    for _ in range(2):
        got, held = lm_step(model, list(model.model.layers))
    assert_grads_within(got, want, 2e-2, check_keys=False)  # bf16 attention backward
    assert handle.engine.stats.offloaded_bytes > 0
    assert_flat(held, 4 * 1024 * 1024 * 2)
    handle.remove()
