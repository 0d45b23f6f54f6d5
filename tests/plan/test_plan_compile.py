"""`compile:` beside `memory_budget`: a plan profiled under torch.compile, per block or whole, and
applied compiled the same way (actcfg.runtime.compiling).

On the CPU with torch.compile's `aot_eager` backend: it traces autograd and partitions the
saved tensors as inductor's pipeline does, without a C compiler. The compiled graphs save other
tensors than eager mode (the checkpointed blocks here keep 7 KiB each compiled, 2 KiB eager), so
byte counts tell a compiled profile from an eager one. CUDA (inductor) at the end.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import actcfg  # noqa: E402
from actcfg.errors import PlanError, PolicyApplyError  # noqa: E402
from actcfg.plan import plan_model, solve  # noqa: E402
from actcfg.plan.saved import saved_bytes  # noqa: E402
from actcfg.policy.checker import load  # noqa: E402
from actcfg.api import _apply_trial  # noqa: E402
from _helpers import (assert_grads_close, assert_grads_within, grads_of, offload_blocks, small_blocks,  # noqa: E402
                      train_step)

BLOCKS = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def policy(scope: str, budget: str = "80KiB", backend: str = "aot_eager") -> dict:
    return {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
            "memory_budget": budget, "compile": {"scope": scope, "backend": backend}}


def rules(mode: str, scope: str | None) -> dict:
    cfg = {"version": 1, "checkpoint": {"mode": "rules", "rules": [{"modules": ["Block"], "mode": mode}]}}
    if scope is not None:
        cfg["compile"] = {"scope": scope, "backend": "aot_eager"}
    return cfg


def counted(model, x, cfg) -> list[int]:
    """What each block saves, counted with the profile's own hooks, under the policy `cfg`."""
    blocks = [model.get_submodule(n) for n in BLOCKS]
    with actcfg.apply(model, cfg):
        return saved_bytes(model, blocks, (x,), {})


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_a_compiled_plan_is_profiled_compiled_fits_and_trains_like_plain(scope):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    plain, x = small_blocks(4)
    want = train_step(plain, x)
    model, _ = small_blocks(4)
    budget = 80 * 2**10
    counters.clear()
    planned = plan_model(model, load(policy(scope)), x, apply=_apply_trial)
    assert counters["stats"]["unique_graphs"] >= 1  # the trials really compiled
    prof = planned.profile
    assert prof.compiled == f"{scope} with aot_eager"
    assert prof.compile_ms > 0 and prof.profile_ms > 0  # compile time reported apart
    report = planned.report
    assert (report.compiled, report.compile_ms, report.profile_ms) == \
        (prof.compiled, prof.compile_ms, prof.profile_ms)
    assert f"compiled ({scope} with aot_eager)" in report.summary()
    # The profile's counts are the compiled graphs' saved tensors, not eager mode's.
    compiled_full = counted(model, x, rules("full", scope))
    eager_full = counted(model, x, rules("full", None))
    assert compiled_full != eager_full
    assert [b.options["full"].held for b in prof.blocks] == compiled_full
    # The plan fits on the CPU estimate path, and checkpoints something (plain is 122.5 KiB).
    assert report.predicted_peak <= budget < prof.plain_peak
    assert any(c != "keep" for _, c in report.choices)
    # The plan file says compile; applying it compiles what was profiled.
    assert planned.policy.compile == load(policy(scope)).compile
    assert f"compile: {{scope: {scope}, backend: aot_eager}}" in report.policy_yaml
    assert load(report.policy_yaml) == planned.policy
    handle = actcfg.apply(model, report.policy_yaml)
    try:
        assert handle.compiled.to_json() == {
            "scope": scope, "backend": "aot_eager",
            "modules": list(BLOCKS) if scope == "blocks" else [""]}
        assert "torch.compile of" in handle.summary()
        for _ in range(2):
            got = train_step(model, x)
        assert_grads_close(got, want, 1e-5)
    finally:
        handle.remove()
    # remove() takes the compiled forwards off: the model is eager again.
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert_grads_close(train_step(model, x), want, 1e-5)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_a_compiled_profile_times_each_choice_in_a_few_steps(scope):
    """Per choice one step that compiles, then the steady probed step it reads (the first that
    compiles nothing: `_steady`) and one unprobed: three, where the warm-up that waited for the
    step time to stop falling ran four (`scope: blocks`, 15 model calls for three choices with
    the counting forwards) or six and more (`scope: model`, 23-25). The profile says so by
    part (`parts_steps`), as the benchmark reports it."""
    torch._dynamo.reset()
    model, x = small_blocks(4)
    steps: list[int] = []
    model.register_forward_pre_hook(lambda module, args: steps.append(1))
    planned = plan_model(model, load(policy(scope)), x, apply=_apply_trial)
    choices = planned.profile.choices()
    assert choices == ("keep", "selective", "full")
    # a counting forward per choice; per run one warm-up (it compiles), a probed and an
    # unprobed step
    want = {"counts": 3, **{c: 2 for c in choices}, "warm_ups": 3}
    assert planned.profile.parts_steps == want
    assert planned.report.parts_steps == want
    assert len(steps) == sum(want.values()) == 12
    assert planned.profile.compile_ms > 0 and planned.report.predicted_peak <= 80 * 2**10
    torch._dynamo.reset()


