"""Where a variant's peak is: what is alive on the GPU at the highest mark of one training step.

    PYTHONPATH=. python benchmarks/offload_peak.py --variants "save_on_cpu,offload all" --grads kept

On the blocks stack (`actcfg.probes:blocks`), for each variant, runs two warm-up steps, then
records the caching allocator's history (`torch.cuda.memory._record_memory_history`) over one
step and replays it: the peak of allocated bytes above the step's start, whether it falls in
forward or backward, and the allocations alive there grouped by the line of Python that made
them (size in block inputs). Frees requested but not completed (blocks whose reuse waits for
another stream: `record_stream`) are counted apart: they are memory the allocator cannot hand
out yet. Not run in CI: it needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch

import actcfg
from actcfg import probes

GiB = 2**30


def _variants():
    ckpt = {"mode": "full", "modules": ["Block"]}
    torch_apply = lambda pol: (lambda m: actcfg.apply(m, {"version": 1, "backend": "torch", **pol}))  # noqa: E731
    soc = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    return {
        "torch save_on_cpu": (lambda m: None, soc),
        "actcfg torch checkpoint": (torch_apply({"checkpoint": ckpt}), contextlib.nullcontext),
        "actcfg torch offload all": (torch_apply({"cpu_checkpointing": True}), contextlib.nullcontext),
        "actcfg torch checkpoint + cpu": (torch_apply({"checkpoint": ckpt, "cpu_checkpointing": True}),
                                          contextlib.nullcontext),
    }


def _where(frames: list[dict]) -> str:
    """The innermost frame in actcfg or the model (not torch's own Python)."""
    for f in frames:
        name = f.get("filename", "")
        if "actcfg" in name or "offload_peak" in name:
            return f"{Path(name).name}:{f.get('line')}:{f.get('name')}"
    return "other"


def replay(trace: list[dict], base: int, turn_index: int, one: int) -> dict:
    """The peak of a recorded step, above its start, and what was alive there."""
    live: dict[int, tuple[int, str]] = {}
    pending: dict[int, int] = {}  # frees requested, not yet completed
    now = peak = 0
    peak_at, peak_live, peak_pending = 0, {}, 0
    for i, e in enumerate(trace):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            live[addr] = (size, _where(e.get("frames", [])))
            now += size
            if now > peak:
                peak, peak_at, peak_live, peak_pending = now, i, dict(live), sum(pending.values())
        elif action == "free_requested":
            if addr in live:
                pending[addr] = live[addr][0]
        elif action == "free_completed":
            # made before the recording began (the step before's tensors, freed gradients): it
            # leaves what was allocated at the start
            now -= live.pop(addr)[0] if addr in live else size
            pending.pop(addr, None)
    by_site = Counter()
    for size, site in peak_live.values():
        by_site[site] += size
    return {
        "peak_above_start_gib": round(peak / GiB, 3),
        "peak_in": "forward" if peak_at < turn_index else "backward",
        "peak_event": peak_at, "events": len(trace),
        "pending_frees_at_peak_block_inputs": round(peak_pending / one, 2),
        "alive_by_site_block_inputs": {k: round(v / one, 2) for k, v in by_site.most_common(20)},
    }


def run(name: str, setup, context, grads: str) -> dict:
    torch.manual_seed(0)
    model, x = probes.blocks()
    x.requires_grad_(True)
    one = x.numel() * x.element_size()
    handle = setup(model)
    turn = [0]

    def step(record: bool) -> None:
        model.zero_grad(set_to_none=grads == "freed")
        with context():
            out = model(x.view_as(x))
        if record:
            turn[0] = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        out.float().square().mean().backward()

    try:
        step(False)
        step(False)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
        torch.cuda.reset_peak_memory_stats()
        step(True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        out = {"variant": name, "grads": grads, "max_allocated_above_start_gib": round(peak / GiB, 3)}
        out.update(replay(trace, base, turn[0], one))
        if hasattr(handle, "engine") and handle.engine is not None:
            st = handle.engine.stats
            out["engine_held_block_inputs"] = {"forward": round(st.most_forward_device_bytes / one, 2),
                                               "backward": round(st.most_backward_device_bytes / one, 2)}
    finally:
        if hasattr(handle, "remove"):
            handle.remove()
        del model, x
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="", help="comma-separated substrings of variant names")
    ap.add_argument("--grads", choices=("kept", "freed"), default="kept",
                    help="kept: zero_grad(set_to_none=False), gradients stay allocated between "
                         "steps; freed: set_to_none=True")
    ap.add_argument("--out", type=Path, default=None, help="write the readings as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_peak needs a CUDA GPU", file=sys.stderr)
        return 2
    wanted = [v for v in args.variants.split(",") if v]
    readings = []
    for name, (setup, context) in _variants().items():
        if wanted and not any(w in name for w in wanted):
            continue
        r = run(name, setup, context, args.grads)
        readings.append(r)
        print(json.dumps(r, indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(readings, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
