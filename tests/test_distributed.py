"""DeepSpeed `partition` across a real model-parallel group of two GPUs (NCCL, one process each).

`partition: true` is refused on one rank (it shards nothing there, and on one H200 DeepSpeed's
partition path gave wrong gradients: BACKENDS.md section 7). This is the case it exists for:
with a model-parallel group of size 2, each rank should hold half of every checkpointed input,
and the gradients must equal the plain run's. Marked `cuda` and `distributed`; skipped where
fewer than two GPUs or no DeepSpeed are present.
"""

from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORLD = 2
N_LAYERS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held_per_layer(model, x, layers) -> float:
    """Median growth of allocated GPU memory per layer over the second half, in bytes."""
    held: list[int] = []
    hooks = [m.register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated())) for m in layers]
    out = model(x.clone().requires_grad_(True))
    for h in hooks:
        h.remove()
    out.float().square().mean().backward()
    half = held[len(held) // 2:]
    return (half[-1] - half[0]) / (len(half) - 1)


def _worker(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    import deepspeed
    import torch.distributed as dist

    import actcfg
    from actcfg import probes
    from actcfg.runtime import mpu_from_group

    deepspeed.init_distributed(dist_backend="nccl")
    mpu = mpu_from_group(dist.new_group(list(range(WORLD))))
    torch.manual_seed(0)  # the same replica and input on both ranks, as tensor parallelism sees them
    plain, x = probes.linear_chain(n=N_LAYERS, width=2048, shape=(64, 512), dtype=torch.float32)
    one_input = x.numel() * x.element_size()

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(x.clone().requires_grad_(True)).float().square().mean().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    reference = grads(plain)
    result = {}
    for name, partition in (("checkpoint", False), ("partition", True)):
        model = copy.deepcopy(plain)
        policy = {"version": 1, "backend": "deepspeed", "partition": partition,
                  "checkpoint": {"mode": "full", "modules": ["Linear"]}}
        with actcfg.apply(model, policy, mpu=mpu if partition else None) as handle:
            got = grads(model)
            held = _held_per_layer(model, x, list(model))
            result[name] = {
                "grad_rel_err": max(((a - b).norm() / b.norm()).item() for a, b in zip(got, reference)),
                "held_per_layer_inputs": held / one_input,
                "deepspeed": {k: v for k, v in handle.deepspeed.items() if k != "kwargs"}
                if isinstance(handle.deepspeed, dict) else str(handle.deepspeed),
            }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


def test_partition_halves_held_checkpoint_memory_with_plain_gradients(tmp_path):
    pytest.importorskip("deepspeed")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path), _free_port()), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        ckpt, part = result["checkpoint"], result["partition"]
        assert ckpt["grad_rel_err"] <= 1e-5, result
        assert part["grad_rel_err"] <= 1e-5, f"partition changed the gradients on rank {rank}: {result}"
        # checkpointing alone holds one layer input per layer; partitioned, 1/WORLD of it
        assert abs(ckpt["held_per_layer_inputs"] - 1.0) < 0.05, result
        assert abs(part["held_per_layer_inputs"] - 1.0 / WORLD) < 0.05, result
