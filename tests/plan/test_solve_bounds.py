"""The solver's bounded search (issue 18): what no later block can fit, and what cannot finish as
fast as a plan already known, is dropped before the Pareto fronts are built. Held to the solver
as it was (`tests/_solve_before.py`, a frozen copy): the same plans, the same predicted step time
and peak, the same refusal, on random profiles with autocast's left bytes, offloads and two
copies in flight, and on two profiles measured on the H200 (`tests/data/profiles`); and far
fewer front entries. No torch, no timing."""

from __future__ import annotations

import dataclasses
import importlib
import json
import random

import pytest

import _solve_before as before
from conftest import DATA
from actcfg.errors import PlanError
from actcfg.plan.model import BlockProfile, Option, Profile

solve_module = importlib.import_module("actcfg.plan.solve")


def _block(rng: random.Random, split: bool) -> dict[str, Option]:
    a = rng.randint(40, 120) * 1000  # activations
    i = rng.randint(2, 12) * 1000  # input
    s = rng.randint(i, a)  # selective keeps the input and some op outputs
    grads = rng.randint(0, 40) * 1000
    left = rng.choice([0, rng.randint(1, 30) * 1000])  # autocast's cached casts, or none
    rec = rng.uniform(0.5, 3.0)
    sel = rng.uniform(0.0, rec)
    stays = rng.randint(0, 5) * 1000
    options = {
        "keep": Option(held=a, forward_peak=a, backward_peak=a + grads, left=left,
                       extra_ms=rng.uniform(0, 0.1)),
        "selective": Option(held=s, forward_peak=a, backward_peak=a + grads, recompute_ms=sel,
                            extra_ms=sel, left=left),
        "full": Option(held=i, forward_peak=a, backward_peak=a + grads, recompute_ms=rec,
                       extra_ms=rec, left=left),
        "full_offload": Option(held=0, moved=i, forward_peak=a, backward_peak=a + grads,
                               recompute_ms=rec, extra_ms=rec + rng.uniform(0, 0.2), left=left),
        "offload": Option(held=stays, moved=a - stays, forward_peak=a, backward_peak=a + grads,
                          extra_ms=rng.uniform(0, 0.2), left=left),
    }
    if split:
        options["split"] = Option(held=2 * i, forward_peak=a, backward_peak=a // 2 + grads,
                                  recompute_ms=rec, extra_ms=rec * rng.uniform(0.5, 1.2), left=left)
    return options


def _profile(seed: int, n: int) -> Profile:
    rng = random.Random(seed)
    split = rng.random() < 0.5
    window = rng.choice([0, 2])
    gbps = rng.choice([rng.uniform(0.005, 0.03), rng.uniform(0.03, 0.3)])  # copies long or short
    turns = {c: rng.randint(5, 60) * 1000 for c in ("keep", "full", "selective") if rng.random() < 0.5}
    return Profile(
        blocks=tuple(BlockProfile(f"blocks.{b}", rng.uniform(0.5, 3), rng.uniform(1, 6),
                                  _block(rng, split), ("a", "b") if split else ())
                     for b in range(n)),
        plain_step_ms=100.0, plain_peak=0, turn_peak=rng.randint(0, 60) * 1000,
        forward_after_ms=rng.uniform(0, 2), backward_before_ms=rng.uniform(0, 2),
        outside_peak=rng.randint(0, 50) * 1000, d2h_gbps=gbps, h2d_gbps=gbps,
        largest_storage=rng.randint(1, 20) * 1000 if window else 0, window_storages=window,
        turn_peaks=turns, after_turn_peak=rng.randint(0, 40) * 1000,
        after_turn_peaks={c: rng.randint(0, 40) * 1000 for c in turns},
        accumulated_grads=rng.choice([0, rng.randint(1, 50) * 1000]), device="cuda")


def _plan_or_refusal(solve, profile: Profile, budget: int):
    try:
        plan = solve(profile, budget)
    except PlanError as e:
        return str(e)
    return plan.choices, plan.max_inflight, plan.step_ms, plan.peak


@pytest.mark.parametrize("seed", range(40))
def test_the_same_plans_as_the_solver_before_its_bounds(seed):
    profile = _profile(seed, 4 + seed % 5)
    n = len(profile.blocks)
    lowest = min(before.smallest_peak(profile, m) for m in (1, 2))
    plain = before.predict(profile, ("keep",) * n)[1]
    for k in range(-1, 10):  # below the lowest peak (refused), across, and above plain
        budget = lowest + (plain - lowest) * k // 8
        assert (_plan_or_refusal(solve_module.solve, profile, budget)
                == _plan_or_refusal(before.solve, profile, budget)), (seed, k)


def _stretched(profile: Profile, n: int, left: int) -> Profile:
    """`profile`'s blocks repeated to `n`, each option leaving `left` bytes until the turn (as
    autocast's cached casts do): the shape of the H200's 12-block GPT-2 under bf16."""
    blocks = tuple(
        BlockProfile(f"blocks.{b}", src.forward_ms, src.backward_ms,
                     {c: dataclasses.replace(o, left=left) for c, o in src.options.items()}, src.parts)
        for b, src in ((b, profile.blocks[b % len(profile.blocks)]) for b in range(n)))
    return dataclasses.replace(profile, blocks=blocks)


@pytest.mark.parametrize("name", ["h200_blocks", "h200_llama"])
@pytest.mark.parametrize("stretch", [False, True])
def test_the_same_plans_on_profiles_measured_on_the_h200(name, stretch):
    """plan_bench's profiles (8 blocks, six choices, the engine's window, measured copy
    bandwidth), as measured and stretched to 12 blocks with left bytes."""
    profile = Profile.from_json(json.loads((DATA / "profiles" / f"{name}.json").read_text()))
    if stretch:
        profile = _stretched(profile, 12, 56 << 20)
    n = len(profile.blocks)
    lowest = min(before.smallest_peak(profile, m) for m in (1, 2))
    plain = before.predict(profile, ("keep",) * n)[1]
    for k in range(0, 9):
        budget = lowest + (plain - lowest) * k // 8
        assert (_plan_or_refusal(solve_module.solve, profile, budget)
                == _plan_or_refusal(before.solve, profile, budget)), k


def test_the_bounds_build_far_fewer_front_entries(monkeypatch):
    """Counted, not timed: the entries handed to the Pareto front on a 12-block profile with six
    choices and left bytes, at a budget halfway from the lowest peak to plain."""
    profile = _profile(7, 12)
    lowest = min(before.smallest_peak(profile, m) for m in (1, 2))
    budget = (lowest + before.predict(profile, ("keep",) * 12)[1]) // 2
    counted = {}
    for name, module in (("before", before), ("now", solve_module)):
        entries = [0]
        prune = module._prune

        def counting(front, *how, prune=prune, entries=entries):
            entries[0] += len(front)
            return prune(front, *how)

        monkeypatch.setattr(module, "_prune", counting)
        plan = module.solve(profile, budget)
        counted[name] = entries[0], plan.choices
    assert counted["now"][1] == counted["before"][1]
    # 219,644 entries before, 15,210 now
    assert counted["now"][0] * 5 < counted["before"][0], counted
