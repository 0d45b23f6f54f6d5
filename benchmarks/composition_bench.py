"""actcfg inside the stacks people train with, on one GPU, beside what those stacks offer themselves.

    PYTHONPATH=. python benchmarks/composition_bench.py --out bench-out

Two workloads, each variant measured the same way (median step time of --steps after two warm-up
steps, peak memory above the step's start, memory held after each layer, and gradients against
the workload's plain run):

* `llama`: a Hugging Face Llama decoder stack (8 layers, hidden 2048, batch 4, sequence 2048,
  bf16, random weights) against transformers' own checkpointing (`gradient_checkpointing_enable`,
  non-reentrant, as its docs advise) and its `offload=True` where the installed transformers has it.
* `fsdp2`: the block stack (8 blocks, d_model 2048, batch 8, sequence 2048, bf16) under FSDP2
  (`fully_shard` per block and on the root, one NCCL rank) against torch's `checkpoint_wrapper`
  and `offload_wrapper(checkpoint_wrapper(block))` as FSDP users write them
  (`apply_activation_checkpointing`).

A variant's time counts only beside its proof: gradients equal to plain within the dtype's
tolerance, a peak below plain for checkpointing, memory held per layer flat for offload. A
variant whose proof fails is "effect missing". Writes composition.json and composition.md.
Not run in CI: it needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
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
TOL = 2e-2  # bf16: recompute and offload are exact; attention backward is not deterministic


@dataclass
class Row:
    workload: str
    variant: str
    claims: list[str]
    step_ms: float = 0.0
    peak_gib: float = 0.0
    growth_per_layer: float = 0.0  # in layer inputs, over the second half of the stack
    grad_rel_err: float = 0.0
    offloaded_gb: float | None = None
    proof: str = "ok"
    skipped: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor], list[nn.Module]]]
    layer_input_bytes: int


def llama() -> tuple[nn.Module, Callable, list[nn.Module]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 32000, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def loss(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    return model, loss, list(model.model.layers)


def fsdp_blocks() -> tuple[nn.Module, Callable, list[nn.Module]]:
    torch.manual_seed(0)
    model, x = probes.blocks()

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    return model, loss, list(model.blocks)


def _shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _torch_wrap(model: nn.Module, layer: type, offload: bool) -> None:
    """What FSDP users write: checkpoint_wrapper, and offload_wrapper around it for offload."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )

    wrap = (lambda m: offload_wrapper(checkpoint_wrapper(m))) if offload else checkpoint_wrapper
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        # torch's wrappers rename parameters (pytorch#117399): compare by the plain names
        out[name.replace("_checkpoint_wrapped_module.", "").replace("_offload_wrapped_module.", "")] = g.float()
    return out


def run(workload: Workload, variant: str, claims: list[str], setup: Callable, steps: int,
        reference: dict | None) -> tuple[Row, dict | None]:
    row = Row(workload.name, variant, claims)
    model, loss_of, layers = workload.build()
    held: list[int] = []
    recording = [False]
    hooks = [m.register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated()) if recording[0] else None)
             for m in layers]
    handle = setup(model)
    try:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            held.clear()
            recording[0] = True
            loss = loss_of(model)
            recording[0] = False
            loss.backward()

        step()
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row.step_ms = statistics.median(times)
        row.peak_gib = (torch.cuda.max_memory_allocated() - base) / GiB
        half = held[len(held) // 2:]
        row.growth_per_layer = (half[-1] - half[0]) / max(1, len(half) - 1) / workload.layer_input_bytes
        grads = _grads(model)
        engine = getattr(handle, "engine", None)
        if engine is not None:
            row.offloaded_gb = engine.stats.offloaded_bytes / 1e9
    finally:
        for h in hooks:
            h.remove()
        if hasattr(handle, "remove"):
            handle.remove()
    failed = []
    if reference is not None:
        row.grad_rel_err = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
                               for n, g in reference["grads"].items())
        if row.grad_rel_err > TOL:
            failed.append(f"gradients differ from plain (max rel. error {row.grad_rel_err:.2e})")
        if "checkpoint" in claims and row.peak_gib >= reference["peak"]:
            failed.append(f"peak {row.peak_gib:.2f} GiB not below plain {reference['peak']:.2f} GiB")
    if "offload" in claims and row.growth_per_layer >= 0.05:
        failed.append(f"memory held grew {row.growth_per_layer:.2f} layer inputs per layer: offload missing")
    if row.offloaded_gb == 0:
        failed.append("the offload engine moved 0 bytes")
    row.proof = "; ".join(failed) or "ok"
    del model
    torch.cuda.empty_cache()
    return row, ({"grads": grads, "peak": row.peak_gib} if reference is None else None)


