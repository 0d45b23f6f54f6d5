"""actcfg.plan.solve on synthetic profiles: exact choices on hand-checkable cases, the same
optimum as trying every plan, monotone in the budget, never above it, and offload only where it
lowers the peak. No torch."""

from __future__ import annotations

import dataclasses
import itertools
import random
import subprocess
import sys

import pytest

import actcfg
from actcfg.errors import PlanError
from actcfg.plan import CHOICES, OFFLOADS, BlockProfile, Option, Profile, predict, smallest_peak, solve
from actcfg.plan.model import COUNTERPART
from actcfg.plan.write import policy_text
from actcfg.policy.schema import Policy


def _profile(blocks: list[dict[str, Option]], *, turn: int = 3, f: float = 1.0, g: float = 2.0,
             gbps: float = 1e-5, after: float = 0.5, before: float = 0.5) -> Profile:
    """Blocks of forward f, backward g ms; copies of 10 bytes take 1 ms at the default bandwidth."""
    return Profile(
        blocks=tuple(BlockProfile(f"blocks.{i}", f, g, opts) for i, opts in enumerate(blocks)),
        plain_step_ms=100.0, plain_peak=0, turn_peak=turn, forward_after_ms=after,
        backward_before_ms=before, d2h_gbps=gbps, h2d_gbps=gbps, device="cpu")


def _keep_full(recompute: float) -> dict[str, Option]:
    """A block of 10 bytes of activations and a 1-byte input: keep or full."""
    return {
        "keep": Option(held=10, forward_peak=10, backward_peak=12),
        "full": Option(held=1, forward_peak=10, backward_peak=12, recompute_ms=recompute,
                       extra_ms=recompute),
    }


HAND = _profile([_keep_full(1.0), _keep_full(1.5), _keep_full(0.5)])


@pytest.mark.parametrize(("budget", "choices", "peak", "extra"), [
    # all kept: blocks need 12, 22, 32 in turn; the turn 30 + 3
    (33, ("keep", "keep", "keep"), 33, 0.0),
    # one block checkpointed: the cheapest recompute (block 2) still peaks at 20 + 12
    (32, ("keep", "keep", "full"), 32, 0.5),
    # under 32 block 2's own backward (20 + 12) is too much: block 0 goes (1 + 10 + 12 = 23)
    (25, ("full", "keep", "keep"), 24, 1.0),
    (20, ("full", "full", "keep"), 15, 2.5),
    (14, ("full", "full", "full"), 14, 3.0),
])
def test_exact_choices_on_a_hand_checkable_stack(budget, choices, peak, extra):
    plan = solve(HAND, budget)
    assert plan.choices == choices
    assert (plan.peak, plan.step_ms) == (peak, 100.0 + extra)
    assert plan.max_inflight == 1 and plan.kept_at_turn == 0
    assert predict(HAND, choices) == (100.0 + extra, peak)


def test_no_plan_fits_says_so_with_the_smallest_peak():
    # Sizes in a unit that shows them: this read "0.0 MiB ... raise to at least 0.0 MiB" (issue 20).
    with pytest.raises(PlanError, match=r"^no plan fits memory_budget 13 B: the smallest peak any choice "
                       r"of keep, full per module reaches is 14 B \(plain: 0 B\), with full on blocks\.0, "
                       r"blocks\.1, blocks\.2\. Raise memory_budget to at least 14 B, or plan over more or "
                       r"finer modules \(`checkpoint\.modules` or their parts, `checkpoint\.submodules`\)$") as info:
        solve(HAND, 13)
    assert info.value.smallest_peak == 14 == smallest_peak(HAND)


