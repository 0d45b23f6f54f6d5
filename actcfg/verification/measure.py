"""Measure a model plain and under a policy on the GPU, and judge: `verify()`.

Under torch.distributed with more than one rank (torchrun), each rank measures its own GPU
(`measure_here`), the ranks exchange their plain-data measurements (`gather_ranks`), and every
rank judges all of them alike, so all ranks reach the same verdict. Torch is imported inside the
functions, so `import actcfg.verification` stays light. Library code: nothing here prints or exits,
and no process group is started here (the CLI does that).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from actcfg.backends import Backend
from actcfg.errors import ActcfgError, VerifyError, install_command
from actcfg.verification.factory import build
from actcfg.verification.judge import judge_ranks
from actcfg.verification.report import GradDiff, Measurements, RunMeasurement, VerifyReport

if TYPE_CHECKING:
    import torch
    from torch import nn

    from actcfg.policy.schema import Policy

__all__ = [
    "BUILD_SEED",
    "STEP_SEED",
    "gather_ranks",
    "measure_here",
    "require_cuda",
    "verify",
]

STEP_SEED = 1234
"""Step k of both runs starts from seed STEP_SEED + k, so dropout draws the same masks plain and
under the policy (the caller's RNG state is put back afterwards)."""

BUILD_SEED = STEP_SEED - 1
"""The seed each model is built under: both builds, and every rank's, draw the same weights and
example inputs (tensor-parallel ranks hold the same activations; partition relies on it)."""


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


# --- measurement (torch, CUDA) ----------------------------------------------------------------


def _seed(seed: int) -> None:
    """Seed the CPU and every CUDA generator."""
    import torch

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _seed_step(step: int) -> None:
    """Seed the CPU and every CUDA generator for `step`, the same in the plain and policy runs."""
    _seed(STEP_SEED + step)


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
    compiled: bool = False,
    timed: Callable[[], None] | None = None,
) -> tuple[RunMeasurement, float | None]:
    """The run's measurement, and for a `compiled` model the milliseconds its warm-up took above
    as many settled steps (compiling; None when not compiled). `timed` is called once, when
    the warm-up is over and the measured steps begin."""
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
        # Under `compile: {scope: model}` dynamo would trace the hook; it reads the allocator,
        # so it runs eagerly between graphs (a break at each block, as the planner's probe).
        return torch.compiler.disable(hook) if compiled else hook

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

    def one_step(step: int, last: bool) -> None:
        nonlocal peak
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

    compile_ms = None
    try:
        if compiled:
            # torch.compile builds its graphs in the first steps (backward's at its first call):
            # timed steps come after they settle, as the planner timed the plan, and the time
            # above settled steps is reported as compiling, not as the policy's step time.
            from actcfg.runtime.compiling import warm_up

            compile_ms = warm_up(lambda: one_step(0, last=False))
            times.clear()
        if timed is not None:
            timed()
        for step in range(steps):
            one_step(step, last=step == steps - 1)
    finally:
        for h in handles:
            h.remove()
    missing = [name for name, h in zip(blocks, held) if h is None]
    if missing:
        raise VerifyError(f"block {missing[0]} was never called in forward, so no memory was "
                          "measured after it")
    return RunMeasurement(tuple(int(h) for h in held if h is not None), int(peak),
                          statistics.median(times)), compile_ms


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


def _mp_size(handle: Any) -> int:
    """The model-parallel size the policy ran with: DeepSpeed's `mp_size` as `apply` read it back
    after configure(); 1 for the torch backend, which takes no model-parallel unit."""
    return 1 if handle.deepspeed is None else int(handle.deepspeed.mp_size)


def _pinned_pool_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator, where this torch reports them (>= 2.7)."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else int(stats().get("allocated_bytes.current", 0))


def _blocks(handle: Any, model: nn.Module) -> tuple[str, ...]:
    """What memory is measured after: the modules the rules take, else the checkpointed
    modules, else the offload groups, else the model's top-level children."""
    if getattr(handle, "rules", None):
        return tuple(handle.ruled)
    if handle.checkpointed:
        return tuple(handle.checkpointed)
    if handle.offload is not None and handle.offload.groups:
        return tuple(handle.offload.groups)
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


