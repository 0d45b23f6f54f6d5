"""Prove that a policy did what it says: run a model plain and with the policy, and judge.

`verify` measures (needs torch and a CUDA GPU); `judge` turns measurements into verdicts and
imports no torch, so its rules are tested on CPU with synthetic numbers. Rendering is in
`actcfg.verify_report`. Library code: nothing here prints or exits.

The factory contract: `model_factory()` returns `(model, example_inputs)`, or a model with an
`example_inputs` attribute (the inputs) or method (called with no arguments, returning them).
Inputs are a tensor, a tuple or list of positional arguments, or a dict of keyword arguments.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from actcfg.errors import VerifyError
from actcfg.schema import Backend, Policy

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "GRAD_TOLERANCE",
    "GradDiff",
    "Measurements",
    "RunMeasurement",
    "Verdict",
    "VerifyReport",
    "judge",
    "load_factory",
    "require_cuda",
    "verify",
    "worst_grad",
]

DEFAULT_MODEL = "actcfg.probes:linear_chain"
"""The factory `actcfg verify` uses without `--model`: the seed report's Linear chain."""

# Checkpoint recompute and offload round-trips run the same kernels on the same values, so a
# working policy gives bit-identical gradients (BACKENDS.md 1.6: B-F, M, N). The tolerance only
# leaves room for nondeterministic reductions (split-K matmuls, atomics in attention backward):
# a few tens of units in the last place of each dtype (eps: fp32 1.2e-7, fp16 9.8e-4 at 1.0,
# bf16 7.8e-3). The failures verify exists to catch are of order 1 (BACKENDS.md 7: 1.0).
GRAD_TOLERANCE: dict[str, float] = {
    "float64": 1e-5,
    "float32": 1e-5,
    "float16": 1e-2,
    "bfloat16": 2e-2,
}
"""Largest max-relative gradient error that counts as equal, by the model's loosest dtype."""

FLAT_FRACTION = 0.05
"""cpu_checkpointing: memory stops growing when it grows by less than this share of one block
input per block over the second half of the stack."""

PARTITION_SLACK = 1.25
"""partition: held checkpoint memory per block may be this many times 1/n of one block input
(plus FLAT_FRACTION of one block input for the odd small tensor)."""

MIN_BLOCKS = 4
"""Fewest measured blocks for a growth rate over the second half of the stack."""

STEP_SEED = 1234
"""Step k of both runs starts from seed STEP_SEED + k, so dropout draws the same masks plain and
under the policy (the caller's RNG state is put back afterwards)."""


# --- measurements (plain data) ---------------------------------------------------------------


@dataclass(frozen=True)
class RunMeasurement:
    """One model's numbers, all on the last step except the median step time."""

    held: tuple[int, ...]
    """Bytes of GPU memory allocated after each block's forward, above the step's start."""
    peak: int
    """Peak bytes of GPU memory allocated during the step (forward and backward), above its start."""
    step_time_s: float
    """Median wall time of one forward+backward step, in seconds (CUDA events)."""


@dataclass(frozen=True)
class GradDiff:
    """How one parameter's gradient under the policy differs from the plain run's."""

    name: str
    """Qualified parameter name."""
    error: float
    """max|g_policy - g_plain| / max|g_plain|; inf when not comparable (see `note`)."""
    note: str | None = None
    """Why the gradient is not comparable: `got no gradient under the policy`, ..."""


@dataclass(frozen=True)
class Measurements:
    """Everything `judge` needs, as plain numbers (no torch)."""

    blocks: tuple[str, ...]
    """Qualified names of the measured blocks, in forward order."""
    block_input_bytes: int
    """Bytes of one block input (median over blocks of the tensors each block is called with)."""
    plain: RunMeasurement
    """The model without the policy."""
    policy: RunMeasurement
    """The same model, same weights and inputs, with the policy applied."""
    grads: tuple[GradDiff, ...]
    """One entry per parameter that has a gradient in either run."""
    dtype: str
    """The loosest floating dtype of the parameters and inputs (`bfloat16`, `float32`, ...)."""
    steps: int = 3
    """Forward+backward steps run on each model."""
    mp_size: int = 1
    """Model-parallel world size of the `mpu` the policy was applied with (1 without one)."""
    host_pinned_bytes: int | None = None
    """Page-locked host memory the policy used for offloading (None: not measurable)."""
    host_pageable_bytes: int | None = None
    """Pageable host memory the policy used for offloading (None: not measurable)."""