def test_the_smallest_peak_is_a_budget_solve_accepts_where_only_a_mix_reaches_it():
    """A mix leaves MIXED_HEADROOM of its budget free, so its own peak as the budget was refused:
    smallest_peak said the peak of full, full_offload, full, full on test_profile's CPU chain
    (14680072) and solve refused that budget. Here a mix (keep, full) peaks at 22 MB and every
    uniform plan higher (full: block 0's backward, 30 MB; keep: the turn, 23 MB)."""
    mb = 1_000_000
    profile = _profile([
        {"keep": Option(held=10 * mb, forward_peak=10 * mb, backward_peak=12 * mb),
         "full": Option(held=1 * mb, forward_peak=10 * mb, backward_peak=30 * mb, recompute_ms=1.0,
                        extra_ms=1.0)},
        {"keep": Option(held=10 * mb, forward_peak=10 * mb, backward_peak=12 * mb),
         "full": Option(held=1 * mb, forward_peak=10 * mb, backward_peak=12 * mb, recompute_ms=1.0,
                        extra_ms=1.0)},
    ], turn=3 * mb)
    assert predict(profile, ("keep", "full"))[1] == 22 * mb
    budget = smallest_peak(profile)
    assert 22 * mb < budget < 23 * mb  # the mix's peak and its headroom, below every uniform plan
    plan = solve(profile, budget)
    assert (plan.choices, plan.peak) == (("keep", "full"), 22 * mb)
    with pytest.raises(PlanError) as info:
        solve(profile, budget - 1)  # the smallest: one byte less fits nothing
    assert info.value.smallest_peak == budget


def _random_block(rng: random.Random) -> dict[str, Option]:
    a = rng.randint(20, 100)  # activations
    i = rng.randint(1, 10)  # input
    s = rng.randint(i, a)  # selective keeps the input and some op outputs
    grads = rng.randint(0, 30)
    rec = rng.uniform(0.5, 3.0)
    sel = rng.uniform(0.0, rec)
    stays = rng.randint(0, 5)
    return {
        "keep": Option(held=a, forward_peak=a, backward_peak=a + grads),
        "selective": Option(held=s, forward_peak=a, backward_peak=a + grads, recompute_ms=sel, extra_ms=sel),
        "full": Option(held=i, forward_peak=a, backward_peak=a + grads, recompute_ms=rec, extra_ms=rec),
        "full_offload": Option(held=0, moved=i, forward_peak=a, backward_peak=a + grads,
                               recompute_ms=rec, extra_ms=rec + rng.uniform(0, 0.2)),
        "offload": Option(held=stays, moved=a - stays, forward_peak=a, backward_peak=a + grads,
                          extra_ms=rng.uniform(0, 0.2)),
    }


def _random_profile(seed: int, n: int) -> Profile:
    rng = random.Random(seed)
    return _profile([_random_block(rng) for _ in range(n)], turn=rng.randint(0, 50),
                    f=rng.uniform(0.5, 3), g=rng.uniform(1, 6), gbps=rng.uniform(2e-5, 2e-4),
                    after=rng.uniform(0, 2), before=rng.uniform(0, 2))