def _held(handle: Any) -> dict[str, int | None]:
    """The offload engine's own count of device bytes it held at once, forward, backward and
    through a recompute, in the last step, and its keep_last (all None without actcfg's engine)."""
    engine = getattr(handle, "engine", None)
    if engine is None:
        return {"forward_held_bytes": None, "backward_held_bytes": None,
                "recompute_held_bytes": None, "keep_last": None}
    st = engine.stats
    return {"forward_held_bytes": int(st.most_forward_device_bytes),
            "backward_held_bytes": int(st.most_backward_device_bytes),
            "recompute_held_bytes": int(st.most_recompute_device_bytes),
            "keep_last": int(engine.keep_last)}


class _Counted:
    """The runtime's recompute counter when the measured steps began (a compiled policy's
    warm-up steps recompute too, and are not the measured steps)."""

    def __init__(self, handle: Any) -> None:
        self.counters = getattr(handle, "counters", None)
        self.baseline = 0

    def start(self) -> None:
        self.baseline = 0 if self.counters is None else self.counters.recomputes


def _effect(handle: Any, steps: int, baseline: int = 0) -> tuple[int | None, int | None]:
    """What the runtime counted: bytes its engine offloaded in the last step, and checkpointed
    modules run again per measured backward (the counters cover every step under the policy;
    `baseline` is their count before the measured steps)."""
    engine = getattr(handle, "engine", None)
    offloaded = None if engine is None else int(engine.stats.offloaded_bytes)
    counters = getattr(handle, "counters", None)
    recomputes = ((counters.recomputes - baseline) // steps
                  if counters is not None and handle.checkpointed else None)
    return offloaded, recomputes


def require_cuda() -> None:
    """Raise VerifyError unless torch is installed and sees a CUDA GPU."""
    try:
        import torch
    except ImportError as e:
        raise VerifyError(f"actcfg verify needs torch, which is not installed: {install_command('torch')}") from e
    if not torch.cuda.is_available():
        raise VerifyError("actcfg verify measures GPU memory and needs a CUDA GPU, but "
                          "torch.cuda.is_available() is False here: run it on a GPU machine")


