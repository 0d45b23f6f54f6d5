"""The longest sequence one GPU trains, per activation policy: plain, HF, torch, torchtune and actcfg.

    # the small shape: a few minutes on one H200 (variants run side by side, each capped at 6 GiB;
    # their times then share the GPU: lengths and proofs are the result, not speeds)
    PYTHONPATH=. python benchmarks/max_seq_bench.py --shape small --jobs 4 --out bench-out

    # the same, timed one variant at a time (about 10 minutes): first step against steady state
    PYTHONPATH=. python benchmarks/max_seq_bench.py --shape small --out bench-out

    # its structural test in the GPU suite (three variants, about two minutes)
    PYTHONPATH=. python -m pytest -m cuda -q tests/benchmarks/test_max_seq_cuda.py

    # the 3.02B Llama of issue 23 (hidden 3072, 28 layers, 24 heads, 8 KV heads, intermediate
    # 8192, vocab 32000), the whole GPU: about 20 minutes per variant (a step at 192k takes a
    # minute; actcfg-auto's profile runs some 30 steps per length, hours); --variants picks some,
    # e.g. the headline pair (about 40 minutes):
    PYTHONPATH=. python benchmarks/max_seq_bench.py --variants hf-checkpointing,actcfg-checkpoint-cpu --out bench-out

    # chosen lengths only, no search, inside a time limit (the report is written either way);
    # a later call reuses what an earlier one measured (this is how the README's 3B figure ran)
    PYTHONPATH=. python benchmarks/max_seq_bench.py --steps 1 --deadline-s 540 \
        --at hf-checkpointing=128k,160k --at actcfg-checkpoint-cpu=128k,256k --out run1
    PYTHONPATH=. python benchmarks/max_seq_bench.py --steps 1 --deadline-s 540 \
        --resume run1/max_seq.json --at hf-checkpointing=192k --out run2

For a Llama shape (LlamaConfig + LlamaForCausalLM from transformers, random weights, bf16
parameters and AdamW states, batch 1) it finds, per variant, the longest sequence at which one
full training step (forward, loss, backward, AdamW step) fits: doubling from --start until a
length does not fit, then bisecting to --granularity. Every length runs in a fresh process
(`--child`, with the variant and the length as arguments), so an out-of-memory error cannot
poison the next; a variant that cannot run here (torchtune is not installable on every machine)
says "unavailable" once and is not searched.

Variants: plain; HF `gradient_checkpointing_enable()`; torch `offload_wrapper(checkpoint_wrapper)`;
torchtune `OffloadActivations` (built once, as its recipes do) without and with checkpointing;
actcfg checkpoint; actcfg checkpoint + `cpu_checkpointing`, and the same with `keep_last: 0` and
the model's final norm checkpointed and offloaded too (`checkpoint.mode: rules`: nothing the
model saves from its first layer to its head stays on the GPU at the turn); actcfg
`mode: auto` with `memory_budget` set to what the GPU has free when the step begins. Where
transformers has it (5.24+), HF's `activation_checkpointing_enable(offload=True)` too.

Each length's process warms up at a short length (optimizer states, kernels), then times the
first step at the length and --steps more (the steady state, their median), and reads the
peak (allocated and reserved), the pinned host memory, and the proof that the policy took
effect: every checkpointed layer recomputed once per backward (counted by a forward pre-hook on
each layer's first module, and for actcfg by its own counters too), memory held after each layer
flat in forward for
offload (the slope over the layers, in layer inputs per layer), the bytes actcfg's engine moved,
and for a plan its peak within its budget. A figure whose proof fails is "effect missing".

What else bounds the length is measured at each variant's longest: the fp32 logits of the loss
(vocab x length x 4 bytes per copy), the attention mask if the model materialised one (length^2
bytes), the allocator's reserved-but-unallocated memory (fragmentation; every process runs
with `expandable_segments:True` unless --no-expandable-segments), the parameters and optimizer
states, and what actcfg's engine kept on the GPU at the turn. docs/long-sequences.md says which
of these a setting helps with.

Writes max_seq.json, max_seq.md and max_seq.png (longest length per variant; time per token
against length) to --out. Not run in CI: it needs a GPU (tests/benchmarks/test_max_seq_cuda.py runs the
small shape, structurally, on the GPU machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

GiB = 2**30
HERE = Path(__file__).resolve().parent


# --- shapes and variants ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A Llama shape and how to search its lengths."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    start: int
    """First length tried; doubled until one does not fit."""
    granularity: int
    """The bisection stops when the longest fitting and the shortest failing lengths are this close."""
    limit: int
    """Longest length tried at all."""
    memory_cap_gib: float | None = None
    """GPU memory each process may allocate (torch's per-process fraction); None: the whole GPU."""


SHAPES = {
    # issue 23's model: 3.02B parameters
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=32000,
                start=16384, granularity=4096, limit=1 << 20),
    # minutes: 16 small layers under a 6 GiB cap, so lengths stay short and steps fast; a small
    # vocabulary, so that activations (not the logits) decide the order of the variants
    "small": Shape(hidden=1024, layers=16, heads=16, kv_heads=8, intermediate=2816, vocab=8192,
                   start=4096, granularity=2048, limit=1 << 18, memory_cap_gib=6.0),
}


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    claims: tuple[str, ...]
    """What the proof checks: `checkpoint` (every layer recomputed once), `offload` (memory held
    per layer flat), `plan` (the peak within the budget and the plan's effects counted)."""