def _same_optimum_as_every_plan(profile: Profile) -> None:
    """`solve` and `smallest_peak` on a 4-block profile agree with trying every plan."""
    plans = [(predict(profile, cs, m), cs, m)
             for cs in itertools.product(profile.choices(), repeat=4) for m in (1, 2)]
    lo = min(peak for (_, peak), _, _ in plans)
    hi = max(peak for (_, peak), _, _ in plans)
    for budget in (lo, (lo + hi) // 2, hi):
        best = min(step for (step, peak), _, _ in plans if peak <= budget)
        plan = solve(profile, budget)
        assert plan.peak <= budget
        assert plan.step_ms == pytest.approx(best, abs=1e-9)
    assert smallest_peak(profile) == min(peak for (_, peak), _, m in plans if m == 1)


@pytest.mark.parametrize("seed", range(6))
def test_the_dynamic_program_finds_the_same_optimum_as_trying_every_plan(seed):
    _same_optimum_as_every_plan(_random_profile(seed, 4))


def _shared(profile: Profile, nbytes: int) -> Profile:
    """`profile` with a storage of `nbytes` every block saves, counted to block 0 (a Llama's
    rotary tables: `BlockProfile.shared_in`)."""
    blocks = tuple(dataclasses.replace(b, shared_out=nbytes if i == 0 else 0, shared_in=0 if i == 0 else nbytes)
                   for i, b in enumerate(profile.blocks))
    return dataclasses.replace(profile, blocks=blocks)


def test_a_storage_the_first_block_moves_and_a_later_one_keeps_in_place_is_held_by_that_one():
    """Block 0 counts the shared storage (7 bytes); where it offloads, the lowest block above it
    that keeps the storage in place holds it from its forward through its backward (the turn
    too), and no block below it does; where block 0 keeps it, it is in block 0's bytes alone."""
    shared = _shared(_profile([_keep_full(1.0), _keep_full(1.0), _keep_full(1.0)], gbps=0.0), 7)
    plain = _profile([_keep_full(1.0)] * 3, gbps=0.0)
    offload = {"keep": Option(held=10, forward_peak=10, backward_peak=12),
               "full": Option(held=1, forward_peak=10, backward_peak=12, recompute_ms=1.0, extra_ms=1.0),
               "offload": Option(held=2, moved=8, forward_peak=10, backward_peak=12, extra_ms=0.5)}
    shared = dataclasses.replace(shared, blocks=tuple(dataclasses.replace(b, options=offload)
                                                      for b in shared.blocks))
    plain = dataclasses.replace(plain, blocks=tuple(dataclasses.replace(b, options=offload)
                                                    for b in plain.blocks))
    for choices, extra in [(("offload", "keep", "keep"), 7),  # block 1 holds it: the turn sees it
                           (("offload", "offload", "full"), 7),  # block 2 does
                           (("offload", "offload", "offload"), 0),  # moved, never kept in place
                           (("keep", "offload", "keep"), 0),  # block 0's bytes hold it
                           (("full", "keep", "offload"), 0)]:
        assert predict(shared, choices)[1] == predict(plain, choices)[1] + extra, choices
    # offload, keep, keep: the turn, 2 + 17 + 10 + 3 = 32
    assert predict(shared, ("offload", "keep", "keep"))[1] == 32
    # offload, full, full: block 1's backward, block 0's reload beside it: 2 + 8 + 7 + 12 = 29
    assert predict(shared, ("offload", "full", "full"))[1] == 29


@pytest.mark.parametrize("seed", range(4))
def test_the_dynamic_program_counts_a_shared_storage_as_predict_does(seed):
    _same_optimum_as_every_plan(_shared(_random_profile(300 + seed, 4), 6))


@pytest.mark.parametrize("seed", range(4))
def test_monotone_in_the_budget_and_never_above_it(seed):
    profile = _random_profile(100 + seed, 12)
    lowest = min(smallest_peak(profile, m) for m in (1, 2))
    top = predict(profile, ("keep",) * 12)[1]
    times = []
    for k in range(13):
        budget = lowest + (top - lowest) * k // 12
        plan = solve(profile, budget)
        assert plan.peak <= budget
        assert (plan.step_ms, plan.peak) == predict(profile, plan.choices, plan.max_inflight)
        times.append(plan.step_ms)
    assert times == sorted(times, reverse=True)
    assert solve(profile, top).choices == ("keep",) * 12  # everything fits: nothing to pay for


@pytest.mark.parametrize("seed", range(4))
def test_offload_only_where_it_lowers_the_peak(seed):
    """Every offloaded block's on-device twin (same recompute, no copies) would not fit."""
    profile = _random_profile(200 + seed, 8)
    lowest = smallest_peak(profile)
    top = predict(profile, ("keep",) * 8)[1]
    seen = 0
    for k in range(9):
        budget = lowest + (top - lowest) * k // 8
        plan = solve(profile, budget)
        for b, c in enumerate(plan.choices):
            if c in OFFLOADS:
                seen += 1
                swapped = list(plan.choices)
                swapped[b] = COUNTERPART[c]
                assert predict(profile, swapped, plan.max_inflight)[1] > budget, (budget, plan.choices, b)
    assert seen  # the tight budgets needed some offload


def test_no_offload_where_the_turn_sets_the_peak():
    """Offloading block 0 would drop its held bytes, but the peak is the head at the turn, which
    no choice moves: the plan keeps everything and pays for no copy."""
    blocks = [{"keep": Option(held=10, forward_peak=10, backward_peak=10),
               "offload": Option(held=0, moved=10, forward_peak=10, backward_peak=10)}
              for _ in range(3)]
    profile = _profile(blocks, turn=100)
    plan = solve(profile, 130)
    assert plan.choices == ("keep", "keep", "keep") and plan.peak == 130
    with pytest.raises(PlanError):
        solve(profile, 99)  # not even moving everything gets under the head's 100


def test_the_newest_blocks_stay_on_the_gpu_where_their_copies_would_show():
    """Offloading the last block exposes its copy both ways at the turn (nothing runs after it)
    and saves no peak: its copy would still be in flight there. The plan keeps the newest blocks
    on the GPU as far as the budget allows, and pays for no exposed copy."""
    blocks = [{"keep": Option(held=10, forward_peak=10, backward_peak=10),
               "offload": Option(held=0, moved=10, forward_peak=10, backward_peak=10)}
              for _ in range(4)]
    profile = _profile(blocks, turn=0, f=1.0, g=1.0, after=0.0, before=0.0)
    everything = ("offload",) * 4
    assert predict(profile, everything) == (102.0, 20)
    plan = solve(profile, 20)
    assert plan.choices == ("offload", "offload", "keep", "keep") and plan.kept_at_turn == 2
    assert (plan.step_ms, plan.peak) == (100.0, 20)
    with pytest.raises(PlanError):
        solve(profile, 19)


def test_two_copies_in_flight_when_a_long_copy_meets_a_short_block():
    """Block 0's copy (3 ms) is longer than block 1's forward (1 ms): with max_inflight 1 the
    launch at block 1's end waits 2 ms for it; with 2 it hides behind block 2 as well, which
    keeps block 0's 30 bytes on the device through block 2's forward. The head at the turn
    (39 bytes) makes both big blocks offload; the budget decides how many copies fly at once."""
    def block(size: int) -> dict[str, Option]:
        return {"keep": Option(held=size, forward_peak=size, backward_peak=size),
                "offload": Option(held=0, moved=size, forward_peak=size, backward_peak=size)}

    profile = Profile(
        blocks=tuple(BlockProfile(f"b{i}", ms, 10.0, block(size))
                     for i, (size, ms) in enumerate(((30, 1.0), (10, 1.0), (1, 4.0), (1, 4.0)))),
        plain_step_ms=50.0, plain_peak=0, turn_peak=39, forward_after_ms=4.0, backward_before_ms=10.0,
        d2h_gbps=1e-5, h2d_gbps=1e-5)
    both = ("offload", "offload", "keep", "keep")
    assert predict(profile, both, 1) == (52.0, 41)
    assert predict(profile, both, 2) == (50.0, 41)  # block 2's forward: 10 + 30 in flight + 1
    roomy, tight = solve(profile, 41), solve(profile, 40)
    assert (roomy.choices, roomy.max_inflight, roomy.step_ms) == (both, 2, 50.0)
    assert (tight.choices, tight.max_inflight, tight.step_ms, tight.peak) == (
        ("offload", "offload", "offload", "keep"), 1, 52.0, 40)


def test_the_written_plan_is_a_valid_rules_policy_with_every_block_named():
    profile = _random_profile(7, 6)
    lowest, top = smallest_peak(profile), predict(profile, ("keep",) * 6)[1]
    plan = solve(profile, (lowest + top) // 2)
    source = Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
                                    "memory_budget": plan.budget, "pin_budget": "2GiB"})
    text = policy_text(plan, profile, source, origin="configs/x.yaml")
    import actcfg

    policy = actcfg.load(text)
    assert policy.checkpoint.mode == "rules"
    named = {n: r for r in policy.checkpoint.rules for n in r.modules}
    assert sorted(named) == sorted(b.name for b in profile.blocks)
    from actcfg.plan.model import CHOICE_OF

    for block, choice in zip(plan.blocks, plan.choices):
        rule = named[block]
        assert (rule.mode, rule.cpu_checkpointing) == (CHOICE_OF[choice].mode, CHOICE_OF[choice].offload)
    assert policy.checkpoint.predicted.step_time_ms == pytest.approx(plan.step_ms, abs=0.05)
    assert 0 <= policy.checkpoint.predicted.peak - plan.peak < 2**20
    offloads = any(c in OFFLOADS for c in plan.choices)
    assert (policy.pin_budget == 2 * 2**30) is offloads
    assert text.startswith("# Written by actcfg plan from configs/x.yaml: the fastest per-module choices")


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_policy_is_built_directly_and_its_text_loads_back_to_it(seed):
    """The Policy a plan is applied as is built without YAML; the text written for `-o` loads
    back to an equal Policy, with the same fields set explicitly (a backend written is a backend
    chosen, for the integrations)."""
    from actcfg.plan.write import plan_policy, policy_yaml

    profile = _random_profile(seed, 5)
    lowest, top = smallest_peak(profile), predict(profile, ("keep",) * 5)[1]
    plan = solve(profile, lowest + (top - lowest) * (seed % 3) // 3)
    # compile: absent, per block with the default backend, whole with a backend written
    compile = [None, {"scope": "blocks"}, {"scope": "model", "backend": "aot_eager"}][seed % 3]
    source = Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
                                    "memory_budget": plan.budget, "pin": seed % 2 == 0,
                                    "pin_budget": "2GiB", "pin_budget_per_node": "8GiB",
                                    **({"compile": compile} if compile else {})})
    built = plan_policy(plan, source)
    assert built.compile == source.compile  # profiled compiled, applied compiled
    loaded = actcfg.load(policy_yaml(built, plan, profile))
    assert loaded == built
    assert loaded.model_dump(exclude_unset=True) == built.model_dump(exclude_unset=True)
    assert [r.model_fields_set for r in loaded.checkpoint.rules] == \
        [r.model_fields_set for r in built.checkpoint.rules]
    if compile:
        assert loaded.compile.model_fields_set == built.compile.model_fields_set == set(compile)
    assert built.checkpoint.predicted.peak >= plan.peak
    offloads = any(c in OFFLOADS for c in plan.choices)
    assert (built.pin_budget_per_node == 8 * 2**30) is offloads


