"""Offload and checkpointing on one GPU: actcfg against torch, DeepSpeed and torchtune, in one run.

    PYTHONPATH=. python benchmarks/offload_bench.py --out bench-out

For each workload (the seed chain of 10 Linear(2000, 2000), fp16; 8 transformer blocks, bf16) it
measures the copy bandwidth each way, then for every variant: median step time and spread, peak
memory, memory held after each block, bytes moved each way, the transfer bound those bytes imply,
and the proof that the variant did what it claims (gradients equal to the plain run within the
dtype's tolerance; memory held per block flat for offload variants; peak below plain for
checkpoint variants). A variant whose proof fails is reported as "effect missing", never as a
speed. Writes bench.json, bench.md and bench.png to --out. Not run in CI: it needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import actcfg
from actcfg import probes

GiB = 2**30
# Relative gradient tolerance per dtype: recomputation and offload are exact, but cuBLAS and
# flash-attention backward may pick other (non-deterministic) reductions between runs.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@dataclass
class Result:
    workload: str
    variant: str
    claims: list[str]
    step_ms: float = 0.0
    step_ms_min: float = 0.0
    step_ms_max: float = 0.0
    peak_gib: float = 0.0
    held_gib: list[float] = field(default_factory=list)
    growth_per_block: float = 0.0  # in block inputs, over the second half of the stack
    bytes_out: int = 0
    bytes_in: int = 0
    bound_ms: float = 0.0
    grad_rel_err: float = 0.0
    pinned_bytes: int = 0
    pinned_allocations_after_first_step: int = 0
    engine_held_forward: float = 0.0  # the engine's own high-water marks, in block inputs
    engine_held_backward: float = 0.0
    timeline: dict = field(default_factory=dict)  # --timeline: per-block peaks, in block inputs
    block_input_bytes: int = 0
    block_saved_bytes: int = 0  # what autograd saves per block (parameters excluded)
    blocks: int = 0
    proof: str = "ok"
    skipped: str = ""


def bandwidth(n: int = 1 << 30) -> dict[str, float]:
    """GB/s of one large copy each way, pinned and pageable (median of 5)."""
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    out = {}
    for name, dst, src in [
        ("d2h_pinned", pinned, gpu), ("h2d_pinned", gpu, pinned),
        ("d2h_pageable", pageable, gpu), ("h2d_pageable", gpu, pageable),
    ]:
        times = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = n / (statistics.median(times[1:]) / 1e3) / 1e9
    return out


class SavedBytes:
    """Counts the bytes autograd saves on the GPU (what save_on_cpu and torchtune move)."""

    def __init__(self, skip: nn.Module | None = None, min_bytes: int = 0) -> None:
        self.total = 0
        self._skip = {p.untyped_storage().data_ptr() for p in skip.parameters()} if skip else set()
        self._min = min_bytes

    def __enter__(self):
        def pack(t):
            n = t.numel() * t.element_size()
            if t.is_cuda and n >= self._min and t.untyped_storage().data_ptr() not in self._skip:
                self.total += n
            return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def block_modules(model: nn.Module) -> list[nn.Module]:
    return list(model) if isinstance(model, nn.Sequential) else list(model.blocks)


def ds_route(model: nn.Module) -> None:
    """Route each block through deepspeed.checkpointing.checkpoint (what DeepSpeed users write)."""
    import deepspeed

    for block in block_modules(model):
        inner = type(block).forward.__get__(block)
        block.forward = functools.partial(deepspeed.checkpointing.checkpoint, inner)


def init_deepspeed() -> str | None:
    """A one-rank NCCL group for DeepSpeed's checkpointing (its version), or None where
    DeepSpeed does not import."""
    try:
        import deepspeed
    except ImportError:
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="nccl")
    return deepspeed.__version__


def ds_configure(cpu: bool) -> None:
    import deepspeed

    deepspeed.checkpointing.configure(
        None, partition_activations=False, contiguous_checkpointing=False, num_checkpoints=None,
        checkpoint_in_cpu=cpu, synchronize=False, profile=False,
    )


def torch_checkpoint(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    blocks = set(block_modules(model))
    apply_activation_checkpointing(model, check_fn=lambda m: m in blocks)


def timeline(model: nn.Module, x: torch.Tensor, blocks: list[nn.Module], context: Callable,
             one_input: int, grads: str = "freed") -> dict:
    """One more step under the planner's probe: the peak of each block's forward and backward,
    the turn and the step, above the step's start, in block inputs (where the memory goes)."""
    from actcfg.plan.probe import Meter as _Meter, Probe as _Probe

    probe = _Probe(blocks, _Meter(x.device))
    if grads == "kept":
        # the probe frees gradients at the step's start (set_to_none=True); here they stay
        # allocated, as in every measured step of this run
        model.zero_grad = lambda set_to_none=True: nn.Module.zero_grad(model, set_to_none=False)
    try:
        with context(model):
            st = probe.step(model, (x.view_as(x),), {}, lambda out: out.float().square().mean())
    finally:
        probe.remove()
        model.__dict__.pop("zero_grad", None)
    r = lambda v: round(v / one_input, 2)  # noqa: E731
    return {"forward": [r(v) for v in st.forward_peak], "backward": [r(v) for v in st.backward_peak],
            "turn": r(st.turn_peak), "outside": r(st.outside_peak), "step": r(st.peak)}