@dataclass(frozen=True)
class Verdict:
    """Whether one promise of the policy held, in one sentence with numbers."""

    promise: str
    """`cpu_checkpointing`, `peak`, `partition` or `gradients`."""
    ok: bool
    """True when the promise held."""
    message: str
    """One sentence with the numbers that decided it."""


@dataclass(frozen=True)
class VerifyReport:
    """The measurements and a verdict per promise; `ok` when every promise held."""

    policy: Policy
    backend: str
    measurements: Measurements
    verdicts: tuple[Verdict, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every promise held."""
        return all(v.ok for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (non-finite numbers become null)."""
        m = self.measurements
        worst = worst_grad(m.grads)
        return {
            "ok": self.ok,
            "backend": self.backend,
            "policy": self.policy.model_dump(mode="json"),
            "dtype": m.dtype,
            "steps": m.steps,
            "mp_size": m.mp_size,
            "block_input_bytes": m.block_input_bytes,
            "blocks": [
                {"name": name, "plain_held_bytes": p, "policy_held_bytes": q}
                for name, p, q in zip(m.blocks, m.plain.held, m.policy.held)
            ],
            "peak_bytes": {"plain": m.plain.peak, "policy": m.policy.peak},
            "step_time_s": {"plain": m.plain.step_time_s, "policy": m.policy.step_time_s},
            "host_bytes": {"pinned": m.host_pinned_bytes, "pageable": m.host_pageable_bytes},
            "gradients": {
                "max_rel_error": _finite(worst.error) if worst else 0.0,
                "parameter": worst.name if worst else None,
                "tolerance": tolerance(m.dtype),
                "parameters": [
                    {**asdict(g), "error": _finite(g.error)} for g in m.grads
                ],
            },
            "verdicts": [asdict(v) for v in self.verdicts],
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def worst_grad(grads: Sequence[GradDiff]) -> GradDiff | None:
    """The parameter with the largest error (the first of equals, in parameter order)."""
    return max(grads, key=lambda g: g.error if not math.isnan(g.error) else math.inf, default=None)


def tolerance(dtype: str) -> float:
    """The gradient tolerance for `dtype`; 1e-5 for any dtype not in GRAD_TOLERANCE."""
    return GRAD_TOLERANCE.get(dtype, 1e-5)


# --- judgement (pure) -------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Decimal units for sentences: `0.26 GB`, `67.1 MB`, `12.0 kB`, `512 B`."""
    a = abs(n)
    if a >= 1e8:
        return f"{n / 1e9:.2f} GB"
    if a >= 1e5:
        return f"{n / 1e6:.1f} MB"
    if a >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n:.0f} B"


def _growth(held: Sequence[int]) -> tuple[float, int]:
    """Mean growth per block over the second half of the stack, and the half's first index.

    The mean over the span (not a median of steps) so that a policy checkpointing every other
    block, which grows in alternate steps, still shows its growth.
    """
    start = len(held) // 2
    return (held[-1] - held[start]) / (len(held) - 1 - start), start


def _judge_offload(m: Measurements) -> Verdict:
    n = len(m.blocks)
    if n < MIN_BLOCKS:
        return Verdict("cpu_checkpointing", False,
                       f"cpu_checkpointing cannot be checked on {n} block{'s' * (n != 1)}: "
                       f"it takes at least {MIN_BLOCKS} to see whether GPU memory stops growing")
    one = m.block_input_bytes
    growth, start = _growth(m.policy.held)
    span = f"blocks {m.blocks[start]} to {m.blocks[-1]}"
    if growth < FLAT_FRACTION * one:
        resident = m.policy.held[-1] / one
        return Verdict("cpu_checkpointing", True,
                       f"GPU memory stopped growing: {human_bytes(growth)} per block over {span} "
                       f"(limit {human_bytes(FLAT_FRACTION * one)}, 5% of one block input); "
                       f"{resident:.1f} block inputs stay on the GPU")
    ratio = growth / one
    size = ("the size of one block input" if 0.9 <= ratio <= 1.1
            else f"{ratio:.2f}x one block input")
    effect = ("the offload did not take effect" if ratio >= 0.9
              else "part of each block's activations stayed on the GPU")
    return Verdict("cpu_checkpointing", False,
                   f"cpu_checkpointing is on but GPU memory grew by {human_bytes(growth)} per "
                   f"block, {size}: {effect}")


def _judge_peak(policy: Policy, m: Measurements) -> Verdict:
    plain, ours = m.plain.peak, m.policy.peak
    # "Below" by more than noise: 5% of one block input, as for flat memory.
    margin = FLAT_FRACTION * m.block_input_bytes
    if ours < plain - margin:
        return Verdict("peak", True,
                       f"the peak fell from {human_bytes(plain)} to {human_bytes(ours)} "
                       f"({(plain - ours) / plain:.0%} lower)")
    what = "checkpointing" if policy.checkpoint.mode != "none" else "cpu_checkpointing"
    if ours < plain:
        return Verdict("peak", False,
                       f"{what} is on but the peak was {human_bytes(ours)}, only "
                       f"{human_bytes(plain - ours)} below the plain run's {human_bytes(plain)} "
                       "(less than 5% of one block input): the policy freed almost no "
                       "activation memory")
    return Verdict("peak", False,
                   f"{what} is on but the peak was {human_bytes(ours)}, not below the plain "
                   f"run's {human_bytes(plain)}: the policy freed no activation memory")


def _judge_partition(m: Measurements) -> Verdict:
    n = m.mp_size
    if n <= 1:
        return Verdict("partition", False,
                       f"partition is on but the model-parallel size is {n}: it shards nothing, "
                       "and DeepSpeed's partition path corrupts gradients there")
    if len(m.blocks) < MIN_BLOCKS:
        return Verdict("partition", False,
                       f"partition cannot be checked on {len(m.blocks)} blocks: it takes at "
                       f"least {MIN_BLOCKS}")
    one = m.block_input_bytes
    growth, _ = _growth(m.policy.held)
    limit = PARTITION_SLACK * one / n + FLAT_FRACTION * one
    if growth <= limit:
        return Verdict("partition", True,
                       f"held checkpoint memory grew by {human_bytes(growth)} per block, "
                       f"{growth / one:.2f} of one block input (about 1/{n} or less)")
    return Verdict("partition", False,
                   f"partition is on with model-parallel size {n} but held checkpoint memory grew "
                   f"by {human_bytes(growth)} per block, {growth / one:.2f} of one block input "
                   f"instead of about 1/{n}: the activations were not partitioned")


def _judge_gradients(m: Measurements) -> Verdict:
    tol = tolerance(m.dtype)
    worst = worst_grad(m.grads)
    if worst is None:
        return Verdict("gradients", False,
                       "gradients cannot be compared: no parameter got a gradient in either run")
    if worst.note is not None:
        return Verdict("gradients", False,
                       f"gradients differ from the plain run: {worst.name} {worst.note}")
    if worst.error <= tol:
        shown = "0" if worst.error == 0 else f"{worst.error:.1e} ({worst.name})"
        return Verdict("gradients", True,
                       f"gradients match the plain run: max relative error {shown}, within the "
                       f"{m.dtype} tolerance {tol:.0e}")
    return Verdict("gradients", False,
                   f"gradients differ from the plain run: max relative error {worst.error:.2g} in "
                   f"{worst.name}, above the {m.dtype} tolerance {tol:.0e}: a saved activation "
                   "was lost or changed")


def judge(policy: Policy, measurements: Measurements) -> list[Verdict]:
    """One verdict per promise the policy makes, from plain numbers (imports no torch).

    cpu_checkpointing: GPU memory stops growing per block; checkpointing or cpu_checkpointing:
    the peak is below the plain run's; partition: held checkpoint memory is about 1/n of one
    block input per block; always: gradients equal the plain run's within the dtype tolerance.
    """
    m = measurements
    if not (len(m.blocks) == len(m.plain.held) == len(m.policy.held)):
        raise VerifyError(
            f"measurements disagree: {len(m.blocks)} blocks but {len(m.plain.held)} plain and "
            f"{len(m.policy.held)} policy readings")
    if m.block_input_bytes <= 0:
        raise VerifyError("one block input has no bytes: the blocks take no tensor input, so "
                          "memory per block cannot be judged")
    out: list[Verdict] = []
    if policy.cpu_checkpointing:
        out.append(_judge_offload(m))
    if policy.checkpoint.mode != "none" or policy.cpu_checkpointing:
        out.append(_judge_peak(policy, m))
    if policy.partition:
        out.append(_judge_partition(m))
    out.append(_judge_gradients(m))
    return out


# --- the model factory -------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by `pkg.module:factory` (the `--model` flag)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise VerifyError(f"--model {spec!r}: write it as pkg.module:factory "
                          f"(for example {DEFAULT_MODEL})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise VerifyError(f"--model {spec!r}: cannot import {module_name}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise VerifyError(f"--model {spec!r}: {module_name} has no attribute {attr!r}") from e
    if not callable(obj):
        raise VerifyError(f"--model {spec!r}: {attr} is a {type(obj).__name__}, not a callable "
                          "factory returning (model, example_inputs)")
    return obj


def _build(factory: Callable[[], Any]) -> tuple[nn.Module, Any]:
    from torch import nn

    made = factory()
    if isinstance(made, tuple) and len(made) == 2:
        model, inputs = made
    else:
        model = made
        inputs = getattr(model, "example_inputs", None)
        if inputs is None:
            raise VerifyError(
                f"the model factory returned a {type(made).__name__}: return "
                "(model, example_inputs), or a model with an `example_inputs` attribute or method")
        if callable(inputs):
            inputs = inputs()
    if not isinstance(model, nn.Module):
        raise VerifyError(f"the model factory returned a {type(model).__name__} as the model, "
                          "not a torch.nn.Module")
    return model, inputs


def _split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise VerifyError(f"example inputs are a {type(inputs).__name__}: give a tensor, a tuple of "
                      "positional arguments or a dict of keyword arguments")


def _fresh(value: Any) -> Any:
    """A private copy of each tensor argument on the GPU, so one step cannot change the next
    step's inputs (DeepSpeed's cpu and partition paths empty a checkpoint's input: BACKENDS 1.4)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cuda", copy=True).requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def default_loss(output: Any) -> torch.Tensor:
    """Sum of squares of the first output tensor, in fp32.

    Nonlinear on purpose: with a linear loss the gradients do not depend on the output's
    values, and a forward that read a DeepSpeed-emptied input (BACKENDS 1.4) would pass.
    """
    tensors = _tensors(output)
    if not tensors:
        raise VerifyError("the model returned no tensor: pass loss_fn= to verify()")
    return tensors[0].float().square().sum()


# --- measurement (torch, CUDA) ----------------------------------------------------------------


def _seed_step(step: int) -> None:
    """Seed the CPU and every CUDA generator for `step`, the same in the plain and policy runs."""
    import torch

    seed = STEP_SEED + step
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def _caller_rng_kept() -> Iterator[None]:
    """Put the caller's CPU and CUDA RNG states back after the seeded runs."""
    import torch

    # Every device: _seed_step seeds them all. Named explicitly, so fork_rng does not warn.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def _measure(
    model: nn.Module,
    blocks: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    steps: int,
    input_sizes: list[int] | None = None,
) -> RunMeasurement:
    import torch

    try:
        modules = [model.get_submodule(name) for name in blocks]
    except AttributeError as e:
        raise VerifyError(f"cannot find a measured block in the model: {e}") from e
    held: list[int | None] = [None] * len(modules)
    state = {"recording": False, "baseline": 0}

    def after(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            # Only the first call in forward: a recompute in backward calls the block again.
            if state["recording"] and held[index] is None:
                held[index] = torch.cuda.memory_allocated() - state["baseline"]
        return hook

    def before(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, a: Any, k: Any) -> None:
            if state["recording"] and input_sizes is not None and input_sizes[index] < 0:
                input_sizes[index] = sum(t.numel() * t.element_size() for t in _tensors((a, k)))
        return hook

    handles = [m.register_forward_hook(after(i)) for i, m in enumerate(modules)]
    if input_sizes is not None:
        input_sizes[:] = [-1] * len(modules)
        handles += [m.register_forward_pre_hook(before(i), with_kwargs=True)
                    for i, m in enumerate(modules)]
    times: list[float] = []
    peak = 0
    try:
        for step in range(steps):
            last = step == steps - 1
            model.zero_grad(set_to_none=True)
            a, k = _fresh(args), _fresh(kwargs)
            held[:] = [None] * len(modules)
            _seed_step(step)
            torch.cuda.synchronize()
            state["baseline"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            state["recording"] = last
            try:
                output = model(*a, **k)
            finally:
                state["recording"] = False
            loss = loss_fn(output)
            loss.backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
            peak = torch.cuda.max_memory_allocated() - state["baseline"]
            del output, loss, a, k
    finally:
        for h in handles:
            h.remove()
    missing = [name for name, h in zip(blocks, held) if h is None]
    if missing:
        raise VerifyError(f"block {missing[0]} was never called in forward, so no memory was "
                          "measured after it")
    return RunMeasurement(tuple(int(h) for h in held if h is not None), int(peak),
                          statistics.median(times))


def _grad_diffs(plain: nn.Module, ours: nn.Module) -> tuple[GradDiff, ...]:
    import torch

    theirs = dict(ours.named_parameters())
    out: list[GradDiff] = []
    for name, p in plain.named_parameters():
        q = theirs.get(name)
        if q is None:
            raise VerifyError(f"the policy model has no parameter {name}: apply() must keep "
                              "parameter names unchanged")
        if p.grad is None and q.grad is None:
            continue
        if q.grad is None:
            out.append(GradDiff(name, math.inf, "got no gradient under the policy"))
            continue
        if p.grad is None:
            out.append(GradDiff(name, math.inf, "got a gradient under the policy but not plain"))
            continue
        g, h = p.grad.detach().float(), q.grad.detach().float()
        if not bool(torch.isfinite(h).all()):
            out.append(GradDiff(name, math.inf, "has a non-finite gradient under the policy"))
            continue
        diff = float((g - h).abs().max()) if g.numel() else 0.0
        scale = float(g.abs().max()) if g.numel() else 0.0
        if not math.isfinite(diff):
            out.append(GradDiff(name, math.inf, "has a non-finite gradient in the plain run"))
        elif scale == 0.0:
            out.append(GradDiff(name, 0.0 if diff == 0.0 else math.inf,
                                None if diff == 0.0 else "is zero plain but not under the policy"))
        else:
            out.append(GradDiff(name, diff / scale))
    return tuple(out)


_LOOSENESS = ("float64", "float32", "float16", "bfloat16")


def _loosest_dtype(model: nn.Module, inputs: Any) -> str:
    found = {str(t.dtype).removeprefix("torch.")
             for t in [*model.parameters(), *_tensors(inputs)] if t.is_floating_point()}
    ranked = [d for d in _LOOSENESS if d in found]
    return ranked[-1] if ranked else "float32"


def _mp_size(handle: Any, mpu: Any) -> int:
    """The model-parallel size the policy ran with: DeepSpeed's `mp_size` as `apply` read it back
    after configure(), else what DeepSpeed would read from `mpu` (a process group, as `apply`
    takes it, counts with its size)."""
    if handle.deepspeed is not None:
        return int(handle.deepspeed["state"]["mp_size"])
    if mpu is None:
        return 1
    # The runtime's own reading of `mpu`, so verify cannot judge a different size than it used.
    from actcfg._deepspeed_route import _as_mpu, model_parallel_size

    return model_parallel_size(_as_mpu(mpu))


def _pinned_pool_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator, where this torch reports them (>= 2.7)."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else int(stats().get("allocated_bytes.current", 0))


def _blocks(handle: Any, model: nn.Module) -> tuple[str, ...]:
    """What memory is measured after: the checkpointed modules, else the offload groups,
    else the model's top-level children."""
    if handle.checkpointed:
        return tuple(handle.checkpointed)
    if handle.offload is not None and handle.offload["groups"]:
        return tuple(handle.offload["groups"])
    return tuple(name for name, _ in model.named_children())


def _host_bytes(handle: Any, pool_before: int | None) -> tuple[int | None, int | None]:
    """Host memory the policy used: the offload engine's own account, else (DeepSpeed) what
    torch's pinned host allocator grew by; pageable memory is unknown then."""
    if handle.engine is not None:
        stats = handle.engine.stats
        return int(stats.pinned_bytes), int(stats.pageable_bytes)
    pool_after = _pinned_pool_bytes()
    if pool_before is None or pool_after is None:
        return None, None
    return max(0, pool_after - pool_before), None


def require_cuda() -> None:
    """Raise VerifyError unless torch is installed and sees a CUDA GPU."""
    try:
        import torch
    except ImportError as e:
        raise VerifyError("actcfg verify needs torch: pip install actcfg[torch]") from e
    if not torch.cuda.is_available():
        raise VerifyError("actcfg verify measures GPU memory and needs a CUDA GPU, but "
                          "torch.cuda.is_available() is False here: run it on a GPU machine")


def ensure_deepspeed_process_group() -> None:
    """Start a one-process NCCL group for DeepSpeed when no launcher started one.

    DeepSpeed's `configure` asks torch.distributed for the rank even on one GPU, so the CLI's
    `verify` of a DeepSpeed policy would otherwise fail before measuring anything. Under a
    launcher (WORLD_SIZE set) or with a group already up, nothing is done.
    """
    import socket

    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ:
        return
    try:
        import deepspeed
    except ImportError as e:
        raise VerifyError("this policy's backend is deepspeed: pip install actcfg[deepspeed]") from e
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl")


def verify(
    model_factory: Callable[[], Any],
    cfg: Any,
    *,
    inputs: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
    steps: int = 3,
    backend: Backend | str | None = None,
    mpu: Any = None,
    apply: Callable[..., Any] | None = None,
) -> VerifyReport:
    """Run the model plain and with the policy on the same weights and inputs; judge each promise.

    `cfg` is anything `actcfg.load` takes. `inputs` overrides the factory's example inputs;
    `loss_fn(output) -> scalar` defaults to the fp32 sum of squares of the first output.
    `apply` replaces `actcfg.runtime.apply` (tests inject broken ones); what it returns must
    have the `actcfg.runtime.AppliedPolicy` attributes verify reads: `checkpointed`, `offload`,
    `engine`, `deepspeed` and `remove()`. Raises VerifyError without a CUDA GPU: what is
    measured is GPU memory.
    """
    from actcfg.checker import load

    if steps < 1:
        raise VerifyError(f"steps must be at least 1, got {steps}")
    chosen = Backend.parse(backend) if backend is not None else None
    require_cuda()
    policy = load(cfg, backends=(chosen,) if chosen is not None else ())
    if apply is None:
        from actcfg.runtime import apply as default_apply

        apply = default_apply

    plain, example = _build(model_factory)
    ours, _ = _build(model_factory)
    for model in (plain, ours):
        if any(t.device.type != "cuda" for t in [*model.parameters(), *model.buffers()]):
            model.cuda()
    ours.load_state_dict(plain.state_dict())
    args, kwargs = _split_inputs(example if inputs is None else inputs)
    loss = loss_fn or default_loss

    handle = apply(ours, policy, backend=chosen, mpu=mpu)
    try:
        mp_size = _mp_size(handle, mpu)
        blocks = _blocks(handle, plain)
        if not blocks:
            raise VerifyError("the model has no submodules to measure memory after")
        sizes: list[int] = []
        with _caller_rng_kept():
            try:
                plain_run = _measure(plain, blocks, args, kwargs, loss, steps, sizes)
            except RuntimeError as e:
                raise VerifyError(f"the model failed without the policy: {e}") from e
            pool_before = _pinned_pool_bytes()
            try:
                policy_run = _measure(ours, blocks, args, kwargs, loss, steps)
            except RuntimeError as e:
                raise VerifyError(f"the model failed under the policy: {e}") from e
        grads = _grad_diffs(plain, ours)
        pinned, pageable = _host_bytes(handle, pool_before)
    finally:
        handle.remove()
    measurements = Measurements(
        blocks=blocks,
        block_input_bytes=int(statistics.median(sizes)),
        plain=plain_run,
        policy=policy_run,
        grads=grads,
        dtype=_loosest_dtype(plain, (args, kwargs)),
        steps=steps,
        mp_size=mp_size,
        host_pinned_bytes=pinned,
        host_pageable_bytes=pageable,
    )
    used = chosen or policy.backend
    return VerifyReport(policy, used.value, measurements, tuple(judge(policy, measurements)))