VARIANTS = {v.key: v for v in (
    Variant("plain", "plain", ()),
    Variant("hf-checkpointing", "HF gradient_checkpointing_enable()", ("checkpoint",)),
    Variant("hf-checkpointing-offload", "HF activation_checkpointing_enable(offload=True)", ("checkpoint", "offload")),
    Variant("torch-checkpoint-offload", "torch offload_wrapper(checkpoint_wrapper)", ("checkpoint", "offload")),
    Variant("torchtune-offload", "torchtune OffloadActivations", ("offload",)),
    Variant("torchtune-checkpoint-offload", "torchtune checkpoint + OffloadActivations", ("checkpoint", "offload")),
    Variant("actcfg-checkpoint", "actcfg checkpoint", ("checkpoint",)),
    Variant("actcfg-checkpoint-cpu", "actcfg checkpoint + cpu_checkpointing", ("checkpoint", "offload")),
    # actcfg's lowest peak: the newest layer's input offloaded too (keep_last 0), and the final
    # norm checkpointed with its input offloaded. Under `keep_last: 1` the last group holds the
    # norm's fp32 input and output (5.06 GiB at 288k on the 3B shape) with that layer input;
    # with `keep_last: 0` and the layers alone, the norm's would stay between groups (on the
    # device). The reloads start when backward reaches them, after the loss's backward (the
    # step's peak): copies nothing hides, under a second in a step of minutes.
    Variant("actcfg-checkpoint-cpu-keep0", "actcfg checkpoint + cpu_checkpointing, keep_last 0, final norm too",
            ("checkpoint", "offload")),
    Variant("actcfg-auto", "actcfg mode: auto, memory_budget = free", ("plan",)),
)}
ACTCFG_HEADLINE = "actcfg-checkpoint-cpu"
HF = "hf-checkpointing"


# --- the search (pure: tests/benchmarks/test_max_seq_search.py drives it with a fake predicate) -------------


@dataclass
class Search:
    """The outcome of one variant's search."""

    longest: int | None = None
    """The longest length that fit (None: not even the first tried)."""
    shortest_failing: int | None = None
    """The shortest length that did not fit (None: none failed up to the limit)."""
    tried: list[tuple[int, bool]] = field(default_factory=list)
    """Every length tried, in order, and whether it fit."""

    @property
    def limit_reached(self) -> bool:
        return self.longest is not None and self.shortest_failing is None


def find_longest(fits: Callable[[int], bool], start: int, granularity: int, limit: int) -> Search:
    """Double from `start` until a length does not fit (or `limit` is reached), then bisect
    between the longest fitting and the shortest failing length until they are at most
    `granularity` apart; every length tried is a multiple of `granularity`."""
    if start <= 0 or granularity <= 0 or start % granularity or limit < start:
        raise ValueError(f"start ({start}) must be a positive multiple of granularity ({granularity}) "
                         f"and at most limit ({limit})")
    out = Search()

    def attempt(length: int) -> bool:
        ok = fits(length)
        out.tried.append((length, ok))
        return ok

    length = start
    while True:
        if not attempt(length):
            out.shortest_failing = length
            break
        out.longest = length
        if length >= limit:
            return out
        length = min(2 * length, limit // granularity * granularity)
        if length <= out.longest:
            return out
    lo = out.longest if out.longest is not None else 0
    hi = out.shortest_failing
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        if attempt(mid):
            lo = out.longest = mid
        else:
            hi = out.shortest_failing = mid
    return out


def try_lengths(fits: Callable[[int], bool], lengths: list[int]) -> Search:
    """Run the given lengths in ascending order, with no search: the longest that fit is a lower
    bound on the variant's longest, the shortest that failed above it an upper bound. A length
    above a failure is still run, so the report would show a fit that memory does not explain."""
    out = Search()
    for length in sorted(set(lengths)):
        ok = fits(length)
        out.tried.append((length, ok))
        if ok:
            out.longest = max(out.longest or 0, length)
    failing = [n for n, ok in out.tried if not ok and n > (out.longest or 0)]
    out.shortest_failing = min(failing) if failing else None
    return out


def parse_at(specs: list[str]) -> dict[str, list[int]]:
    """`--at VARIANT=LEN[,LEN...]` (lengths in tokens, or with a k suffix: 128k = 131072)."""
    out: dict[str, list[int]] = {}
    for spec in specs:
        key, sep, lengths = spec.partition("=")
        if not sep or key not in VARIANTS or not lengths:
            raise ValueError(f"--at {spec!r}: write VARIANT=LENGTH[,LENGTH...] with VARIANT one of "
                             f"{', '.join(VARIANTS)} (e.g. --at hf-checkpointing=128k,160k)")
        for text in lengths.split(","):
            t = text.strip().lower()
            n = int(t[:-1]) * 1024 if t.endswith("k") and t[:-1].isdigit() else int(t) if t.isdigit() else 0
            if n <= 0:
                raise ValueError(f"--at {spec!r}: {text!r} is not a length (tokens, or 128k)")
            out.setdefault(key, []).append(n)
    return out


# --- one length, in its own process ----------------------------------------------------------------


class Unavailable(Exception):
    """The variant cannot run on this machine (a peer that is not installed)."""


class OverCap(Exception):
    """The step ran, and took more GPU memory than the process's cap: it does not fit."""


def _out_of_memory(e: BaseException) -> bool:
    import torch

    # cuBLAS and cuDNN report a failed allocation in their own words
    text = str(e).lower()
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text or "alloc_failed" in text))