def llama_variants():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ckpt = {"mode": "full", "modules": ["LlamaDecoderLayer"]}
    yield "plain", [], lambda m: None
    yield ("transformers gradient_checkpointing_enable", ["checkpoint"],
           lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}))
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):  # transformers >= 5.24
        yield ("transformers activation_checkpointing_enable(offload=True)", ["checkpoint", "offload"],
               lambda m: m.activation_checkpointing_enable(offload=True))
    yield "torch checkpoint_wrapper", ["checkpoint"], lambda m: _torch_wrap(m, LlamaDecoderLayer, False)
    yield ("torch offload_wrapper(checkpoint_wrapper)", ["checkpoint", "offload"],
           lambda m: _torch_wrap(m, LlamaDecoderLayer, True))
    yield "actcfg checkpoint", ["checkpoint"], lambda m: actcfg.apply(m, {"version": 1, "checkpoint": ckpt})
    yield ("actcfg checkpoint + cpu_checkpointing", ["checkpoint", "offload"],
           lambda m: actcfg.apply(m, {"version": 1, "checkpoint": ckpt, "cpu_checkpointing": True}))


def fsdp_variants():
    ckpt = {"mode": "full", "modules": ["Block"]}

    def then_shard(setup):
        def go(m):
            handle = setup(m)
            _shard(m)
            return handle
        return go

    yield "FSDP2", [], then_shard(lambda m: None)
    yield "FSDP2 + torch checkpoint_wrapper", ["checkpoint"], then_shard(lambda m: _torch_wrap(m, probes.Block, False))
    yield ("FSDP2 + torch offload_wrapper(checkpoint_wrapper)", ["checkpoint", "offload"],
           then_shard(lambda m: _torch_wrap(m, probes.Block, True)))
    yield "FSDP2 + actcfg checkpoint", ["checkpoint"], then_shard(lambda m: actcfg.apply(m, {"version": 1, "checkpoint": ckpt}))
    yield ("FSDP2 + actcfg checkpoint + cpu_checkpointing", ["checkpoint", "offload"],
           then_shard(lambda m: actcfg.apply(m, {"version": 1, "checkpoint": ckpt, "cpu_checkpointing": True})))


def _init_nccl() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def render(meta: dict, rows: list[Row]) -> str:
    out = [f"Measured {meta['date']} on {meta['gpu']}, torch {meta['torch']}, transformers "
           f"{meta['transformers']}; median of {meta['steps']} steps after 2 warm-up steps.", "",
           "| workload | variant | step ms | peak GiB | held growth / layer (layer inputs) | offloaded GB | grad rel. err | proof |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            out.append(f"| {r.workload} | {r.variant} | – | – | – | – | – | not run: {r.skipped} |")
            continue
        time = f"{r.step_ms:.1f}" if r.proof == "ok" else "effect missing"
        moved = "–" if r.offloaded_gb is None else f"{r.offloaded_gb:.2f}"
        out.append(f"| {r.workload} | {r.variant} | {time} | {r.peak_gib:.2f} | {r.growth_per_layer:.2f} | "
                   f"{moved} | {r.grad_rel_err:.1e} | {r.proof} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workloads", default="llama,fsdp2")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("composition_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    workloads = {
        "llama": (Workload("llama", llama, 4 * 2048 * 2048 * 2), llama_variants),
        "fsdp2": (Workload("fsdp2", fsdp_blocks, 8 * 2048 * 2048 * 2), fsdp_variants),
    }
    rows: list[Row] = []
    for name in args.workloads.split(","):
        workload, variants = workloads[name]
        if name == "fsdp2":
            _init_nccl()
        reference = None
        for variant, claims, setup in variants():
            try:
                row, ref = run(workload, variant, claims, setup, args.steps, reference)
            except Exception as e:  # a peer that breaks is reported, not fatal to the run
                row, ref = Row(name, variant, claims, proof="", skipped=f"{type(e).__name__}: {e}"[:300]), None
                torch.cuda.empty_cache()
            reference = reference or ref
            rows.append(row)
            print(f"{name:6s} {variant:55s} {row.step_ms:8.1f} ms  peak {row.peak_gib:6.2f} GiB  "
                  f"growth {row.growth_per_layer:5.2f}  grad {row.grad_rel_err:.1e}  {row.skipped or row.proof}",
                  flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "steps": args.steps}
    (args.out / "composition.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (args.out / "composition.md").write_text(render(meta, rows))
    print(render(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