def measure(workload: str, variant: str, claims: list[str], factory: Callable, setup: Callable,
            context: Callable, reference: dict | None, bw: dict, steps: int, engine_of=None,
            with_timeline: bool = False, grads: str = "freed") -> Result:
    res = Result(workload, variant, claims)
    torch.manual_seed(0)
    model, x = factory()
    x.requires_grad_(True)
    blocks = block_modules(model)
    one_input = x.numel() * x.element_size()
    recording = [False]
    held: list[int] = []
    probes_ = [b.register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated()) if recording[0] else None)
               for b in blocks]
    handle = setup(model)
    try:
        def step():
            model.zero_grad(set_to_none=grads == "freed")
            held.clear()
            recording[0] = True
            with context(model):
                # a fresh view each step: DeepSpeed's cpu/partition paths empty the tensor
                # passed to checkpoint(), which must not be the leaf input reused next step
                out = model(x.view_as(x))
            recording[0] = False
            out.float().square().mean().backward()

        step()  # first step: pinned pools fill here
        engine = engine_of(handle) if engine_of else None
        first_allocs = engine.stats.pinned_allocations if engine else 0
        step()
        times = []
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        res.step_ms, res.step_ms_min, res.step_ms_max = statistics.median(times), min(times), max(times)
        res.peak_gib = (torch.cuda.max_memory_allocated() - base) / GiB
        res.held_gib = [(h - base) / GiB for h in held]
        # over the second half of the stack, less its last block: an offload runtime keeps the
        # last block's activations for backward, which needs them first (actcfg's keep_last),
        # so memory after it is higher by design, not by growth
        half = held[len(held) // 2:-1]
        res.growth_per_block = (half[-1] - half[0]) / max(1, len(half) - 1) / one_input
        # checkpoint_wrapper renames parameters (pytorch#117399): compare by the plain names
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().float().clone()
                 for n, p in model.named_parameters()}
        if engine is not None:
            res.bytes_out, res.bytes_in = engine.stats.offloaded_bytes, engine.stats.reloaded_bytes
            res.pinned_bytes = engine.stats.pinned_bytes
            res.pinned_allocations_after_first_step = engine.stats.pinned_allocations - first_allocs
            res.engine_held_forward = engine.stats.most_forward_device_bytes / one_input
            res.engine_held_backward = engine.stats.most_backward_device_bytes / one_input
        if with_timeline:
            res.timeline = timeline(model, x, blocks, context, one_input, grads)
    finally:
        for p in probes_:
            p.remove()
        if hasattr(handle, "remove"):
            handle.remove()
    if reference is not None:
        errs = [((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in reference["grads"].items()]
        res.grad_rel_err = max(errs)
    res.bound_ms = (res.bytes_out / bw["d2h_pinned"] + res.bytes_in / bw["h2d_pinned"]) / 1e6
    failed = []
    if reference is not None and res.grad_rel_err > TOL[x.dtype]:
        failed.append(f"gradients differ from plain (max rel. error {res.grad_rel_err:.2e})")
    if "offload" in claims and res.growth_per_block >= 0.05:
        failed.append(f"memory held grew {res.growth_per_block:.2f} block inputs per block: offload missing")
    if "checkpoint" in claims and reference is not None and res.peak_gib >= reference["peak"]:
        failed.append(f"peak {res.peak_gib:.2f} GiB not below plain {reference['peak']:.2f} GiB")
    res.proof = "; ".join(failed) or "ok"
    del model, x
    torch.cuda.empty_cache()
    if reference is None:
        return res, {"grads": grads, "peak": res.peak_gib}
    return res, None


def variants(workload: str, have_ds: bool, have_tt: bool, half_budget: int):
    """(name, claims, setup(model) -> handle, context(model), engine_of, bytes_moved_by)"""
    none = contextlib.nullcontext
    ctx0 = lambda m: none()  # noqa: E731
    soc = lambda m: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    block_cls = "Linear" if workload == "seed" else "Block"
    ckpt = {"mode": "full", "modules": [block_cls]}
    apply = lambda pol: (lambda m: actcfg.apply(m, {"version": 1, **pol}))  # noqa: E731
    eng = lambda h: h.engine  # noqa: E731
    yield "plain", [], lambda m: None, ctx0, None
    yield "torch checkpoint", ["checkpoint"], torch_checkpoint, ctx0, None
    yield "torch save_on_cpu", ["offload"], lambda m: None, soc, None
    yield "torch checkpoint + save_on_cpu", ["checkpoint", "offload"], torch_checkpoint, soc, None
    if have_ds:
        yield "deepspeed checkpoint", ["checkpoint"], lambda m: (ds_configure(False), ds_route(m)), ctx0, None
        yield "deepspeed checkpoint + cpu", ["checkpoint", "offload"], lambda m: (ds_configure(True), ds_route(m)), ctx0, None
    if have_tt:
        # As torchtune's recipes run it: one OffloadActivations built at setup and entered every
        # step (recipes keep `self.activations_handling_ctx` and `with` it around each forward).
        # Building one per step re-creates its streams and stash each step and handicaps it.
        yield "torchtune offload", ["offload"], lambda m: None, _built_once(), None
        yield "torchtune checkpoint + offload", ["checkpoint", "offload"], torch_checkpoint, _built_once(), None
    yield "actcfg torch checkpoint", ["checkpoint"], apply({"backend": "torch", "checkpoint": ckpt}), ctx0, None
    yield "actcfg torch offload all", ["offload"], apply({"backend": "torch", "cpu_checkpointing": True}), ctx0, eng
    yield "actcfg torch checkpoint + cpu", ["checkpoint", "offload"], apply({"backend": "torch", "checkpoint": ckpt, "cpu_checkpointing": True}), ctx0, eng
    yield ("actcfg torch offload all, pin_budget half", ["offload"],
           apply({"backend": "torch", "cpu_checkpointing": True, "pin_budget": half_budget}), ctx0, eng)
    if have_ds:
        yield "actcfg deepspeed checkpoint", ["checkpoint"], apply({"backend": "deepspeed", "checkpoint": ckpt}), ctx0, None
        yield "actcfg deepspeed checkpoint + cpu", ["checkpoint", "offload"], apply({"backend": "deepspeed", "checkpoint": ckpt, "cpu_checkpointing": True}), ctx0, None


def _built_once() -> Callable:
    """A context(model) for one variant that builds torchtune's OffloadActivations on the first
    step and returns the same one on every later step (torchtune's recipes build it once)."""
    made: list = []

    def context(model: nn.Module):
        if not made:
            from torchtune.training import OffloadActivations

            made.append(OffloadActivations())
        return made[0]

    return context


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workloads", default="seed,blocks")
    ap.add_argument("--variants", default="",
                    help="comma-separated substrings: run only the variants whose name contains one")
    ap.add_argument("--grads", choices=("freed", "kept"), default="freed",
                    help="freed: zero_grad(set_to_none=True) at each step's start, so a peak above "
                         "the step's start nets the gradients backward allocates again against "
                         "the activations; kept: zero_grad(set_to_none=False), gradients stay "
                         "allocated between steps (as in gradient buckets of DDP, FSDP, DeepSpeed, "
                         "Megatron) and the peak above the step's start is activations alone")
    ap.add_argument("--timeline", action="store_true",
                    help="print each variant's per-block forward/backward peaks (in block inputs)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    ds_version = init_deepspeed()
    have_ds = ds_version is not None
    try:
        import torchtune  # noqa: F401

        have_tt = True
    except ImportError:
        have_tt = False
    bw = bandwidth()
    print("copy bandwidth GB/s:", {k: round(v, 1) for k, v in bw.items()}, flush=True)
    factories = {"seed": probes.linear_chain, "blocks": probes.blocks}
    results: list[Result] = []
    for workload in args.workloads.split(","):
        factory = factories[workload]
        reference = None
        # bytes autograd saves per step (parameters excluded): what a full offload moves
        torch.manual_seed(0)
        model, x = factory()
        x.requires_grad_(True)
        with SavedBytes(skip=model) as counter:
            model(x)
        full_bytes = counter.total
        n_blocks, one_input = len(block_modules(model)), x.numel() * x.element_size()
        with SavedBytes() as counter:  # save_on_cpu moves the saved weights too (pytorch#86097)
            model(x)
        soc_bytes = counter.total
        del model, x
        torch.cuda.empty_cache()
        for name, claims, setup, context, engine_of in variants(workload, have_ds, have_tt, full_bytes // 2):
            wanted = [v for v in args.variants.split(",") if v]
            if wanted and name != "plain" and not any(v in name for v in wanted):
                continue
            if workload == "seed":
                # a checkpointed Linear saves its input, exactly what plain autograd saves:
                # checkpointing the seed chain promises no lower peak, so none is claimed
                claims = [c for c in claims if c != "checkpoint"]
            try:
                res, ref = measure(workload, name, claims, factory, setup, context, reference, bw, args.steps,
                                   engine_of, args.timeline, args.grads)
            except Exception as e:  # a peer that breaks is reported, not fatal to the run
                res, ref = Result(workload, name, claims, proof="", skipped=f"{type(e).__name__}: {e}"[:300]), None
                torch.cuda.empty_cache()
            if ref is not None:
                reference = ref
            res.blocks, res.block_input_bytes, res.block_saved_bytes = n_blocks, one_input, full_bytes // n_blocks
            if engine_of is None and "offload" in claims and not res.skipped:
                # peers: save_on_cpu moves every saved tensor (parameters too: pytorch#86097);
                # checkpoint + offload peers move the block inputs, DeepSpeed all but the newest
                res.bytes_out = res.bytes_in = (
                    _block_inputs(factory, keep_newest="deepspeed" in name)
                    if "checkpoint" in name else soc_bytes
                )
                res.bound_ms = (res.bytes_out / bw["d2h_pinned"] + res.bytes_in / bw["h2d_pinned"]) / 1e6
            results.append(res)
            print(f"{workload:6s} {name:44s} {res.step_ms:8.1f} ms  peak {res.peak_gib:6.2f} GiB  "
                  f"growth {res.growth_per_block:5.2f}  bound {res.bound_ms:6.1f} ms  grad {res.grad_rel_err:.1e}  "
                  f"{res.skipped or res.proof}", flush=True)
            if res.engine_held_forward or res.engine_held_backward:
                print(f"       engine held at most {res.engine_held_forward:.2f} block inputs in forward, "
                      f"{res.engine_held_backward:.2f} in backward", flush=True)
            if res.timeline:
                print(f"       timeline (block inputs): {res.timeline}", flush=True)
        if have_ds:
            ds_configure(False)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": ds_version,
        "torchtune": have_tt,
        "python": platform.python_version(),
        "steps": args.steps,
        "grads": args.grads,
        "bandwidth_gbps": bw,
    }
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1))
    (args.out / "bench.md").write_text(render_markdown(meta, results))
    plot(results, args.out / "bench.png")
    print(render_targets(results, bw))
    return 0


def _block_inputs(factory, keep_newest: bool) -> int:
    """Bytes of the block inputs a checkpoint + offload peer moves each way (an estimate; DeepSpeed
    keeps the newest input on the GPU: `keep_last_count=1`)."""
    torch.manual_seed(0)
    model, x = factory()
    n = len(block_modules(model)) - (1 if keep_newest else 0)
    size = x.numel() * x.element_size()
    del model, x
    return n * size


def _find(results, workload, variant):
    return next((r for r in results if r.workload == workload and r.variant == variant and not r.skipped), None)


def pageable_share_bound_ms(r: Result, bw: dict[str, float]) -> float:
    """The transfer bound of a step whose bytes past the pinned pool go through pageable memory."""
    page_out, page_in = max(0, r.bytes_out - r.pinned_bytes), max(0, r.bytes_in - r.pinned_bytes)
    return ((r.bytes_out - page_out) / bw["d2h_pinned"] + page_out / bw["d2h_pageable"]
            + (r.bytes_in - page_in) / bw["h2d_pinned"] + page_in / bw["h2d_pageable"]) / 1e6


def render_targets(results: list[Result], bw: dict[str, float]) -> str:
    """The issue's targets as ratios of this run; a variant without proof is 'effect missing'."""
    lines = ["| target | measured | met |", "|---|---|---|"]

    def row(text, value, ok):
        lines.append(f"| {text} | {value} | {'–' if ok is None else 'yes' if ok else 'NO'} |")

    def proven(r):
        return r is not None and r.proof == "ok"

    full = _find(results, "seed", "actcfg torch offload all")
    soc = _find(results, "seed", "torch save_on_cpu")
    if proven(full) and full.bound_ms:
        row("seed, everything offloaded: step / transfer bound <= 1.05", f"{full.step_ms / full.bound_ms:.3f}", full.step_ms / full.bound_ms <= 1.05)
        if soc is not None:
            layer = 256 * 256 * 2000 * 2 / GiB
            extra = (full.peak_gib - soc.peak_gib) / layer
            row("seed, peak above save_on_cpu's <= 1 layer input", f"{extra:+.2f} layer inputs", extra <= 1.0)
    elif full is not None:
        row("seed, everything offloaded", f"effect missing: {full.proof or full.skipped}", False)
    ck = _find(results, "blocks", "actcfg torch checkpoint")
    ckcpu = _find(results, "blocks", "actcfg torch checkpoint + cpu")
    if proven(ck) and proven(ckcpu):
        ratio = ckcpu.step_ms / ck.step_ms
        row("blocks, checkpoint + cpu / checkpoint-only <= 1.01", f"{ratio:.3f}", ratio <= 1.01)
        half = ckcpu.held_gib[len(ckcpu.held_gib) // 2:-1]
        held = max(half) - min(half)
        one = ckcpu.block_input_bytes / GiB
        row("blocks, held per block flat within one block input", f"{held / one:.2f} block inputs", held <= one)
        below = (ck.peak_gib - ckcpu.peak_gib) / one
        row(f"blocks, checkpoint + cpu: peak <= checkpoint-only - (n - 2) block inputs ({ckcpu.blocks - 2})",
            f"{below:.2f} block inputs below", below >= ckcpu.blocks - 2)
    elif ckcpu is not None:
        row("blocks, checkpoint + cpu", f"effect missing: {ckcpu.proof or ckcpu.skipped}", False)
    bfull = _find(results, "blocks", "actcfg torch offload all")
    if proven(bfull) and bfull.bound_ms:
        r = bfull.step_ms / bfull.bound_ms
        row("blocks, everything offloaded: step / transfer bound <= 1.05", f"{r:.3f}", r <= 1.05)
        bsoc = _find(results, "blocks", "torch save_on_cpu")
        if bsoc is not None:
            extra = (bfull.peak_gib - bsoc.peak_gib) * GiB / bfull.block_saved_bytes
            row("blocks, everything offloaded: peak above save_on_cpu's <= one block's saved activations",
                f"{extra:+.2f} blocks' saved activations", extra <= 1.0)
    for workload in ("seed", "blocks"):
        half = _find(results, workload, "actcfg torch offload all, pin_budget half")
        if half is not None:
            row(f"{workload}, pin_budget half: pinned <= budget, no pinned allocation after step 1, gradients equal",
                f"pinned {half.pinned_bytes / GiB:.2f} GiB, {half.pinned_allocations_after_first_step} new, {half.proof}",
                half.proof == "ok" and half.pinned_allocations_after_first_step == 0)
            bound = pageable_share_bound_ms(half, bw)
            row(f"{workload}, pin_budget half: step / transfer bound with the pageable share (no limit set)",
                f"{half.step_ms:.1f} / {bound:.1f} ms = {half.step_ms / bound:.2f}", None)
    return "\n".join(lines)


def render_markdown(meta: dict, results: list[Result]) -> str:
    bw = meta["bandwidth_gbps"]
    out = [
        f"Measured {meta['date']} on {meta['gpu']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"DeepSpeed {meta['deepspeed'] or 'absent'}, torchtune {'present' if meta['torchtune'] else 'absent'}; "
        f"median of {meta['steps']} steps after 2 warm-up steps.",
        "",
        f"Copy bandwidth: pinned {bw['d2h_pinned']:.1f} GB/s out, {bw['h2d_pinned']:.1f} GB/s back; "
        f"pageable {bw['d2h_pageable']:.1f} out, {bw['h2d_pageable']:.1f} back.",
        "",
        "| workload | variant | step ms (min–max) | peak GiB | held growth / block (block inputs) | GB out / in | transfer bound ms | step / bound | grad rel. err | proof |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            out.append(f"| {r.workload} | {r.variant} | – | – | – | – | – | – | – | not run: {r.skipped} |")
            continue
        ratio = f"{r.step_ms / r.bound_ms:.2f}" if r.bound_ms and r.proof == "ok" else "–"
        time = f"{r.step_ms:.1f} ({r.step_ms_min:.1f}–{r.step_ms_max:.1f})" if r.proof == "ok" else "effect missing"
        out.append(
            f"| {r.workload} | {r.variant} | {time} | {r.peak_gib:.2f} | {r.growth_per_block:.2f} | "
            f"{r.bytes_out / 1e9:.2f} / {r.bytes_in / 1e9:.2f} | {r.bound_ms:.1f} | {ratio} | {r.grad_rel_err:.1e} | {r.proof} |"
        )
    out += ["", "Targets:", "", render_targets(results, meta["bandwidth_gbps"]), ""]
    return "\n".join(out)


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, workload in zip(axes, ("seed", "blocks")):
        rs = [r for r in results if r.workload == workload and not r.skipped]
        # a variant whose effect is missing gets no bar: its time is not a speed
        ax.barh([r.variant for r in rs], [r.step_ms if r.proof == "ok" else 0 for r in rs],
                color=["tab:green" if r.variant.startswith("actcfg") else "tab:gray" for r in rs])
        for i, r in enumerate(rs):
            if r.proof != "ok":
                ax.text(0, i, " effect missing: not timed", va="center", color="red", fontsize=8)
            elif r.bound_ms:
                ax.plot([r.bound_ms], [i], "k|", markersize=14)
        ax.set_title(f"{workload}: step time (ms); | = transfer bound")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