def build_model(shape: Shape, length: int) -> Any:
    """The Llama of `shape`, random weights, bf16, on the GPU, in training mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=max(length, 4096),
        use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    return model.train()


def available(key: str) -> None:
    """Raise Unavailable if variant `key` cannot run on this machine."""
    if key.startswith("torchtune"):
        try:
            from torchtune.training import OffloadActivations  # noqa: F401
        except ImportError as e:
            raise Unavailable(f"torchtune is not importable here ({e})") from e
    if key == "hf-checkpointing-offload":
        from transformers import PreTrainedModel

        if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
            raise Unavailable("this transformers has no activation_checkpointing_enable(offload=True) (5.24+)")


def _final_norm(model: Any) -> list[str]:
    """The path of the norm between a causal LM's last layer and its head (a pattern for
    `checkpoint.modules`), if it has one."""
    import torch

    return ["model.norm"] if isinstance(getattr(model.model, "norm", None), torch.nn.Module) else []


def checkpointed_modules(key: str, model: Any) -> int:
    """How many modules the variant checkpoints: its layers, and for keep0 the final norm."""
    return len(model.model.layers) + (len(_final_norm(model)) if key == "actcfg-checkpoint-cpu-keep0" else 0)


def setup_variant(key: str, model: Any, inputs: dict[str, Any], budget: int) -> tuple[Any, Callable[[], Any]]:
    """Apply variant `key` to `model`: (the actcfg handle or None, a context for each forward)."""
    import actcfg

    layer = type(model.model.layers[0])
    none: Callable[[], Any] = contextlib.nullcontext
    ckpt = {"mode": "full", "modules": [layer.__name__]}
    if key == "plain":
        return None, none
    if key in ("hf-checkpointing", "hf-checkpointing-offload"):
        # transformers 5.24 renamed it activation_checkpointing_enable (the old name warns) and
        # added offload=True (torch's save_on_cpu around each checkpoint)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                                  offload=key.endswith("offload"))
        else:
            available(key)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return None, none
    if key == "torch-checkpoint-offload":
        from composition_bench import _torch_wrap  # what FSDP users write, as composition_bench runs it

        _torch_wrap(model, layer, offload=True)
        return None, none
    if key.startswith("torchtune"):
        available(key)
        from offload_bench import _built_once

        if key == "torchtune-checkpoint-offload":
            from composition_bench import _torch_wrap  # torchtune's recipes wrap with checkpoint_wrapper

            _torch_wrap(model, layer, offload=False)
        context = _built_once()  # one OffloadActivations for the whole run, as its recipes keep it
        return None, lambda: context(model)
    if key == "actcfg-checkpoint":
        return actcfg.apply(model, {"version": 1, "checkpoint": ckpt}), none
    if key == "actcfg-checkpoint-cpu":
        return actcfg.apply(model, {"version": 1, "checkpoint": ckpt, "cpu_checkpointing": True}), none
    if key == "actcfg-checkpoint-cpu-keep0":
        rules = [{"modules": [layer.__name__, *_final_norm(model)], "mode": "full", "cpu_checkpointing": True}]
        return actcfg.apply(model, {"version": 1, "checkpoint": {"mode": "rules", "rules": rules, "keep_last": 0}}), none
    if key == "actcfg-auto":
        policy = {"version": 1, "checkpoint": {"mode": "auto", "modules": [layer.__name__]},
                  "memory_budget": budget}
        return actcfg.apply(model, policy, inputs=inputs), none
    raise ValueError(f"unknown variant {key!r}")


def _slope(values: list[float]) -> float:
    """Least-squares slope of `values` against their index (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def _pinned_by_torch() -> int | None:
    """Bytes torch's pinned host allocator holds (save_on_cpu, torchtune), where torch says."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        s = None if stats is None else stats()
    except RuntimeError:  # a torch whose host allocator keeps no statistics
        return None
    return None if s is None else int(s.get("reserved_bytes.current", s.get("allocated_bytes.current", 0)))


def measure(key: str, shape: Shape, length: int, steps: int) -> dict[str, Any]:
    """Everything one length's process reports for variant `key` (raises on out of memory)."""
    import torch

    available(key)  # before building anything: a peer that is not here costs a second, not a model
    cap = None
    if shape.memory_cap_gib is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = int(shape.memory_cap_gib * GiB)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    model = build_model(shape, length)
    layers = list(model.model.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    gen = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, shape.vocab, (1, length), device="cuda", generator=gen)
    short = ids[:, : min(length, 512)]
    calls = [0]
    recording = [False]
    held: list[int] = []
    mask: list[Any] = []

    def layer_begins(*_: Any) -> None:
        calls[0] += 1

    def after_layer(*_: Any) -> None:
        if recording[0]:
            held.append(torch.cuda.memory_allocated())

    def see_mask(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        m = kwargs.get("attention_mask")
        if recording[0] and not mask:
            mask.append(None if not isinstance(m, torch.Tensor) else m.numel() * m.element_size())

    # A recompute runs the layer's forward again, whoever checkpoints it: HF (which, from
    # transformers 5.24, checkpoints `forward` and not `__call__`, so the layer's own hooks stay
    # outside), torch's wrapper, actcfg. It may stop early, once the last tensor backward needs
    # is back (torch's non-reentrant early stop), so a post-hook would miss it; the pre-hook of
    # the first module inside the layer sees every run.
    hooks = [layer.input_layernorm.register_forward_pre_hook(layer_begins) for layer in layers]
    hooks += [layer.register_forward_hook(after_layer) for layer in layers]
    hooks.append(layers[0].register_forward_pre_hook(see_mask, with_kwargs=True))
    context: Callable[[], Any] = contextlib.nullcontext

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        calls[0] = 0
        held.clear()
        recording[0] = True
        with context():
            loss = model(input_ids=x, labels=x).loss  # the output (and its logits) dies here
        recording[0] = False
        loss.backward()
        optimizer.step()

    step(short)  # optimizer states, kernels, the allocator: not the length's first step
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated()  # parameters and AdamW states
    if cap is not None:
        budget = cap - states
    else:
        free, _ = torch.cuda.mem_get_info()
        budget = free + torch.cuda.memory_reserved() - states
    handle, context = setup_variant(key, model, {"input_ids": ids, "labels": ids}, budget)
    engine = getattr(handle, "engine", None)
    step(short)  # the policy's own warm-up (streams, wrappers) at the short length
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    pool0 = _pool(engine)
    pinned0 = _pinned_by_torch()
    runs0 = _recomputes(handle)
    mask.clear()  # the warm-ups' mask was for their short length
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step(ids)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    pool1 = _pool(engine)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pool2 = _pool(engine)
    # --steps 0 asks only whether a length fits (a 3B step near the limit takes minutes): the
    # first step then stands in for the steady state, and the report says so.
    steady_s = statistics.median(times) if times else first_s
    peak = torch.cuda.max_memory_allocated()
    peak_reserved = torch.cuda.max_memory_reserved()
    if cap is not None and peak_reserved > cap:
        # Where the allocator does not enforce the fraction (its expandable segments, in some
        # torch versions), the cap is judged here: what the process took is what a GPU of that
        # size would have had to hold.
        raise OverCap(f"out of GPU memory: {peak_reserved / GiB:.2f} GiB reserved at the peak, over "
                      f"the {shape.memory_cap_gib:g} GiB cap")
    recomputes = calls[0] - len(layers)  # in the last step
    counted = None if handle is None else (_recomputes(handle) - runs0) // (steps + 1)
    layer_input = length * shape.hidden * 2
    growth = _slope([float(h) for h in held]) / layer_input
    pinned_torch = _pinned_by_torch()
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "first_s": first_s, "steady_s": steady_s, "step_s": times, "steady_measured": bool(times),
        "tokens_per_s": length / steady_s,
        "peak": peak, "peak_reserved": peak_reserved, "step_start": start, "states": states,
        "budget": budget if key == "actcfg-auto" else None,
        "recomputes_per_step": recomputes, "actcfg_recomputes_per_step": counted, "layers": len(layers),
        "checkpointed": checkpointed_modules(key, model),
        "held_growth_per_layer": growth,
        "pinned_host": None, "pinned_host_torch": (None if pinned_torch is None or pinned0 is None
                                                   else pinned_torch - pinned0),
        "attention_mask_bytes": mask[0] if mask else None,
        "logits_fp32_bytes": shape.vocab * length * 4,
        "layer_input_bytes": layer_input,
    }
    if engine is not None:
        st = engine.stats
        out.update(
            pinned_host=st.pinned_bytes, pageable_host=st.pageable_bytes,
            offloaded_bytes=st.offloaded_bytes, kept_at_turn_bytes=st.kept_bytes,
            # the pool's growth: in the first step at this length, and in the steps after it
            first_step_pool={k: pool1[k] - pool0[k] for k in pool0},
            later_steps_pool={k: pool2[k] - pool1[k] for k in pool0},
        )
    if handle is not None and handle.plan is not None:
        out["plan"] = [c for _, c in handle.plan.choices]
        out["plan_predicted_peak"] = handle.plan.predicted_peak
    out["proof"] = proof(VARIANTS[key], out, handle)
    for h in hooks:
        h.remove()
    return out


def _pool(engine: Any) -> dict[str, float]:
    if engine is None:
        return {}
    st = engine.stats
    return {"on_demand": st.host_buffers_on_demand, "ahead": st.host_buffers_ahead,
            "wait_s": st.host_wait_s, "pinned_allocations": st.pinned_allocations,
            "pinned_bytes": st.pinned_bytes}


def _recomputes(handle: Any) -> int:
    return 0 if handle is None else handle.counters.recomputes


def proof(variant: Variant, r: dict[str, Any], handle: Any) -> str:
    """'ok', or what shows the variant's policy did not take effect."""
    failed = []
    if "checkpoint" in variant.claims:
        if r["recomputes_per_step"] != r["layers"]:
            failed.append(f"{r['recomputes_per_step']} layers recomputed per backward, not {r['layers']}")
        counted = r.get("actcfg_recomputes_per_step")
        wanted = r.get("checkpointed", r["layers"])  # keep0 checkpoints the final norm too
        if handle is not None and counted != wanted:
            failed.append(f"actcfg counted {counted} recomputes per backward, not {wanted}")
    if "offload" in variant.claims:
        if r["held_growth_per_layer"] >= 0.5:
            failed.append(f"memory held grew {r['held_growth_per_layer']:.2f} layer inputs per layer "
                          "in forward: nothing left the GPU")
        if handle is not None and not r.get("offloaded_bytes"):
            failed.append("actcfg's engine moved 0 bytes")
    if "plan" in variant.claims:
        if handle is None or handle.plan is None:
            failed.append("no plan was applied")
        else:
            above = r["peak"] - r["step_start"]
            if above > r["budget"]:
                failed.append(f"peak {above / GiB:.2f} GiB above the step's start, over the budget "
                              f"{r['budget'] / GiB:.2f} GiB")
            plan = r["plan"]
            recomputing = sum(c in ("full", "selective", "full_offload") for c in plan)
            if r["recomputes_per_step"] != recomputing:
                failed.append(f"the plan recomputes {recomputing} layers, and "
                              f"{r['recomputes_per_step']} recomputed per backward")
            if any(c in ("full_offload", "offload") for c in plan) and not r.get("offloaded_bytes"):
                failed.append("the plan offloads, and actcfg's engine moved 0 bytes")
    return "; ".join(failed) or "ok"


def child(args: argparse.Namespace) -> int:
    """One variant at one length: the result as JSON in --result (written whole, then renamed)."""
    shape = Shape(**json.loads(args.shape_json))
    result: dict[str, Any] = {"variant": args.child, "length": args.length, "fits": False}
    try:
        result.update(measure(args.child, shape, args.length, args.steps))
        result["fits"] = True
    except Unavailable as e:
        result["unavailable"] = str(e)
    except OverCap as e:
        result["why"] = str(e)
    except Exception as e:
        from actcfg.errors import PlanError

        if _out_of_memory(e):
            result["why"] = "out of GPU memory: " + str(e).splitlines()[0][:200]
        elif isinstance(e, PlanError):
            result["why"] = f"no plan fits: {e}"[:300]
        else:
            result["error"] = "".join(traceback.format_exception(e))[-3000:]
    tmp = Path(args.result + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.result)
    return 0


# --- the parent: searches, run in fresh processes ----------------------------------------------------


@dataclass
class Outcome:
    """One variant's search and the runs behind it."""

    key: str
    label: str
    search: Search = field(default_factory=Search)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Every length run, by length."""
    unavailable: str = ""
    error: str = ""
    skipped: list[int] = field(default_factory=list)
    """Lengths not measured: the run's deadline had passed, or the length's process ran out of
    time (unknown whether it fits; the search stopped there)."""

    @property
    def best(self) -> dict[str, Any] | None:
        """The run at the longest length that fit."""
        return None if self.search.longest is None else self.runs.get(self.search.longest)


def alloc_conf(expandable: bool) -> str:
    """The allocator settings each length's process runs with: the caller's, plus
    `expandable_segments:True` unless they set it either way or `expandable` is False."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if not expandable or "expandable_segments" in conf:
        return conf
    return ",".join(filter(None, [conf, "expandable_segments:True"]))


def run_length(key: str, shape: Shape, length: int, steps: int, timeout: int, expandable: bool) -> dict[str, Any]:
    """Run one length of one variant in a fresh process and return what it reported."""
    env = dict(os.environ)
    conf = alloc_conf(expandable)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--length", str(length),
               "--steps", str(steps), "--shape-json", json.dumps(asdict(shape)), "--result", str(path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, tail = proc.returncode, (proc.stderr or "")[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = None, f"timed out after {timeout} s"
        wall = time.perf_counter() - t0
        if path.exists():
            out = json.loads(path.read_text())
        elif rc is None:
            # Out of time is not out of memory: the length is unknown, and the search stops there.
            out = {"variant": key, "length": length, "fits": False, "timed_out": True,
                   "why": f"timed out after {timeout} s, before its steps ended: whether it fits is unknown"}
        else:
            # Killed without a word (the host out of memory, say): the length does not fit here.
            out = {"variant": key, "length": length, "fits": False,
                   "why": f"the process ended (rc {rc}) without a result: {tail.strip()[-300:]}"}
    out["process_s"] = wall
    return out


def search_variant(key: str, shape: Shape, args: argparse.Namespace, log: Callable[[str], None],
                   lengths: list[int] | None = None) -> Outcome:
    """Find the longest length of one variant, each length in a fresh process (or, with
    `lengths`, run just those)."""
    outcome = Outcome(key, VARIANTS[key].label)

    class Stop(Exception):
        pass

    earlier = getattr(args, "earlier", {}).get(key, {})

    def fits(length: int) -> bool:
        if length in earlier:  # measured by an earlier run (--resume): not run again
            outcome.runs[length] = r = earlier[length]
            return bool(r["fits"])
        left = args.deadline - time.monotonic()
        if left < 30:
            # Past the run's deadline a length is not tried: the report must still be written.
            outcome.skipped.append(length)
            log(f"{key:30s} {length:>8d}  not run: the run's --deadline-s has passed")
            raise Stop
        r = run_length(key, shape, length, args.steps, int(min(args.child_timeout, left - 20)),
                       not args.no_expandable_segments)
        # Stamped, so a report that resumes runs of several calls says which versions ran each.
        r.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 transformers=version("transformers"))
        outcome.runs[length] = r
        if r.get("unavailable"):
            outcome.unavailable = r["unavailable"]
            raise Stop
        if r.get("error"):
            outcome.error = r["error"]
            raise Stop
        if r.get("timed_out"):
            outcome.skipped.append(length)
            log(f"{key:30s} {length:>8d}  {r['why']}")
            raise Stop
        if r["fits"]:
            log(f"{key:30s} {length:>8d}  fits: first {r['first_s']:.2f} s, steady {r['steady_s']:.2f} s, "
                f"peak {r['peak'] / GiB:.2f} GiB, proof {r['proof']}")
        else:
            log(f"{key:30s} {length:>8d}  does not fit: {r.get('why', '')[:120]}")
        return bool(r["fits"])

    recorded = Search()

    def recording_fits(length: int) -> bool:
        ok = fits(length)
        recorded.tried.append((length, ok))
        if ok:
            recorded.longest = max(recorded.longest or 0, length)
        elif recorded.shortest_failing is None or length < recorded.shortest_failing:
            recorded.shortest_failing = length
        return ok

    try:
        if lengths is not None:
            outcome.search = try_lengths(recording_fits, [*lengths, *earlier])
        else:
            outcome.search = find_longest(recording_fits, shape.start, shape.granularity, shape.limit)
    except Stop:
        outcome.search = recorded
        if outcome.unavailable or outcome.error:
            why = f"unavailable: {outcome.unavailable}" if outcome.unavailable else f"error: {outcome.error[-300:]}"
            log(f"{key:30s} {why}")
    return outcome


def compare_at(outcomes: dict[str, Outcome], shape: Shape, args: argparse.Namespace, log: Callable[[str], None]) -> None:
    """Run actcfg's variants at HF checkpointing's longest length, where they fit and have not run
    it already: the issue's speed targets compare there, in this run."""
    hf = outcomes.get(HF)
    if hf is None or hf.search.longest is None:
        return
    at = hf.search.longest
    for key in ("actcfg-checkpoint", ACTCFG_HEADLINE):
        o = outcomes.get(key)
        if o is None or o.search.longest is None or o.search.longest < at or at in o.runs:
            continue
        if args.deadline - time.monotonic() < 30:
            log(f"{key:30s} {at:>8d}  (at HF's longest) not run: the run's --deadline-s has passed")
            continue
        o.runs[at] = run_length(key, shape, at, args.steps, args.child_timeout, not args.no_expandable_segments)
        log(f"{key:30s} {at:>8d}  (at HF's longest) fits: {o.runs[at]['fits']}")


# --- reporting ------------------------------------------------------------------------------------


def _k(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def credited(o: Outcome) -> int | None:
    """The variant's longest length, if its proof held there (else None: effect missing)."""
    best = o.best
    return o.search.longest if best is not None and best.get("proof") == "ok" else None


def targets(outcomes: dict[str, Outcome]) -> list[str]:
    """The issue's targets as ratios of this run."""
    lines = ["| target | measured | met |", "|---|---|---|"]

    def row(text: str, value: str, ok: bool | None) -> None:
        lines.append(f"| {text} | {value} | {'–' if ok is None else 'yes' if ok else 'NO'} |")

    act, hf = outcomes.get(ACTCFG_HEADLINE), outcomes.get(HF)
    if act is None:
        return lines
    # actcfg's longest over its offloading variants (the headline, and keep0 where it ran)
    offloading = [o for k, o in outcomes.items() if k.startswith(ACTCFG_HEADLINE) and credited(o)]
    best = max(offloading, key=lambda o: credited(o) or 0, default=act)
    mine, who = credited(best), best.label
    if hf is not None and credited(hf) and mine:
        row(f"actcfg's longest ({who}) / HF checkpointing's >= 2",
            f"{_k(mine)} / {_k(credited(hf))} = {mine / credited(hf):.2f}", mine >= 2 * credited(hf))
    peers = {k: o for k, o in outcomes.items() if not k.startswith("actcfg") and not o.unavailable}
    if mine and peers:
        # Longer than a peer: actcfg fit a length at which the peer ran out of memory (a peer
        # that fit every length it tried is not shown shorter, whatever those lengths were).
        beaten = {k: o.search.shortest_failing is not None and o.search.shortest_failing <= mine
                  for k, o in peers.items()}
        said = ", ".join(f"{o.label} "
                         + (f"{_k(o.search.longest)} fit, " if o.search.longest else "")
                         + (f"{_k(o.search.shortest_failing)} did not"
                            + ("" if o.search.longest else " (nothing shorter run)")
                            if o.search.shortest_failing else "longer not tried") for o in peers.values())
        row(f"actcfg's longest ({who}): longer than every peer",
            f"{_k(mine)} fit; {said}"
            + (f" ({_k(best.search.longest)} actcfg's longest tried: longer not tried)" if best.search.limit_reached else ""),
            all(beaten.values()))
    if hf is not None and hf.search.longest is not None:
        # At HF's longest, where actcfg ran it; else at the longest length both ran (a run of
        # chosen lengths, --at), said as such. A --steps 0 run has no steady state to compare.
        both = [n for n in hf.runs if _steady(hf.runs[n]) and _steady(act.runs.get(n, {}))]
        at = hf.search.longest if hf.search.longest in both else max(both, default=None)
        a, h = act.runs.get(at), hf.runs.get(at)
        where = (f"HF's longest ({_k(at)})" if at == hf.search.longest else
                 f"{_k(at)}, the longest both ran (HF's longest here: {_k(hf.search.longest)})")
        if a and h and a.get("fits") and h.get("fits"):
            ratio = a["steady_s"] / h["steady_s"]
            row(f"at {where}: actcfg's steady time per token / HF's <= 1.05",
                f"{a['steady_s']:.2f} / {h['steady_s']:.2f} s = {ratio:.3f}",
                ratio <= 1.05 and a["proof"] == "ok" and h["proof"] == "ok")
            first = a["first_s"] / a["steady_s"]
            row(f"at {where}: actcfg's first step / its steady state <= 1.1",
                f"{a['first_s']:.2f} / {a['steady_s']:.2f} s = {first:.3f}", first <= 1.1 and a["proof"] == "ok")
            hf_first = h["first_s"] / h["steady_s"]
            row(f"at {where}: HF's first step / its steady state (for scale)",
                f"{h['first_s']:.2f} / {h['steady_s']:.2f} s = {hf_first:.3f}", None)
    return lines


def _steady(run: dict[str, Any]) -> bool:
    """A length that fit and whose steady state was measured (not a --steps 0 run)."""
    return bool(run.get("fits")) and run.get("steady_measured", True)


def bounds(o: Outcome, shape: Shape) -> list[str]:
    """What else bounds the length, measured at `o`'s longest."""
    r = o.best
    if r is None:
        return []
    L = o.search.longest
    peak = r["peak"]
    out = [f"At {o.label}'s longest ({_k(L)} tokens), of its {peak / GiB:.2f} GiB peak:", ""]
    out.append(f"* parameters and AdamW states (bf16): {r['states'] / GiB:.2f} GiB "
               f"({r['states'] / peak:.0%}); backward adds the gradients, one more copy of the "
               "parameters.")
    out.append(f"* the loss's fp32 logits: vocab {shape.vocab} x {_k(L)} x 4 bytes = "
               f"{r['logits_fp32_bytes'] / GiB:.2f} GiB per copy ({r['logits_fp32_bytes'] / peak:.0%} of the "
               "peak); HF's loss upcasts the logits and saves log_softmax's output, and its backward "
               "makes two more: no activation policy touches these (a chunked cross-entropy does).")
    m = r.get("attention_mask_bytes")
    out.append("* attention: no mask was materialised (SDPA ran causal from `is_causal`); its "
               "workspace is linear in the length." if m is None else
               f"* attention: the model materialised a {m / GiB:.2f} GiB mask (length^2): it grows "
               "quadratically and bounds the length before activations do.")
    frag = r["peak_reserved"] - peak
    out.append(f"* the allocator: {r['peak_reserved'] / GiB:.2f} GiB reserved at the peak, "
               f"{frag / GiB:.2f} GiB more than allocated (fragmentation; `expandable_segments` "
               "was on unless the run says otherwise).")
    if r.get("kept_at_turn_bytes"):
        # The last group runs from the last layer's start to the forward's end, so it also holds
        # what the model saves after its layers (a Llama's final norm: its fp32 input and output).
        kept, layer = r["kept_at_turn_bytes"], r["layer_input_bytes"]
        after = (f": the last layer's input ({layer / GiB:.2f} GiB) and {(kept - layer) / GiB:.2f} GiB "
                 "the model saves after its last layer (the final norm's input and output), which "
                 "join the last group" if kept > layer else "")
        out.append(f"* actcfg kept {kept / GiB:.2f} GiB on the GPU at the forward/backward turn, the "
                   f"last group (`keep_last`, default 1){after}. `checkpoint.mode: rules` with "
                   "`keep_last: 0` offloads that layer input, and with the final norm in the rule "
                   "the norm's too (the keep0 variant): copies nothing hides, after the loss's backward.")
    if r.get("pinned_host") is not None:
        out.append(f"* host memory: {r['pinned_host'] / GiB:.2f} GiB pinned (bounded by "
                   "`pin_budget`; past it, pageable).")
    return out


def _versions_by_row(meta: dict[str, Any], outcomes: dict[str, Outcome]) -> str:
    """A sentence naming the transformers version each variant's runs had, where resumed rows
    differ from this call's (HF's offload=True needs 5.24, the image had 5.17)."""
    seen: dict[str, list[str]] = {}
    for o in outcomes.values():
        for v in sorted({r.get("transformers") or meta["transformers"] for r in o.runs.values()}):
            seen.setdefault(v, []).append(o.label)
    if len(seen) < 2:
        return ""
    # labels hold commas of their own: each is quoted
    return " Rows by the transformers they ran with: " + "; ".join(
        f"{v}: {', '.join(repr(label) for label in labels)}" for v, labels in sorted(seen.items())) + "."


def render(meta: dict[str, Any], outcomes: dict[str, Outcome], shape: Shape) -> str:
    cap = f", each process capped at {shape.memory_cap_gib:g} GiB" if shape.memory_cap_gib else ""
    out = [f"Measured {meta['date']} on {meta['gpu']}, torch {meta['torch']}, transformers "
           f"{meta['transformers']}; shape {meta['shape_name']} ({shape.hidden} hidden, {shape.layers} layers, "
           f"{shape.heads} heads, {shape.kv_heads} KV heads, intermediate {shape.intermediate}, vocab "
           f"{shape.vocab}); bf16 parameters and AdamW states, batch 1{cap}. "
           + (f"Lengths doubled from {_k(shape.start)}, then bisected to {_k(shape.granularity)}; "
              if meta.get("searched", True) else
              "Only the lengths listed under each variant were run (no search): a longest that fit is "
              "a lower bound, a shortest that did not an upper bound; ")
           + "each length in a fresh process; "
           + (f"steady state: median of {meta['steps']} steps after the first at that length; "
              if meta["steps"] else
              "this call ran the first step only (--steps 0: whether a length fits), as its rows say; "
              "rows resumed from an earlier call keep that call's steady state; ")
           + f"allocator: {meta['alloc_conf'] or 'defaults'}."
           + _versions_by_row(meta, outcomes),
           ""]
    if meta["jobs"] > 1:
        out += [f"Variants ran {meta['jobs']} at a time on one GPU: their times share it and are not "
                "comparable; lengths and proofs are.", ""]
    out += ["| variant | longest that fit | shortest that did not | tokens/s there | first step s | "
            "steady step s | first / steady | peak GiB (reserved) | pinned host GiB | proof |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes.values():
        if o.unavailable:
            out.append(f"| {o.label} | unavailable: {o.unavailable} | | | | | | | | |")
            continue
        if o.error:
            out.append(f"| {o.label} | error: {o.error.strip().splitlines()[-1][:150]} | | | | | | | | |")
            continue
        r = o.best
        failing = (_k(o.search.shortest_failing) if o.search.shortest_failing else
                   "none up to the limit" if meta.get("searched", True) else "none tried")
        if o.skipped:
            failing += f" ({', '.join(_k(n) for n in o.skipped)} not measured: out of time)"
        if r is None:
            tried = f"none from {_k(shape.start)}" if meta.get("searched", True) else "none of those tried"
            out.append(f"| {o.label} | {tried} | {failing} | | | | | | | |")
            continue
        ok = r["proof"] == "ok"
        pinned = r.get("pinned_host")
        if pinned is None:
            pinned = r.get("pinned_host_torch")
        pinned_s = "–" if not pinned else f"{pinned / GiB:.2f}"
        longest = _k(o.search.longest) if ok else f"effect missing ({_k(o.search.longest)} ran)"
        speed = (f"| {r['tokens_per_s']:.0f} | {r['first_s']:.2f} | {r['steady_s']:.2f} | "
                 f"{r['first_s'] / r['steady_s']:.2f} |") if ok else "| – | – | – | – |"
        if ok and not r.get("steady_measured", True):
            speed = f"| {r['tokens_per_s']:.0f} (first step) | {r['first_s']:.2f} | not measured | – |"
        proven = r["proof"]
        if r.get("plan"):
            counts: dict[str, int] = {}
            for c in r["plan"]:
                counts[c] = counts.get(c, 0) + 1
            proven += " (plan: " + ", ".join(f"{n} {c}" for c, n in counts.items()) + ")"
        out.append(f"| {o.label} | {longest} | {failing} {speed} {r['peak'] / GiB:.2f} "
                   f"({r['peak_reserved'] / GiB:.2f}) | {pinned_s} | {proven} |")
    out += ["", "Targets (issue 23; same run):", "", *targets(outcomes), ""]
    act = outcomes.get(ACTCFG_HEADLINE)
    if act is not None and act.best is not None:
        out += ["What else bounds the length:", "", *bounds(act, shape), ""]
        pool = act.best.get("first_step_pool")
        if pool:
            out += [f"actcfg's pinned pool in the first step at {_k(act.search.longest)}: "
                    f"{pool['on_demand']:.0f} buffers made on demand, {pool['ahead']:.0f} ahead on its "
                    f"thread, {pool['wait_s']:.2f} s waited for; in the steps after it "
                    f"{act.best['later_steps_pool']['pinned_allocations']:.0f} pinned allocations.", ""]
    return "\n".join(out) + "\n"


def plot(outcomes: dict[str, Outcome], path: Path, shape_name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(14, 5))
    shown = [o for o in outcomes.values() if not o.unavailable and not o.error]
    names = [o.label for o in shown]
    # a length whose proof failed gets no bar: it is not the policy's length
    values = [(credited(o) or 0) / 1024 for o in shown]
    bars.barh(names, values, color=["tab:green" if o.key.startswith("actcfg") else "tab:gray" for o in shown])
    for i, o in enumerate(shown):
        if o.search.longest is not None and credited(o) is None:
            bars.text(0, i, " effect missing", va="center", color="red", fontsize=8)
        elif o.search.limit_reached:
            bars.text(values[i], i, " (longer not tried)", va="center", fontsize=8)
        if o.search.shortest_failing is not None:  # where it ran out: a mark, with or without a bar
            bars.plot([o.search.shortest_failing / 1024], [i], marker="x", color="tab:red")
            if o.search.longest is None:
                bars.text(o.search.shortest_failing / 1024, i, f" out of memory at {_k(o.search.shortest_failing)}"
                          " (nothing shorter run)", va="center", fontsize=8)
    bars.set_xlabel("longest sequence that fit (k tokens)")
    bars.set_title(f"{shape_name}: longest sequence per variant")
    bars.invert_yaxis()
    for o in shown:
        pts = sorted((L, r["steady_s"] / L * 1e3) for L, r in o.runs.items()
                     if _steady(r) and r.get("proof") == "ok")
        if pts:
            lines.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=o.label)
    lines.set_xlabel("sequence length (k tokens)")
    lines.set_ylabel("steady step time per token (ms)")
    lines.set_title("time per token against length")
    lines.grid(alpha=0.3)
    lines.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _shape_from(args: argparse.Namespace) -> Shape:
    shape = SHAPES[args.shape]
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                                               "start", "granularity", "limit") if getattr(args, k) is not None}
    if args.memory_cap_gib is not None:
        overrides["memory_cap_gib"] = args.memory_cap_gib or None
    return replace(shape, **overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab", "start", "granularity", "limit"):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"override the shape's {name}")
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="GPU memory each process may allocate (0: the whole GPU; default: the shape's)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=2,
                    help="steady steps after the first, per length (0: the first step only, to ask whether it fits)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="variants searched at once (needs a memory cap that fits them all; their times then share the GPU)")
    ap.add_argument("--child-timeout", type=int, default=3600, help="seconds one length's process may take")
    ap.add_argument("--no-expandable-segments", action="store_true",
                    help="leave PYTORCH_CUDA_ALLOC_CONF as it is (default: expandable_segments:True)")
    ap.add_argument("--at", action="append", default=[], metavar="VARIANT=LEN[,LEN...]",
                    help="run only these lengths of this variant, no search (repeatable; 128k = 131072): "
                         "the longest that fit is a lower bound, as the report says")
    ap.add_argument("--resume", type=Path, default=None, metavar="MAX_SEQ_JSON",
                    help="reuse the lengths an earlier run measured (its max_seq.json), for the same shape")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="launch no length after this many seconds (the report is still written)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shape-json", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    try:
        given = parse_at(args.at)
    except ValueError as e:
        print(f"max_seq_bench: {e}", file=sys.stderr)
        return 2
    keys = list(given) if given else [k for k in args.variants.split(",") if k]
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown:
        print(f"max_seq_bench: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    shape = _shape_from(args)
    try:
        args.earlier = earlier_runs(args.resume, shape)
    except ValueError as e:
        print(f"max_seq_bench: {e}", file=sys.stderr)
        return 2
    if given:
        keys = list(dict.fromkeys([*keys, *args.earlier]))
    try:
        find_longest(lambda n: False, shape.start, shape.granularity, shape.limit)  # checks the grid only
    except ValueError as e:
        print(f"max_seq_bench: {e}", file=sys.stderr)
        return 2
    import torch

    # No CUDA context here (is_available does not make one): the GPU's memory is the children's.
    # Every length asked for already measured (--resume with --at): the report is re-rendered
    # from those runs, which needs no GPU.
    rerender = bool(given) and all(n in args.earlier.get(k, {}) for k, ns in given.items() for n in ns)
    if not torch.cuda.is_available() and not rerender:
        print("max_seq_bench needs a CUDA GPU (on another machine, it re-renders a report from "
              "--resume with --at naming only lengths already measured)", file=sys.stderr)
        return 2
    if args.jobs > 1:
        total = torch.cuda.get_device_properties(0).total_memory  # side by side, each is capped anyway
        if shape.memory_cap_gib is None or args.jobs * (shape.memory_cap_gib + 2) * GiB > total:
            print(f"max_seq_bench: --jobs {args.jobs} needs a memory cap with room for every process on "
                  f"this {total / GiB:.0f} GiB GPU (cap + about 2 GiB of context each): set "
                  "--memory-cap-gib, or --jobs 1", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, flush=True)

    t0 = time.perf_counter()
    args.deadline = time.monotonic() + (args.deadline_s if args.deadline_s is not None else float("inf"))
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        # the plan's search first: its lengths each profile some 30 steps, the longest path
        # (with --at, the order given: the user put first what matters most)
        order = keys if given else sorted(keys, key=lambda k: k != "actcfg-auto")
        futures = {k: pool.submit(search_variant, k, shape, args, log, given.get(k, [] if given else None))
                   for k in order}
        outcomes = {k: futures[k].result() for k in keys}
    compare_at(outcomes, shape, args, log)
    runs = [r for o in outcomes.values() for r in o.runs.values()]
    fresh = [r for o in outcomes.values() for n, r in o.runs.items()
             if r is not args.earlier.get(o.key, {}).get(n)]
    # A call that only re-renders resumed runs is dated and versioned by its newest run, not by
    # the machine that rendered it.
    newest = max(runs, key=lambda r: r.get("date") or "", default={}) if not fresh else {}
    measured = next((r for r in runs if r.get("gpu")), {})
    meta = {
        "date": newest.get("date") or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": measured.get("gpu", "no run measured"), "torch": measured.get("torch", torch.__version__),
        "transformers": newest.get("transformers") or version("transformers"),
        "shape_name": args.shape, "shape": asdict(shape),
        "steps": args.steps, "jobs": args.jobs, "wall_s": time.perf_counter() - t0,
        "alloc_conf": alloc_conf(not args.no_expandable_segments),
        "searched": not given,
    }
    data = {"meta": meta, "variants": {k: {"label": o.label, "longest": o.search.longest,
                                           "credited_longest": credited(o),
                                           "shortest_failing": o.search.shortest_failing,
                                           "limit_reached": o.search.limit_reached, "tried": o.search.tried,
                                           "unavailable": o.unavailable, "error": o.error,
                                           "not_measured": o.skipped,
                                           "runs": {str(L): r for L, r in sorted(o.runs.items())}}
                                       for k, o in outcomes.items()}}
    _write(args.out / "max_seq.json", json.dumps(data, indent=1))
    text = render(meta, outcomes, shape)
    _write(args.out / "max_seq.md", text)
    plot(outcomes, args.out / "max_seq.png", args.shape)
    print(text)
    return 0


def earlier_runs(path: Path | None, shape: Shape) -> dict[str, dict[int, dict[str, Any]]]:
    """The measured runs of an earlier max_seq.json, by variant and length (a run that was not
    measured, out of time, is left to run again)."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        earlier_shape = data["meta"]["shape"]
        variants = data["variants"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume {path}: not a max_seq.json this benchmark wrote ({e})") from e
    if earlier_shape != asdict(shape):
        raise ValueError(f"--resume {path}: measured another shape ({earlier_shape}); pass the same "
                         "--shape and overrides")
    # Runs from before runs were stamped take their file's date and versions.
    stamp = {"date": data["meta"].get("date"), "transformers": data["meta"].get("transformers")}
    return {k: {int(n): {**stamp, **r} for n, r in v["runs"].items() if not r.get("timed_out")}
            for k, v in variants.items() if k in VARIANTS}


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
