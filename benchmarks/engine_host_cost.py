"""The offload engine's host cost per training step, on the CPU (`host_loopback`).

    PYTHONPATH=. python benchmarks/engine_host_cost.py [--steps 20] [--profile]

On the H200 a Llama stack's forward is launch-bound (the GPU's queue is empty through most of
it), so every millisecond of Python the engine adds is step time, and what it does irregularly
(a garbage collection its objects trigger, its pool thread taking the GIL) is step-time jitter.
The engine makes the same decisions on the CPU, so this measures its host side there: a tiny
Llama (8 LlamaDecoderLayer) checkpointed per layer, with and without cpu_checkpointing, and per
steady-state step (after the warm-up steps): garbage collections per generation (`gc.callbacks`),
GC-tracked objects left alive by a step's forward (`gc.get_count` with collection off), calls of
the host pool's background work, `module.parameters()` walks, Python calls per layer in the
forward and in the backward (frames entered, `sys.setprofile`; the checkpoint-only row is the
baseline the engine's calls add to), and (--profile) the time spent in actcfg's own functions
under cProfile. Not a timing benchmark: CPU compute dwarfs the engine
here; the counts are what carry over to the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

import actcfg
from actcfg.runtime import offload_pool
from actcfg.runtime.offload import host_loopback

CHECKPOINT = {"version": 1, "checkpoint": {"mode": "full", "modules": ["LlamaDecoderLayer"]}}
OFFLOAD = {**CHECKPOINT, "cpu_checkpointing": True}


def llama(hidden: int, layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


class Counts:
    """Per-step counters: GC runs per generation, pool-thread jobs, parameter walks."""

    def __init__(self) -> None:
        self.collections: Counter[int] = Counter()
        self.pool_jobs = 0
        self.parameter_walks = 0
        gc.callbacks.append(self._gc)
        prepare = offload_pool.HostPool._prepare

        def counted_prepare(pool: Any, *args: Any) -> None:
            self.pool_jobs += 1
            prepare(pool, *args)

        offload_pool.HostPool._prepare = counted_prepare  # type: ignore[method-assign]
        parameters = nn.Module.parameters

        def counted_parameters(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            self.parameter_walks += 1
            return parameters(module, *args, **kwargs)

        nn.Module.parameters = counted_parameters  # type: ignore[method-assign]

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.collections[info["generation"]] += 1

    def reset(self) -> None:
        self.collections.clear()
        self.pool_jobs = self.parameter_walks = 0


def run(policy: dict[str, Any], args: argparse.Namespace, counts: Counts) -> dict[str, Any]:
    model = llama(args.hidden, args.layers)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    handle = actcfg.apply(model, policy)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(args.warmup):
        step()
    gc.collect()
    counts.reset()
    times, forward_objects = [], []
    collections: Counter[int] = Counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    collections.update(counts.collections)
    walks, jobs = counts.parameter_walks, counts.pool_jobs
    # Objects a forward leaves alive until its backward (what pushes gen0 towards its threshold):
    # collection off, so the count is allocations minus deallocations of tracked objects.
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        gc.collect()
        gc.disable()
        before = gc.get_count()[0]
        loss = model(input_ids=ids, labels=ids).loss
        forward_objects.append(gc.get_count()[0] - before)
        gc.enable()
        loss.backward()
        del loss
    calls = python_calls_per_layer(model, ids, args.layers)
    own = None
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        profile.disable()
        own = actcfg_time(profile, args.steps)
    engine = handle.engine
    result = {
        "step_ms": 1e3 * statistics.median(times),
        "gc_per_step": {g: collections[g] / args.steps for g in range(3)},
        "forward_objects": statistics.median(forward_objects),
        "pool_jobs_per_step": jobs / args.steps,
        "parameter_walks_per_step": walks / args.steps,
        "python_calls_per_layer": calls,
        "offloaded_bytes": None if engine is None else engine.stats.offloaded_bytes,
        "actcfg_ms_per_step": own,
    }
    handle.remove()
    return result


def python_calls_per_layer(model: nn.Module, ids: torch.Tensor, layers: int) -> dict[str, float]:
    """Python frames entered per layer in one step's forward and in its backward (autograd's
    thread included): on a launch-bound GPU forward each is host time, where the GPU waits."""
    import threading

    counts = {"forward": 0, "backward": 0}
    phase = "forward"

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[phase] += 1

    model.zero_grad(set_to_none=True)
    threading.setprofile(count)
    sys.setprofile(count)
    try:
        loss = model(input_ids=ids, labels=ids).loss
        phase = "backward"
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {k: v / layers for k, v in counts.items()}


def actcfg_time(profile: cProfile.Profile, steps: int) -> tuple[float, list[tuple[str, int, float]]]:
    """Own time in actcfg's functions per step, and the top ones (name, calls, ms per step)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [(f"{func[0].split('actcfg/')[-1]}:{func[2]}", calls[1] // steps, 1e3 * calls[2] / steps)
            for func, calls in stats.items() if "/actcfg/" in func[0]]
    rows.sort(key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=20)
    # 20 x 256 x 64 float32 = 1.25 MiB per block input: above MIN_OFFLOAD_BYTES, so it moves.
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = Counts()
    with host_loopback():
        for name, policy in [("checkpoint", CHECKPOINT), ("checkpoint+cpu_checkpointing", OFFLOAD)]:
            result = run(policy, args, counts)
            own = result.pop("actcfg_ms_per_step")
            print(name)
            for key, value in result.items():
                print(f"  {key}: {value}")
            if own is not None:
                print(f"  actcfg own time: {own[0]:.3f} ms/step")
                for func, calls, ms in own[1]:
                    print(f"    {ms:7.3f} ms  {calls:4d} calls  {func}")


if __name__ == "__main__":
    main()
