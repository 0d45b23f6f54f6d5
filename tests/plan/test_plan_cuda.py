"""memory_budget on a real GPU: the profile predicts what each uniform choice measures, a plan's
measured peak stays within its budget with the gradients of the plain run, and `actcfg plan`
writes, applies and measures a plan. The offload engine's scheduling knobs on the GPU.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/plan/test_plan_cuda.py
Sizes are moderate (8 blocks, d_model 1024, batch 4, sequence 1024, bf16) so the file runs in
about a minute; benchmarks/plan_bench.py measures the issue's sizes.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from actcfg.policy.checker import load  # noqa: E402
from actcfg.plan import CHOICES, predict, smallest_peak, solve  # noqa: E402
from actcfg.plan.model import CHOICE_OF  # noqa: E402
from actcfg.plan.profile import measure_steps, profile  # noqa: E402
from actcfg.plan.write import policy_text  # noqa: E402
from actcfg.probes import blocks  # noqa: E402
from actcfg.api import apply  # noqa: E402
from actcfg.policy.schema import Policy  # noqa: E402
from _helpers import grads_of, watch_host_pools  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def small_blocks():
    """The factory `actcfg plan --model test_plan_cuda:small_blocks` loads."""
    torch.manual_seed(0)
    return blocks(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)


WHOLE = tuple(c for c in CHOICES if not CHOICE_OF[c].parts)  # named: the offload run too, needed or not


@pytest.fixture(scope="module")
def profiled():
    model, x = small_blocks()
    return model, x, profile(model, ("Block",), x, apply=apply, choices=WHOLE)


def test_every_uniform_choice_predicts_what_it_measured(profiled):
    _, _, prof = profiled
    # every choice but split and split_offload, which need `checkpoint.submodules`
    # (tests/plan/test_plan_parts.py)
    assert prof.device == "cuda" and prof.choices() == WHOLE, prof.notes
    assert prof.d2h_gbps > 1 and prof.h2d_gbps > 1
    for c in prof.choices():
        _, peak = predict(prof, (c,) * len(prof.blocks))
        measured = prof.measured[c]
        assert peak == pytest.approx(measured["peak"], rel=0.05), c
        # step time is timing: benchmarks/plan_bench.py checks it over repeated runs
    # the profile measured what checkpointing saves: every checkpointed block holds less
    for b in prof.blocks:
        assert b.options["full"].held < b.options["selective"].held < b.options["keep"].held
        # what each choice costs is timing (a small block's recompute can read 0 ms); that it
        # costs something is the cost model's floor, so a plan never takes a choice for free
        assert b.options["offload"].moved > 0 and b.options["full"].extra_ms > 0


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_a_plan_stays_within_its_budget_with_the_plain_gradients(profiled, fraction):
    model, x, prof = profiled
    low = predict(prof, ("full",) * len(prof.blocks))[1]
    budget = int(low + fraction * (prof.plain_peak - low))
    plan = solve(prof, budget)
    assert plan.peak <= budget
    source = Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
                                    "memory_budget": budget})
    rules = load(policy_text(plan, prof, source))
    plain = copy.deepcopy(model)
    measure_steps(plain, x, steps=1)
    want = grads_of(plain, as_float=True)
    with apply(model, rules):
        _, peak = measure_steps(model, x, steps=3)
        got = grads_of(model, as_float=True)
    assert peak <= budget, (plan.choices, peak, budget)
    assert peak == pytest.approx(plan.peak, rel=0.10)
    # the predicted step time is checked in benchmarks/plan_bench.py, over repeated runs: a
    # timing assertion here failed on a busy GPU (21.6 ms against 18.2 ms predicted)
    for name, g in want.items():
        assert ((got[name] - g).norm() / g.norm().clamp_min(1e-30)).item() <= 2e-2, name


def test_no_plan_below_the_smallest_peak(profiled):
    _, _, prof = profiled
    from actcfg.errors import PlanError

    lowest = smallest_peak(prof)
    with pytest.raises(PlanError) as info:
        solve(prof, lowest - 1)
    assert info.value.smallest_peak == lowest
    assert solve(prof, lowest).peak == lowest


def test_the_plan_cli_writes_applies_and_measures(run_cli, tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text("version: 1\ncheckpoint: {mode: auto, modules: [Block]}\nmemory_budget: 1GiB\n")
    out = tmp_path / "plan.yaml"
    result = run_cli("plan", config, "--model", "test_plan_cuda:small_blocks", "-o", out, "--format", "json")
    import json

    body = json.loads(result.out)
    assert result.code == (0 if body["ok"] else 1)
    assert body["ok"], body["measured"]
    assert body["measured"]["peak"] <= 2**30 and body["written"] == str(out)
    assert run_cli("validate", out).code == 0
    policy = load(out)
    assert policy.checkpoint.mode == "rules" and policy.checkpoint.predicted.peak >= body["predicted"]["peak"]


def test_keep_last_holds_the_newest_groups_and_skips_their_copies():
    """Offloading every block, keep_last 2 keeps the two newest blocks on the GPU at the turn
    and copies two fewer blocks each way; gradients are the plain run's either way."""
    model, x = small_blocks()
    plain = copy.deepcopy(model)
    measure_steps(plain, x, steps=1)
    want = grads_of(plain, as_float=True)
    seen = {}
    for keep_last in (0, 2):
        cfg = {"version": 1, "checkpoint": {"mode": "rules", "keep_last": keep_last, "rules": [
            {"modules": ["Block"], "mode": "none", "cpu_checkpointing": True}]}}
        with apply(model, cfg) as handle:
            _, peak = measure_steps(model, x, steps=2)
            seen[keep_last] = (peak, handle.engine.stats.offloaded_bytes,
                               [g["module"] for g in handle.offload_groups() if g["offloaded_bytes"]])
            for name, g in want.items():
                assert ((model.get_parameter(name).grad.float() - g).norm() / g.norm()).item() <= 2e-2
    assert seen[0][2] == [f"blocks.{i}" for i in range(8)]
    assert seen[2][2] == [f"blocks.{i}" for i in range(6)]
    assert seen[2][1] == pytest.approx(seen[0][1] * 6 / 8, rel=0.01)


