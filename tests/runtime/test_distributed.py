"""actcfg on two GPUs of one host: NCCL, one process per GPU, spawned by each test (as in
tests/runtime/test_multirank.py, which runs the same cases on two gloo ranks on the CPU).

Run on a machine with two GPUs (H200: DeepSpeed's op builder needs TORCH_CUDA_ARCH_LIST=9.0;
NCCL_NVLS_ENABLE=0 stays set):

    NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=. \
        python -m pytest -m distributed -q tests/runtime/test_distributed.py

Memory is `torch.cuda.memory_allocated()` after each block's forward, above the step's start,
and "per block" is its mean growth over the second half of the blocks (as `actcfg verify`
judges it). Marked `cuda` and `distributed`; skipped with fewer than two GPUs.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

try:
    from tests._multirank import WORLD, finish, init_group, run_ranks, write_result
    from tests._timeouts import scaled
    from tests._helpers import grads_of, max_rel_error
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _multirank import WORLD, finish, init_group, run_ranks, write_result
    from _timeouts import scaled
    from _helpers import grads_of, max_rel_error

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

ROOT = Path(__file__).resolve().parents[2]
# NVLink multicast (NVLS) stays off on the lent machines; DeepSpeed's op builder cannot parse
# the "9.0a" torch reports for an H200 (BACKENDS.md 8).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_CUDA_ARCH_LIST": "9.0"}
TIMEOUT = 300.0
FLAT = 0.05  # "flat": grows by less than 5% of one block input per block (judge.FLAT_FRACTION)


def _init(rank: int, port: int, deepspeed: bool = False) -> None:
    for key, value in GPU_ENV.items():
        os.environ.setdefault(key, value)
    init_group(rank, port, backend="nccl", deepspeed=deepspeed)


def held_per_block(model: nn.Module, layers: list[nn.Module], x: torch.Tensor) -> tuple[float, Any]:
    """Growth of allocated GPU memory per block over the second half, in bytes, from a forward
    of `model` on `x`; and the output (for backward)."""
    from actcfg.verification.report import growth_per_block

    held: list[int] = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def hook(*_: Any) -> None:
        if len(held) < len(layers):  # the first call, in forward: a recompute calls it again
            held.append(torch.cuda.memory_allocated() - base)

    hooks = [m.register_forward_hook(hook) for m in layers]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    return growth_per_block(held)[0], out


# --- DeepSpeed partition across the two GPUs --------------------------------------------------

N_LAYERS = 8
PARTITION_CASES = {  # name -> (policy fields, with the model-parallel group)
    "checkpoint": ({}, False),
    "partition": ({"partition": True}, True),
    "partition+cpu_checkpointing": ({"partition": True, "cpu_checkpointing": True}, True),
    "partition+contiguous": ({"partition": True, "contiguous": True}, True),
}


def _partition_worker(rank: int, out_dir: str, port: int) -> None:
    import torch.distributed as dist

    import actcfg
    from actcfg.probes import linear_chain

    _init(rank, port, deepspeed=True)
    torch.manual_seed(0)  # the same replica and input on both ranks, as tensor-parallel ranks
    plain, x = linear_chain(n=N_LAYERS, width=2048, shape=(64, 512), dtype=torch.float32)
    one_input = x.numel() * x.element_size()

    def step(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        held, out = held_per_block(model, list(model), x.clone().requires_grad_(True))
        out.float().square().mean().backward()
        return held, grads_of(model, as_float=True)

    plain_held, want = step(plain)  # the one-GPU run
    result: dict[str, Any] = {"plain": plain_held / one_input}
    for name, (fields, grouped) in PARTITION_CASES.items():
        model = copy.deepcopy(plain)
        policy = {"version": 1, "backend": "deepspeed",
                  "checkpoint": {"mode": "full", "modules": ["Linear"]}, **fields}
        with actcfg.apply(model, policy, mpu=dist.group.WORLD if grouped else None) as handle:
            for _ in range(2):
                held, got = step(model)
            result[name] = {"held": held / one_input, "grad_error": max_rel_error(got, want),
                            "mp_size": handle.deepspeed.mp_size,
                            "recomputes": handle.counters.recomputes}
    write_result(out_dir, rank, result)
    finish()


@pytest.mark.deepspeed
def test_partition_on_two_gpus_holds_half_of_each_checkpoint_with_the_one_gpu_gradients(tmp_path):
    pytest.importorskip("deepspeed")
    for rank, result in enumerate(run_ranks(_partition_worker, tmp_path, timeout=TIMEOUT)):
        assert result["plain"] > 1.0 - FLAT, result  # plain, each Linear keeps its input
        ckpt = result["checkpoint"]
        assert abs(ckpt["held"] - 1.0) < FLAT, (rank, result)  # DeepSpeed keeps each input whole
        for name in PARTITION_CASES:
            r = result[name]
            assert r["grad_error"] <= 1e-5, (rank, name, result)
            assert r["recomputes"] == 2 * N_LAYERS, (rank, name, result)
            assert r["mp_size"] == (1 if name == "checkpoint" else WORLD)
        # Per rank, about half of the unpartitioned run's checkpoint memory per block.
        assert abs(result["partition"]["held"] - ckpt["held"] / WORLD) < FLAT, (rank, result)
        # With cpu_checkpointing, the halves go to the host: memory held per block is flat.
        assert abs(result["partition+cpu_checkpointing"]["held"]) < FLAT, (rank, result)
        # Contiguous buffers are allocated for all checkpoints at the first call: at most half.
        assert result["partition+contiguous"]["held"] <= 0.5 + FLAT, (rank, result)


# --- FSDP2 with actcfg's offload engine --------------------------------------------------------

N_BLOCKS = 8
FULL = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
FSDP_CASES = {"checkpoint": FULL,
              "checkpoint+cpu_checkpointing": {**FULL, "cpu_checkpointing": True}}


def _stack() -> tuple[nn.Module, torch.Tensor]:
    from actcfg.probes import blocks

    torch.manual_seed(0)
    return blocks(n=N_BLOCKS, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024,
                  dtype=torch.float32)


def _fsdp_worker(rank: int, out_dir: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import actcfg

    _init(rank, port)
    mesh = init_device_mesh("cuda", (WORLD,))
    reference, x = _stack()
    reference.zero_grad(set_to_none=True)
    reference(x).square().mean().backward()
    want = grads_of(reference, as_float=True)  # one unsharded GPU, the whole global batch
    del reference
    local = x.chunk(WORLD)[rank].contiguous()
    one_input = local.numel() * local.element_size()
    result = {}
    for order in ("apply-then-shard", "shard-then-apply"):
        for name, cfg in FSDP_CASES.items():
            model, _ = _stack()

            def shard() -> None:
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)

            if order == "apply-then-shard":
                handle = actcfg.apply(model, cfg)
                shard()
            else:
                shard()
                handle = actcfg.apply(model, cfg)
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                held, out = held_per_block(model, list(model.blocks), local)
                out.square().mean().backward()
                del out
            stats = handle.engine.stats if handle.engine is not None else None
            result[f"{order}/{name}"] = {
                "held": held / one_input, "grad_error": max_rel_error(grads_of(model, as_float=True), want),
                "recomputes": handle.counters.recomputes,
                "offloaded": None if stats is None else stats.offloaded_bytes}
            handle.remove()
            del model
            torch.cuda.empty_cache()
    write_result(out_dir, rank, result)
    finish()


def test_fsdp2_with_offload_on_two_gpus_gives_the_one_gpu_gradients_and_flat_memory(tmp_path):
    for rank, result in enumerate(run_ranks(_fsdp_worker, tmp_path, timeout=TIMEOUT)):
        for order in ("apply-then-shard", "shard-then-apply"):
            ckpt = result[f"{order}/checkpoint"]
            offload = result[f"{order}/checkpoint+cpu_checkpointing"]
            for r in (ckpt, offload):
                # Half batches on two ranks, averaged by FSDP2, against the whole batch on one
                # GPU: other kernel choices, so equal up to float32 rounding.
                assert r["grad_error"] <= 1e-4, (rank, order, result)
                assert r["recomputes"] == 3 * N_BLOCKS
            assert ckpt["held"] > 0.9, (rank, order, result)  # each block keeps its input...
            assert offload["offloaded"] > 0
            assert abs(offload["held"]) < FLAT, (rank, order, result)  # ...offloaded: flat


# --- DeepSpeed ZeRO-3 with a policy ----------------------------------------------------------


def _zero3_worker(rank: int, out_dir: str, port: int) -> None:
    _init(rank, port, deepspeed=True)  # first: it sets TORCH_CUDA_ARCH_LIST for DeepSpeed
    import deepspeed
    import torch.nn.functional as F

    import actcfg
    from actcfg.probes import blocks

    linear = F.linear
    result = {}
    for name, backend in (("plain", None), ("torch", "torch"), ("deepspeed", "deepspeed")):
        F.linear = linear  # ZeRO-3 replaces it process-wide and never puts it back
        torch.manual_seed(0)
        model, x = blocks(n=4, d_model=512, heads=8, ffn=2048, batch=4, seq=512,
                          dtype=torch.float32)
        local = x.chunk(WORLD)[rank].contiguous()
        handle = actcfg.apply(model, FULL, backend=backend) if backend else None
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            config={"train_micro_batch_size_per_gpu": local.shape[0],
                    "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}})
        losses = []
        for _ in range(3):
            loss = engine(local).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        result[name] = {"losses": losses, "stage": engine.zero_optimization_stage(),
                        "recomputes": None if handle is None else handle.counters.recomputes}
        if handle is not None:
            handle.remove()
        del engine, model
    F.linear = linear
    write_result(out_dir, rank, result)
    finish()


@pytest.mark.deepspeed
def test_zero3_on_two_gpus_trains_to_the_same_losses_under_a_policy(tmp_path):
    pytest.importorskip("deepspeed")
    for rank, result in enumerate(run_ranks(_zero3_worker, tmp_path, timeout=TIMEOUT)):
        assert result["plain"]["stage"] == 3
        for backend in ("torch", "deepspeed"):
            got, want = result[backend]["losses"], result["plain"]["losses"]
            assert got == pytest.approx(want, rel=1e-5), (rank, backend, result)
            assert result[backend]["recomputes"] == 3 * 4


# --- actcfg verify under torchrun ------------------------------------------------------------


def torchrun_verify(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GPU_ENV, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
         "-m", "actcfg", "verify", *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=scaled(TIMEOUT))


@pytest.mark.deepspeed
def test_verify_of_the_partition_config_under_torchrun_passes_on_every_rank():
    pytest.importorskip("deepspeed")
    done = torchrun_verify("configs/deepspeed-partition-model-parallel.yaml",
                           "--model", "actcfg.probes:blocks")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("actcfg verify: backend deepspeed, 2 ranks, 8 blocks, bfloat16, 3 steps, "
                        "model-parallel size 2"), done.stdout
    assert [line.split()[0] for line in lines[3:5]] == ["0", "1"]  # one row per rank, printed once
    assert done.stdout.count("actcfg verify:") == 1
    assert "PASS  partition  on all 2 ranks; " in done.stdout


def test_verify_of_a_torch_policy_under_torchrun_passes_on_every_rank():
    done = torchrun_verify("configs/seed-linear-offload.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("actcfg verify: backend torch, 2 ranks, 10 blocks, float16")
    assert "PASS  cpu_checkpointing  on all 2 ranks; " in done.stdout
