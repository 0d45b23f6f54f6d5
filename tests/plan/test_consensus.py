"""One plan for every rank (actcfg.plan.consensus): the reduction of the ranks' profiles on plain
data, then two and four gloo ranks on the CPU, one of them slower (a sleep in a block's forward)
and one with a larger batch, each planning `checkpoint.mode: auto` through `actcfg.apply`: every
rank applies the same plan, and the plan's peak under each rank's own profile is within the
budget. Copy bandwidth measured with all ranks copying at once begins on a barrier, and the plan
uses it.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from actcfg.errors import PlanError
from actcfg.plan.consensus import reduce_profiles
from actcfg.plan.model import BlockProfile, Option, Profile

try:
    from tests._multirank import gloo_or_skip, init_group, run_ranks, write_result
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _multirank import gloo_or_skip, init_group, run_ranks, write_result

TIMEOUT = float(os.environ.get("ACTCFG_MULTIRANK_TIMEOUT", "900"))
"""Seconds the spawned ranks may take (each profiles a model twice on a shared CPU)."""


# --- the reduction, on plain data -------------------------------------------------------------------


def _profile(scale: float, held: int, *, offload: bool = True, names=("a", "b")) -> Profile:
    options = {"keep": Option(held=held), "full": Option(held=held // 2, recompute_ms=scale, extra_ms=scale)}
    if offload:
        options["offload"] = Option(held=0, moved=held, extra_ms=2 * scale)
    return Profile(
        blocks=tuple(BlockProfile(n, scale, 2 * scale, dict(options)) for n in names),
        plain_step_ms=10 * scale, plain_peak=3 * held, turn_peak=held, forward_after_ms=scale,
        backward_before_ms=scale, outside_peak=held // 4, d2h_gbps=50 / scale, h2d_gbps=40 / scale,
        device="cuda", measured={"keep": {"step_ms": 10 * scale, "peak": 3 * held}},
        notes=(f"rank note {scale}",))


def test_the_reduction_takes_the_worst_case_of_each_figure():
    fast_big, slow_small = _profile(1.0, 4000), _profile(3.0, 1000, offload=False)
    out = reduce_profiles([fast_big, slow_small])
    assert [b.name for b in out.blocks] == ["a", "b"]
    for block in out.blocks:
        assert (block.forward_ms, block.backward_ms) == (1.0, 2.0)  # windows: the shortest
        assert set(block.options) == {"keep", "full"}  # offload: not profiled on rank 1
        assert block.options["keep"] == Option(held=4000)
        assert block.options["full"] == Option(held=2000, recompute_ms=3.0, extra_ms=3.0)
    assert (out.plain_step_ms, out.plain_peak, out.turn_peak, out.outside_peak) == (30.0, 12000, 4000, 1000)
    assert (out.d2h_gbps, out.h2d_gbps) == (50 / 3, 40 / 3)
    assert (out.forward_after_ms, out.backward_before_ms) == (1.0, 1.0)
    assert out.measured == {"keep": {"step_ms": 30.0, "peak": 12000}}
    assert out.notes == ("rank note 1.0", "rank note 3.0",
                         "reduced over 2 ranks: the slowest cost, the shortest copy window, the "
                         "largest bytes and the lowest copy bandwidth of each figure (the slowest "
                         "plain step: rank 1)")
    assert reduce_profiles([fast_big]) is fast_big


def test_the_reload_waits_only_where_every_ranks_engine_waited_and_survives_json():
    """`reload_waits` (the engine reloads the block below past this block's recompute peak)
    goes through the exchange's JSON, and is reduced to where every rank waited: a rank whose
    engine fell back measured the reload in its peak and has it taken off (the old model, which
    counts it), and with the worst of each option a rank that waited is then counted high, never
    low."""
    waits, falls_back = _profile(1.0, 4000), _profile(1.0, 4000)
    waits = replace(waits, blocks=tuple(replace(b, reload_waits=True) for b in waits.blocks))
    falls_back = replace(falls_back, blocks=(replace(falls_back.blocks[0], reload_waits=True),
                                             falls_back.blocks[1]))
    assert Profile.from_json(waits.to_json()) == waits
    assert Profile.from_json(falls_back.to_json()) == falls_back
    assert [b.reload_waits for b in reduce_profiles([waits, falls_back]).blocks] == [True, False]


def test_ranks_with_different_candidates_are_refused():
    with pytest.raises(PlanError, match=r"^rank 1 profiled 3 candidate modules on cuda \(a, b, c\) "
                                        r"and rank 0 2 on cuda \(a, b\): one plan for all ranks "
                                        r"needs the same blocks on each\. "):
        reduce_profiles([_profile(1.0, 10), _profile(1.0, 10, names=("a", "b", "c"))])


def test_without_a_process_group_everything_is_the_identity():
    from actcfg.plan.consensus import agree, copy_together, one_profile, slowest_rank

    p = _profile(1.0, 10)
    assert one_profile(p) is p
    assert agree("any text") is None and copy_together() is None
    assert slowest_rank(1.5, 7) == (1.5, 7)


# --- two and four ranks ------------------------------------------------------------------------------

SLEEP_S = 0.03
"""What the slow rank's second block sleeps in every forward: its times are the slowest."""


def _rank_plans(rank: int, out_dir: str, port: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from actcfg.runtime.offload import host_loopback
    from actcfg.plan import predict, solve
    from actcfg.plan.consensus import agree, copy_together, one_profile
    from actcfg.plan.profile import profile
    from actcfg.api import apply
    from _helpers import Layer

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(256) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    init_group(rank, port, world=world)
    slow, big = world - 1, 0
    torch.manual_seed(0)
    model = Chain()
    rows = 1536 if rank == big else 1024  # rank 0's batch is larger: it holds the most
    x = torch.randn(rows, 256)
    if rank == slow:
        model.layers[1].register_forward_hook(lambda *_: time.sleep(SLEEP_S))
    with host_loopback():
        own = profile(model, ("Layer",), x, apply=apply)
        keep_all = predict(own, ("keep",) * 4)[1]
        budgets: list = [None] * world
        dist.all_gather_object(budgets, keep_all)
        budget = max(budgets) * 2 // 3  # the largest rank cannot keep everything
        cfg = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Layer"]},
               "memory_budget": budget}
        handle = apply(model, cfg, inputs=x)
        plan = handle.plan
        choices = [c for _, c in plan.choices]
        model(x).square().mean().backward()  # the plan runs
        applied = sorted((n, r.checkpoint, r.offload) for r in handle.rules for n in r.modules)
        handle.remove()
        # What this rank alone would have chosen (not asserted: timing decides it).
        alone = list(solve(own, budget).choices)
        # The contended copy: the slow rank arrives late, and nobody starts before it.
        if rank == slow:
            time.sleep(0.5)
        together = copy_together(nbytes=8 << 20, repeats=2)
        # A profile that measured a copy bandwidth (as on a GPU) is planned with the figure of
        # every rank copying at once.
        fake = replace(own, d2h_gbps=1e6, h2d_gbps=1e6)
        contended = one_profile(fake, copy_bytes=8 << 20)
    try:  # ranks whose plans differ (here: by construction) are refused on every rank
        agree(f"the plan of rank {rank}")
        disagreed = ""
    except PlanError as e:
        disagreed = str(e)
    write_result(out_dir, rank, {
        "policy_yaml": plan.policy_yaml, "choices": choices, "applied": applied,
        "budget": budget, "predicted_peak": plan.predicted_peak,
        "own_peak": predict(own, tuple(choices), plan.max_inflight)[1], "alone": alone,
        "arrived": together.arrived, "started": together.started, "ranks": together.ranks,
        "together": [together.d2h_gbps, together.h2d_gbps],
        "contended": [contended.d2h_gbps, contended.h2d_gbps], "notes": list(contended.notes),
        "disagreed": disagreed,
    })
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_applies_the_same_plan_and_it_fits_each(tmp_path, world):
    gloo_or_skip()
    ranks = run_ranks(_rank_plans, tmp_path, world, world=world, timeout=TIMEOUT)
    first = ranks[0]
    assert any(c != "keep" for c in first["choices"])  # the budget made the plan choose
    for r in ranks:
        assert r["policy_yaml"] == first["policy_yaml"]
        assert r["choices"] == first["choices"] and r["applied"] == first["applied"]
        assert r["budget"] == first["budget"]
        assert r["predicted_peak"] <= r["budget"]
        # the shared plan fits what this rank itself measured (bytes reduced by their largest)
        assert r["own_peak"] <= r["budget"], r
        assert r["disagreed"].startswith("the ranks planned differently (rank 1's plan is not "
                                         "rank 0's), although they planned from one reduced profile")
    # The copy bandwidth measured together: each rank began after the last one arrived.
    assert min(r["started"] for r in ranks) >= max(r["arrived"] for r in ranks)
    for r in ranks:
        assert r["ranks"] == world
        assert r["together"] == ranks[0]["together"]  # one figure for all: the lowest rank's
        assert 0 < r["contended"][0] < 1e6 and 0 < r["contended"][1] < 1e6
        assert r["contended"] == ranks[0]["contended"]
        assert r["notes"][-1].startswith(f"copy bandwidth with {world} ranks copying at once: ")
        assert r["notes"][-1].endswith("(alone 1000000.0 and 1000000.0); the plan uses the lower")


def _rank_plans_whole_compiled(rank: int, out_dir: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    from actcfg.api import apply
    from _helpers import small_blocks

    init_group(rank, port, world=2)
    model, x = small_blocks(2)
    cfg = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1GiB",
           "compile": {"scope": "model", "backend": "aot_eager"}}
    try:
        apply(model, cfg, inputs=x)
        refused = ""
    except PlanError as e:
        refused = str(e)
    write_result(out_dir, rank, {"refused": refused, "forward_is_eager": "forward" not in vars(model),
                                 "dynamo_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                                 if "torch._dynamo.utils" in __import__("sys").modules else 0})
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_whole_model_compiled_plan_is_refused_on_several_ranks_before_profiling(tmp_path):
    """Each rank would measure its plan compiled whole on its own (`_measured_whole`), and the
    ranks must agree on one plan: every rank refuses, before anything is compiled or profiled."""
    gloo_or_skip()
    ranks = run_ranks(_rank_plans_whole_compiled, tmp_path, world=2, timeout=TIMEOUT)
    for r in ranks:
        assert r["refused"].startswith("planning failed on rank 0 of 2 (and on rank 1) (before profiling): "
                                       "compile: {scope: model} on several ranks: its plan is measured "
                                       "compiled whole"), r
        assert r["forward_is_eager"] and r["dynamo_graphs"] == 0