def test_the_default_profile_runs_offload_where_its_backward_may_hold_less(profiled):
    """Planning time (issue 18) left out the offload run where its copies outrun full_offload on
    every block and it holds no less. Here a block saves ~140 MB, about 3 ms of copies each way,
    and computes in well under 1 ms, but in backward an offloaded block holds the storages its
    ops use and two more (`RELOAD_STORAGES`), where full_offload's recompute brings the whole
    block back: with every block's gradients allocated in block 0's backward, offloading
    everything peaks below checkpointing (issue 17), so the default profile runs it. (Left out
    where no block saves more than three storages: tests/plan/test_profile.py.)"""
    _, _, named = profiled
    model, x = small_blocks()
    prof = profile(model, ("Block",), x, apply=apply)
    assert "offload" in prof.choices(), prof.notes
    assert not any(n.startswith("offload: not run") for n in prof.notes)
    assert named.measured["offload"]["peak"] < named.measured["full"]["peak"]
    assert named.measured["offload"]["step_ms"] > named.measured["full_offload"]["step_ms"]


def test_the_offload_runs_share_one_pool_pinned_ahead_and_unpinned_at_the_end(monkeypatch):
    """Planning time (issue 18): both offload runs use one host pool, its buffers pinned on the
    pool's thread while the runs before them compute (not in the offload run's first step), and
    nothing stays pinned after; the profile says where its time went, copy bandwidth included."""
    made, pools = watch_host_pools(monkeypatch)
    model, x = small_blocks()
    prof = profile(model, ("Block",), x, apply=apply, choices=WHOLE)
    assert len(pools) == 1 and pools[0]._closed and not pools[0]._registered
    ahead = sum(n for n, t in made if t.startswith("actcfg-host-pool"))
    assert ahead >= 0.9 * sum(n for n, _ in made) > 0, made
    assert {"counts", "offload", "full_offload", "warm_ups", "host_pool", "copy_bandwidth",
            "rest"} <= set(prof.parts_ms)
    assert sum(prof.parts_ms.values()) == pytest.approx(prof.profile_ms)