def test_the_report_and_the_cli_json_come_from_the_plan():
    """`Plan.report` is the one place a plan becomes a PlanReport, and `plan_json` the one
    place its JSON for `actcfg plan --format json` is made (the keys as the command wrote them)."""
    plan = solve(HAND, 60)
    report = plan.report(HAND, "version: 1\n")
    assert report.choices == tuple(zip(plan.blocks, plan.choices))
    assert (report.memory_budget, report.predicted_peak, report.predicted_step_time_ms) == \
        (plan.budget, plan.peak, plan.step_ms)
    assert (report.plain_step_time_ms, report.plain_peak, report.device) == \
        (HAND.plain_step_ms, HAND.plain_peak, HAND.device)
    assert report.plan_json() == {
        "memory_budget": 60, "choices": plan.to_json()["blocks"],
        "max_inflight": plan.max_inflight, "kept_at_turn": plan.kept_at_turn,
        "predicted": {"step_time_ms": plan.step_ms, "peak": plan.peak},
        "plain": {"step_time_ms": HAND.plain_step_ms, "peak": HAND.plain_peak},
        "planning": {"profile_ms": HAND.profile_ms, "compile_ms": HAND.compile_ms, "compiled": None,
                     "parts_ms": HAND.parts_ms, "solve_ms": plan.solve_ms},
        "plan": "version: 1\n"}
    assert report.to_json()["choices"] == plan.to_json()["blocks"]