def test_a_step_that_compiles_is_warm_up_and_the_first_that_compiles_nothing_is_read():
    """`_steady`: a recompile (here a second shape, which dynamo then marks dynamic) is warm-up
    too; the call after it compiles nothing and is the reading. What the compiling calls took
    beyond it is compile time."""
    from actcfg.plan.profile import _steady

    torch._dynamo.reset()
    double = torch.compile(lambda t: t * 2, backend="aot_eager")
    sizes = iter([2, 3, 4, 5])
    calls: list[int] = []

    def step() -> int:
        n = next(sizes)
        calls.append(n)
        double(torch.ones(n))
        return n

    spent: list[float] = []
    got, wall_ms = _steady(step, spent)
    assert (got, calls) == (4, [2, 3, 4])  # compiled for 2, recompiled for 3, steady at 4
    assert wall_ms > 0 and len(spent) == 1 and spent[0] >= 0
    torch._dynamo.reset()


def _eager_profile():
    """A profile of the small stack (eager: the loop under test takes the measurement as given),
    and a plan halfway between its smallest peak and plain's, which mixes choices."""
    from actcfg.plan import smallest_peak

    torch._dynamo.reset()
    model, x = offload_blocks(4)  # activations large enough that the choices' peaks differ
    eager = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1GiB"}
    prof = plan_model(model, load(eager), x, apply=_apply_trial).profile
    budget = (smallest_peak(prof) + prof.plain_peak) // 2
    return model, prof, solve(prof, budget)


def test_a_whole_model_plan_measured_over_its_budget_is_solved_again_below_what_its_prediction_missed():
    """`_measured_whole` (CUDA only in use) with the measurement given: the first plan reads
    one byte over the budget, the next is solved below the budget by that miss, and with the
    same miss it fits; its peak is the measured one. Its two steps per plan are planning (here
    1 ms each, as measured), the rest of its time compiling."""
    from actcfg.plan import _measured_whole

    model, prof, first = _eager_profile()
    budget = first.budget
    miss = budget - first.peak + 1  # the first plan measures one byte over the budget
    seen: list[dict[str, str]] = []

    def measured(rules) -> tuple[float, int]:
        seen.append({m: r.mode for r in rules.checkpoint.rules for m in r.modules})
        plan = first if len(seen) == 1 else solve(prof, first.peak - 1)
        time.sleep(0.005)  # longer than its two steps at 1 ms
        return 1.0, plan.peak + miss

    plan, after = _measured_whole(model, load(policy("model", str(budget))), prof, first, measured)
    assert len(seen) == 2 and seen[0] != seen[1]  # a different plan, each measured once
    assert plan.choices != first.choices and plan.budget == budget
    assert plan.peak == solve(prof, first.peak - 1).peak + miss <= budget
    assert after.compile_ms > prof.compile_ms
    assert after.parts_steps == {**prof.parts_steps, "measured_whole": 4}
    assert after.parts_ms["measured_whole"] == 4.0 and list(after.parts_ms)[-2:] == ["measured_whole", "rest"]
    assert after.profile_ms == pytest.approx(prof.profile_ms + 4.0)


def test_a_whole_model_plan_that_never_fits_is_refused_saying_so():
    from actcfg.plan import _measured_whole

    model, prof, first = _eager_profile()
    calls: list[int] = []

    def measured(rules) -> tuple[float, int]:
        calls.append(1)
        return 1.0, first.budget + 2**20  # every plan a MiB over
    with pytest.raises(PlanError, match=r"compile: \{scope: model\}: "):
        _measured_whole(model, load(policy("model", str(first.budget))), prof, first, measured)
    assert 1 <= len(calls) <= 3