def _world_size(group: Any = None) -> int:
    """Ranks in `group` (the default group when None); 1 without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def gather_ranks(outcome: Measurements | str, group: Any = None) -> tuple[Measurements, ...]:
    """Every rank's measurements in rank order, from each rank's `outcome`: its measurements,
    or the sentence saying why it measured nothing.

    Collective over `group` (the default group): every rank must call it, also a rank that
    failed, so that none waits for it. Measurements travel as plain data (all_gather_object);
    with NCCL, the current CUDA device must be this rank's. Raises VerifyError, on every rank
    alike, when any rank failed. One process: `(outcome,)`.
    """
    world = _world_size(group)
    if world == 1:
        if isinstance(outcome, str):
            raise VerifyError(outcome)
        return (outcome,)
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome, group=group)
    failed = [(rank, text) for rank, text in enumerate(gathered) if isinstance(text, str)]
    if failed:
        rank, text = failed[0]
        more = "" if len(failed) == 1 else (
            f" (ranks {', '.join(str(r) for r, _ in failed)} of {world} failed)")
        raise VerifyError(f"rank {rank} of {world} measured nothing{more}: {text}")
    return tuple(gathered)


def measure_here(
    model_factory: Callable[[], Any],
    policy: Policy,
    *,
    backend: Backend | None = None,
    inputs: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
    steps: int = 3,
    mpu: Any = None,
    apply: Callable[..., Any] | None = None,
) -> Measurements:
    """This process's measurements of the model plain and under `policy` on its current CUDA
    device, not judged (`verify` takes the parameters' meaning)."""
    if apply is None:
        from actcfg.api import apply as default_apply

        apply = default_apply

    with _caller_rng_kept():
        _seed(BUILD_SEED)
        plain, example = build(model_factory)
        _seed(BUILD_SEED)
        ours, _ = build(model_factory)
    for model in (plain, ours):
        if any(t.device.type != "cuda" for t in [*model.parameters(), *model.buffers()]):
            model.cuda()
    ours.load_state_dict(plain.state_dict())
    from actcfg.runtime.step import default_loss, split_inputs

    try:
        args, kwargs = split_inputs(example if inputs is None else inputs)
    except VerifyError:
        raise
    except ActcfgError as e:
        raise VerifyError(str(e)) from e
    loss = loss_fn or default_loss

    handle = apply(ours, policy, backend=backend, mpu=mpu)
    try:
        mp_size = _mp_size(handle)
        blocks = _blocks(handle, plain)
        if not blocks:
            raise VerifyError("the model has no submodules to measure memory after")
        sizes: list[int] = []
        with _caller_rng_kept():
            try:
                plain_run, _ = _measure(plain, blocks, args, kwargs, loss, steps, sizes)
            except RuntimeError as e:
                raise VerifyError(f"the model failed without the policy: {e}") from e
            pool_before = _pinned_pool_bytes()
            counted = _Counted(handle)
            compiled = getattr(handle, "compiled", None) is not None
            try:
                policy_run, compile_ms = _measure(ours, blocks, args, kwargs, loss, steps,
                                                  compiled=compiled, timed=counted.start)
            except RuntimeError as e:
                raise VerifyError(f"the model failed under the policy: {e}") from e
        grads = _grad_diffs(plain, ours)
        pinned, pageable = _host_bytes(handle, pool_before)
        offloaded, recomputes = _effect(handle, steps, counted.baseline)
        held = _held(handle)
    finally:
        handle.remove()
    return Measurements(
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
        offloaded_bytes=offloaded,
        recomputes=recomputes,
        compile_ms=compile_ms,
        **held,
    )


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
    group: Any = None,
) -> VerifyReport:
    """Run the model plain and with the policy on the same weights and inputs; judge each promise.

    `cfg` is anything `actcfg.load` takes. `inputs` overrides the factory's example inputs;
    `loss_fn(output) -> scalar` defaults to the fp32 sum of squares of the first output.
    `apply` replaces `actcfg.apply` (tests inject broken ones); what it returns must
    have the `actcfg.AppliedPolicy` attributes verify reads: `checkpointed`, `offload`,
    `engine`, `deepspeed`, `counters` and `remove()`. Raises VerifyError without a CUDA GPU:
    what is measured is GPU memory. A DeepSpeed policy needs torch.distributed initialised
    (the CLI starts a one-process group when no launcher did).

    On a torch.distributed group of more than one rank (`group`, default the whole world),
    call it on every rank, each with its own current CUDA device: each rank measures, the
    measurements are gathered, and every rank returns the same report, judged over all ranks
    (`VerifyReport.ranks`). The model is built under one seed, so every rank holds the same
    weights and inputs, as tensor-parallel ranks do; for `partition`, pass the model-parallel
    group as `mpu=`.
    """
    from actcfg.policy.checker import load

    if steps < 1:
        raise VerifyError(f"steps must be at least 1, got {steps}")
    chosen = Backend.parse(backend) if backend is not None else None
    require_cuda()
    policy = load(cfg, backends=(chosen,) if chosen is not None else ())
    outcome: Measurements | str
    failure: Exception | None = None
    if _world_size(group) == 1:
        outcome = measure_here(model_factory, policy, backend=chosen, inputs=inputs,
                               loss_fn=loss_fn, steps=steps, mpu=mpu, apply=apply)
    else:
        try:
            outcome = measure_here(model_factory, policy, backend=chosen, inputs=inputs,
                                   loss_fn=loss_fn, steps=steps, mpu=mpu, apply=apply)
        except Exception as e:  # every rank must reach the gather, or the others wait forever
            failure = e
            outcome = str(e) if isinstance(e, ActcfgError) else f"{type(e).__name__}: {e}"
    try:
        ranks = gather_ranks(outcome, group)
    except VerifyError as e:
        if failure is not None:
            raise e from failure  # this rank's own traceback stays attached
        raise
    used = chosen or policy.backend
    return VerifyReport(policy, used.value, ranks[0], tuple(judge_ranks(policy, ranks)),
                        ranks if len(ranks) > 1 else ())