def test_the_report_says_where_planning_time_went_part_by_part():
    """The summary line, `actcfg plan` and the callbacks' line say how long the profile took and
    in which parts (`Profile.parts_ms`), its compiling apart."""
    import dataclasses

    parts = {"counts": 400.0, "keep": 1100.0, "offload": 2400.0, "warm_ups": 2000.0,
             "host_pool": 6100.0, "copy_bandwidth": 300.0, "rest": 100.0}
    prof = dataclasses.replace(HAND, profile_ms=12400.0, parts_ms=parts)
    report = solve(prof, 60).report(prof, "version: 1\n")
    assert report.planning() == ("12.4 s (counts 0.4, keep 1.1, offload 2.4, warm-ups 2.0, "
                                 "host pool 6.1, copy bandwidth 0.3, rest 0.1 s)")
    assert report.summary().endswith("; planning took " + report.planning() + ")")
    assert report.plan_json()["planning"]["parts_ms"] == parts
    # the solver's own time, outside the profile, said apart
    assert report.solve_ms > 0 and report.plan_json()["planning"]["solve_ms"] == report.solve_ms
    compiled = dataclasses.replace(prof, compiled="blocks with inductor", compile_ms=3100.0)
    assert solve(compiled, 60).report(compiled, "").planning().endswith("rest 0.1 s) + 3.1 s compiling")
    assert solve(HAND, 60).report(HAND, "").planning() == f"{HAND.profile_ms / 1000:.1f} s"