@pytest.mark.slow
def test_apply_plans_compiled_in_one_call_and_logs_the_compile_time():
    torch._dynamo.reset()
    plain, x = small_blocks(4)
    want = train_step(plain, x)
    model, _ = small_blocks(4)
    with actcfg.apply(model, policy("blocks"), inputs=x) as handle:
        assert handle.plan.compiled == "blocks with aot_eager" and handle.plan.compile_ms > 0
        assert handle.compiled.modules == BLOCKS
        assert_grads_close(train_step(model, x), want, 1e-5)
        assert handle.report()["compile"]["backend"] == "aot_eager"
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_profile_in_which_dynamo_compiled_nothing_is_refused_not_planned(monkeypatch):
    """dynamo runs a frame eagerly when it gives up (a recompile limit, a skipped frame, or
    here, switched off): the plan would then be an eager plan labelled compiled."""
    from actcfg.errors import PlanError

    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    model, x = small_blocks(2)
    with pytest.raises(PlanError, match=r"^compile: \{scope: blocks, backend: aot_eager\} asks for a "
                                        r"profile under torch\.compile, and torch\.compile built no graph"):
        plan_model(model, load(policy("blocks")), x, apply=_apply_trial)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_an_unknown_compile_backend_is_refused_naming_the_field():
    model, _ = small_blocks(2)
    cfg = {"version": 1, "checkpoint": {"mode": "rules", "rules": [{"modules": ["Block"], "mode": "full"}]},
           "compile": {"scope": "blocks", "backend": "no_such_backend"}}
    with pytest.raises(PolicyApplyError, match=r"^compile\.backend: torch\.compile refused backend "
                                               r"'no_such_backend': "):
        actcfg.apply(model, cfg)
    # nothing stays applied: the model carries no policy and applies again
    assert all("forward" not in m.__dict__ for m in model.modules())
    actcfg.apply(model, rules("full", None)).remove()


# --- CUDA: inductor, measured memory (the lead runs these on the H200) -----------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# With the whole model compiled, the profile reads the blocks with the graph broken at them, and
# inductor partitions the whole graph otherwise: the plan is measured compiled whole and solved
# again below what its prediction missed (actcfg.plan._measured_whole). On the H200 the check's
# first version (the budget lowered by the overshoot only) refused every plan at this budget
# (733.6 MiB, measured up to 753.8); the version that solves again at the budget less the miss
# passed there (2026-12-02, torch 2.11).
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_on_the_gpu_a_compiled_plan_fits_its_budget_with_plain_gradients(scope):
    from actcfg.plan.profile import measure_steps
    from actcfg.probes import blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = blocks(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)
    reference = blocks(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)[0]
    reference.load_state_dict(model.state_dict())
    loss = lambda out: out.float().square().sum()  # noqa: E731
    reference.zero_grad(set_to_none=True)
    loss(torch.compile(reference)(x)).backward()
    want = grads_of(reference, as_float=True)
    del reference
    spec = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
            "compile": {"scope": scope}}
    # The budget halfway between every block checkpointed and plain, both compiled.
    with actcfg.apply(model, {**rules("full", None), "compile": {"scope": scope}}):
        _, full_peak = measure_steps(model, x, loss_fn=loss)
    with actcfg.apply(model, {**rules("none", None), "compile": {"scope": scope}}):
        _, plain_peak = measure_steps(model, x, loss_fn=loss)
    assert full_peak < plain_peak
    budget = (full_peak + plain_peak) // 2
    with actcfg.apply(model, {**spec, "memory_budget": budget}, inputs=x, loss_fn=loss) as handle:
        assert handle.plan.compiled == f"{scope} with inductor" and handle.plan.compile_ms > 0
        assert handle.plan.predicted_peak <= budget
        # Steps by part: per run its count (keep, selective, full), at least one step that
        # compiles (inductor may autotune in a later one), the probed step and, where the probe
        # cost keep more than PROBE_CHEAP, an unprobed one (keep always runs it).
        calls = handle.plan.parts_steps
        runs = [c for c in calls if c not in ("counts", "warm_ups", "measured_whole")]
        assert calls["counts"] == 3 and calls["keep"] == 2, calls
        # A run whose graphs the cache already held (full_offload's, after full's) compiles
        # nothing and is read at its first step (docs/compile.md, open): one warm-up fewer.
        assert all(calls[c] in (1, 2) for c in runs) and calls["warm_ups"] >= len(runs) - 1, calls
        assert ("measured_whole" in calls) == (scope == "model")  # two steps per plan measured whole
        _, peak = measure_steps(model, x, loss_fn=loss)
        assert peak <= budget, (peak, budget, handle.plan.summary())
        model.zero_grad(set_to_none=True)
        loss(model(x)).backward()
        got = grads_of(model, as_float=True)
    assert_grads_within(got, want, 2e-2)  # bf16: compiled with and without checkpointing round alike
    torch._dynamo.reset()
