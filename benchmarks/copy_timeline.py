"""Where an offloaded step spends the time its copies do not: one profiled step, on one GPU.

    PYTHONPATH=. python benchmarks/copy_timeline.py --workload seed --out bench-out

offload_bench compares a step with its transfer bound: the bytes the engine moved each way over
the pinned bandwidth. This says what else lies on the step's critical path, read from a CUDA
profiler trace of one step (after warm-up):

* start: from the step's first GPU op to the first copy to the host (the forward that makes the
  first offloaded tensor);
* the copy chains each way: time busy, and the gaps inside them;
* turn: from the end of the last copy to the host to the start of the first copy back (the
  loss, and whatever holds the first reload back);
* tail: from the end of the last copy back to the step's last GPU op (the backward after it).

Beside it, the step's peak above its start in each phase (forward, loss, backward), in layer
inputs, and the same for torch's `save_on_cpu` in the same run: what hiding a gap would cost in
memory where the step peaks. Not run in CI: it needs a GPU (the trace reading is tested on the
CPU, tests/benchmarks/test_copy_timeline.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import actcfg
from actcfg import probes

# Copies shorter than this (microseconds) are not the engine's storages (a memset, a scalar).
MIN_COPY_US = 100.0

POLICIES = ("offload", "checkpoint+cpu")


def policy(name: str, block: str) -> dict:
    """The policy `name` applies: everything offloaded, or every `block` checkpointed with its
    input offloaded."""
    if name == "checkpoint+cpu":
        return {"cpu_checkpointing": True, "checkpoint": {"mode": "full", "modules": [block]}}
    return {"cpu_checkpointing": True}


def breakdown(events: list[dict]) -> dict[str, float | int | None]:
    """The step's GPU time split around its copies, in ms, from a chrome trace's events (torch
    profiler: `cat` kernel, gpu_memcpy or gpu_memset, `ts` and `dur` in microseconds)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        raise ValueError("the trace has no GPU events: was the step profiled with CUDA activity?")
    begin = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    copies = sorted((e for e in gpu if e["cat"] == "gpu_memcpy" and e["dur"] >= MIN_COPY_US), key=lambda e: e["ts"])
    # torch names them "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pageable -> Device)", ...
    out = [e for e in copies if "DtoH" in e["name"]]
    back = [e for e in copies if "HtoD" in e["name"]]

    def ends(e: dict) -> float:
        return e["ts"] + e["dur"]

    def gaps(chain: list[dict]) -> float:
        return sum(max(0.0, b["ts"] - ends(a)) for a, b in zip(chain, chain[1:])) / 1e3

    ms = lambda us: us / 1e3  # noqa: E731
    return {
        "step_ms": ms(end - begin),
        "copies_out": len(out),
        "copies_back": len(back),
        "start_ms": ms(out[0]["ts"] - begin) if out else None,
        "out_busy_ms": ms(sum(e["dur"] for e in out)),
        "out_gaps_ms": gaps(out),
        "turn_ms": ms(back[0]["ts"] - ends(out[-1])) if out and back else None,
        "back_busy_ms": ms(sum(e["dur"] for e in back)),
        "back_gaps_ms": gaps(back),
        "tail_ms": ms(end - ends(back[-1])) if back else None,
    }


def phase_peaks(model: torch.nn.Module, x: torch.Tensor, context: Callable, one: int) -> list[float]:
    """One step's peaks above its start in forward, loss and backward, in layer inputs (gradients
    freed at the step's start, as offload_bench and the planner count them)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks = []
    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    with context():
        out = model(x.view_as(x))
    peaks.append(torch.cuda.max_memory_allocated() - base)
    torch.cuda.reset_peak_memory_stats()
    loss = out.float().square().mean()
    del out
    peaks.append(torch.cuda.max_memory_allocated() - base)
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    peaks.append(torch.cuda.max_memory_allocated() - base)
    return [round(p / one, 2) for p in peaks]


def profile_step(model: torch.nn.Module, x: torch.Tensor, context: Callable, trace: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with context():
            out = model(x.view_as(x))
        out.float().square().mean().backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    result = breakdown(json.loads(trace.read_text())["traceEvents"])
    result["median_step_ms"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("seed", "blocks"), default="seed")
    ap.add_argument("--policy", choices=POLICIES, default="offload")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offload_bench import bandwidth

    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = bandwidth()
    torch.manual_seed(0)
    model, x = (probes.linear_chain if args.workload == "seed" else probes.blocks)()
    x.requires_grad_(True)  # the caller's batch, a leaf, as offload_bench passes it
    one = x.numel() * x.element_size()
    save_on_cpu = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    for _ in range(2):
        phase_peaks(model, x, save_on_cpu, one)
    peer = phase_peaks(model, x, save_on_cpu, one)
    chosen = policy(args.policy, "Linear" if args.workload == "seed" else "Block")
    handle = actcfg.apply(model, {"version": 1, "backend": "torch", **chosen})
    try:
        result = profile_step(model, x, contextlib.nullcontext, args.out / f"trace-{args.workload}.json")
        result["phase_peaks"] = phase_peaks(model, x, contextlib.nullcontext, one)
        stats = handle.engine.stats
        result["bound_ms"] = (stats.offloaded_bytes / bw["d2h_pinned"] + stats.reloaded_bytes / bw["h2d_pinned"]) / 1e6
    finally:
        handle.remove()
    result["save_on_cpu_phase_peaks"] = peer
    result.update(workload=args.workload, policy=args.policy, gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, bandwidth_gbps=bw)
    (args.out / "copy_timeline.json").write_text(json.dumps(result, indent=1))
    bound = result["bound_ms"]
    print(f"{args.workload}, {args.policy}: step {result['median_step_ms']:.1f} ms (median of 10; the profiled "
          f"step {result['step_ms']:.1f}), transfer bound {bound:.1f} ms, {result['median_step_ms'] / bound:.3f}x")
    for key in ("start_ms", "out_busy_ms", "out_gaps_ms", "turn_ms", "back_busy_ms", "back_gaps_ms", "tail_ms"):
        value = result[key]
        print(f"  {key[:-3]:10s} {'-' if value is None else f'{value:7.2f}'} ms")
    print(f"  peaks above the step's start (forward, loss, backward), layer inputs: actcfg {result['phase_peaks']}, "
          f"save_on_cpu {peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