def test_every_choice_is_one_row_of_the_table():
    """Names, offloads, twins and rules all come from CHOICE_TABLE."""
    from actcfg.plan.model import CHOICE_TABLE

    assert CHOICES == ("keep", "selective", "split", "full", "full_offload", "split_offload", "offload")
    assert OFFLOADS == {"full_offload", "split_offload", "offload"} and COUNTERPART == {
        "full_offload": "full", "split_offload": "split", "offload": "keep"}
    assert {c.name for c in CHOICE_TABLE if c.parts} == {"split", "split_offload"}
    rules = {c.name: c.rule(("m",)) for c in CHOICE_TABLE}
    assert {n: (r.mode, r.cpu_checkpointing) for n, r in rules.items()} == {
        "keep": ("none", False), "selective": ("selective", False), "split": ("full", False),
        "full": ("full", False),
        "full_offload": ("full", True), "split_offload": ("full", True), "offload": ("none", True)}


def test_solve_imports_no_torch():
    code = ("import sys\nfrom actcfg.plan import solve, predict\nfrom actcfg.plan.write import policy_text\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


def test_what_runs_outside_the_blocks_bounds_every_plan():
    """An embedding's backward (or the parameter gradients at the end) peaks where no choice
    reaches: a budget under it has no plan, and the smallest peak says so."""
    import dataclasses

    profile = dataclasses.replace(HAND, outside_peak=20)
    assert solve(profile, 20).choices == ("full", "full", "keep")
    assert predict(profile, ("full", "full", "full")) == (103.0, 20)
    assert smallest_peak(profile) == 20
    with pytest.raises(PlanError) as info:
        solve(profile, 19)
    assert info.value.smallest_peak == 20


def test_the_copy_terms_follow_the_engines_storage_by_storage_window():
    # Three blocks that each move 10 bytes (largest storage 2, window 2 storages: 4 bytes per
    # max_inflight) and peak at 8 in forward. Storage by storage, block 1 sees at most 4 bytes
    # of block 0's copy in flight; block 2, the last offloaded, holds its own to its end with
    # at most one storage (2) of block 1's beside it; its whole copy meets the turn (10).
    # Whole blocks (no window known): 10 in flight at blocks 1 and 2.
    block = {"keep": Option(held=0, forward_peak=8),
             "offload": Option(held=0, moved=10, forward_peak=8, extra_ms=1.0)}
    whole = _profile([block] * 3, turn=0)
    windowed = dataclasses.replace(whole, largest_storage=2, window_storages=2)
    every = ("offload",) * 3
    assert predict(whole, every)[1] == 10 + 8
    assert predict(windowed, every)[1] == 4 + 8
    assert predict(windowed, every, max_inflight=2)[1] == 8 + 8  # twice the window
    # the last offloaded block's whole copy is in flight while the next one runs
    assert predict(windowed, ("offload", "offload", "keep"))[1] == 10 + 8
    # the last offloaded block holds its storages to its end: in forward it peaks as kept
    holds = {"keep": Option(held=0, forward_peak=20),
             "offload": Option(held=0, moved=10, forward_peak=8, extra_ms=1.0)}
    last = dataclasses.replace(_profile([holds] * 3, turn=0), largest_storage=2, window_storages=2)
    assert predict(last, every)[1] == 2 + 20  # one storage of block 1's beside it
    assert predict(last, ("offload", "keep", "keep"))[1] == 10 + 20  # block 0's whole copy at block 1
    # backward: the reloads of the block below and a block's own share one window
    reload = {"keep": Option(held=0, backward_peak=8),
              "offload": Option(held=0, moved=10, backward_peak=8, extra_ms=1.0)}
    back = dataclasses.replace(_profile([reload] * 3, turn=0), largest_storage=2, window_storages=2)
    assert predict(back, every)[1] == 4 + 8
    assert predict(dataclasses.replace(back, window_storages=0), every)[1] == 10 + 8
    # the solver tells the last offloaded block apart (a phase of its state): the same peaks
    for budget in range(10, 30):
        try:
            plan = solve(windowed, budget)
        except PlanError:
            continue
        assert plan.peak == predict(windowed, plan.choices, plan.max_inflight)[1] <= budget


def _left_stack() -> Profile:
    """Keep saves 10 bytes and leaves 0; full saves 1 and leaves 4 (under autocast, the weight
    casts it does not save) until the forward ends. The turn: 3 above S + L until the forward
    returns, 8 above S after it (the casts gone)."""
    block = {"keep": Option(held=10, forward_peak=10, backward_peak=12),
             "full": Option(held=1, forward_peak=10, backward_peak=12, recompute_ms=1.0,
                            extra_ms=1.0, left=4)}
    return dataclasses.replace(_profile([block, block, block]), after_turn_peak=8)


def test_what_a_block_leaves_is_seen_by_later_forwards_and_the_turn_never_by_a_backward():
    left = _left_stack()
    # full, full, keep: block 2's forward 1 + 1 + 4 + 4 + 10 = 20; its backward 2 + 12 = 14; the
    # turn max(12 + 8 + 3, 12 + 8) = 23
    assert predict(left, ("full", "full", "keep"))[1] == 23
    # keep, keep, full: block 2's forward 20 + 10, backward 20 + 12 = 32; the turn 21 + max(4 + 3, 8)
    assert predict(left, ("keep", "keep", "full"))[1] == 32
    # all full: block 2's forward 2 + 8 + 10 = 20, above the turn 3 + max(12 + 3, 8) = 18
    assert predict(left, ("full",) * 3)[1] == 20
    # all kept: nothing left, the turn after the forward returned is the larger: 30 + 8
    assert predict(left, ("keep",) * 3)[1] == 38
    # the solver sees the same: every plan it returns is predicted within its budget, and the
    # cheapest under 23 is the one above
    for budget in range(20, 40):
        plan = solve(left, budget)
        assert plan.peak == predict(left, plan.choices)[1] <= budget
    assert solve(left, 23).choices == ("full", "full", "keep")
    assert smallest_peak(left) == min(predict(left, c)[1] for c in itertools.product(("keep", "full"), repeat=3))


def test_gradients_a_later_micro_batch_starts_with_are_on_top_of_every_peak():
    accumulating = dataclasses.replace(HAND, accumulated_grads=5)
    for choices in itertools.product(("keep", "full"), repeat=3):
        assert predict(accumulating, choices)[1] == predict(HAND, choices)[1] + 5
    plan = solve(accumulating, 25)
    assert plan.choices == solve(HAND, 20).choices and plan.peak <= 25
    assert smallest_peak(accumulating) == smallest_peak(HAND) + 5


def test_gradients_alive_through_the_forward_meet_its_terms_not_backward():
    # Lightning frees the previous step's gradients after training_step, before backward.
    grads = dataclasses.replace(HAND, forward_grads=5)
    assert predict(grads, ("keep",) * 3)[1] == 38  # the turn, inside the forward: 30 + 3 + 5
    assert predict(grads, ("full",) * 3)[1] == 17  # block 2's forward: 2 + 10 + 5
    # a stack whose backward peaks: block 2's 2 + 20 above its forward's 2 + 2 + 5 and the turn's 3 + 3 + 5
    late = _profile([{"keep": Option(held=1, forward_peak=2, backward_peak=20)}] * 3)
    assert predict(dataclasses.replace(late, forward_grads=5), ("keep",) * 3) == predict(late, ("keep",) * 3)
    # the head (before the first block) meets them, the tail (after the last backward) does not
    outside = dataclasses.replace(grads, outside_peak=40, head_peak=36)
    assert predict(outside, ("keep",) * 3)[1] == 41
    assert predict(dataclasses.replace(outside, head_peak=30), ("keep",) * 3)[1] == 40
    for budget in range(17, 40):
        plan = solve(grads, budget)
        assert plan.peak == predict(grads, plan.choices)[1] <= budget
    assert smallest_peak(grads) == 17
