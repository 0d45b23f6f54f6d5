"""`pin_budget_per_node`: one bound on pinned host memory for every local rank of a job.

The ledger (actcfg.runtime.host_budget) is exercised by real processes: four gloo ranks offloading on the
host loopback at once (the loopback counts its buffers as pinned, within both budgets), a rank
killed with SIGKILL while holding its reservation, and the even split where no ledger can be
opened. The schema and backend rules of the key run in-process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import warnings

import pytest

from actcfg.runtime.host_budget import LEDGER_DIR_ENV, NodeBudget

try:
    from tests._multirank import gloo_or_skip, init_group, run_ranks, write_result
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _multirank import gloo_or_skip, init_group, run_ranks, write_result

TIMEOUT = float(os.environ.get("ACTCFG_MULTIRANK_TIMEOUT", "900"))
"""Seconds the spawned ranks may take (a loaded CI machine starts four torch processes slowly)."""

MIB = 1 << 20


# --- the ledger, in one process ----------------------------------------------------------------


def test_accounts_of_one_job_share_the_budget_and_give_it_back(tmp_path):
    a = NodeBudget(10 * MIB, key="job", root=str(tmp_path))
    b = NodeBudget(10 * MIB, key="job", root=str(tmp_path))
    other_job = NodeBudget(10 * MIB, key="another job", root=str(tmp_path))
    assert a.reserve(6 * MIB) and not b.reserve(5 * MIB) and b.reserve(4 * MIB)
    assert not a.reserve(1)  # 10 MiB held between them: not one byte more
    assert other_job.reserve(10 * MIB)  # another launch has a ledger of its own
    assert a.node_held() == (10 * MIB, 2) and b.node_held() == (10 * MIB, 2)
    a.release(6 * MIB)
    assert b.reserve(6 * MIB) and b.node_held() == (10 * MIB, 2)
    b.close()
    assert a.node_held() == (0, 1)  # a closed account leaves the ledger
    assert a.reserve(10 * MIB)
    a.close()
    other_job.close()


def test_without_a_usable_ledger_each_rank_takes_an_even_share_and_says_so(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a file, not a directory"
    blocker.write_text("")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.INFO, logger="actcfg.runtime.host_budget"):
        budget = NodeBudget(8 * MIB, key="job", root=str(blocker))
    assert budget.split == 2 * MIB
    assert budget.reserve(2 * MIB) and not budget.reserve(1)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("actcfg offload: local rank 1 of 4 pins at most 2.0 MiB, an even share of "
                           "pin_budget_per_node 8.0 MiB: the node's ledger at ")
    budget.close()


def test_outside_a_launcher_the_process_is_the_nodes_only_rank(tmp_path, monkeypatch, caplog):
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(LEDGER_DIR_ENV, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="actcfg.runtime.host_budget"):
        budget = NodeBudget(4 * MIB)
    assert not budget.shared and budget.reserve(4 * MIB) and not budget.reserve(1)
    assert "this process (no launcher: the node's only rank) shares pin_budget_per_node 4.0 MiB" in caplog.text
    budget.close()


# --- a rank that dies holding its reservation ------------------------------------------------------


def _hold_then_die(root: str, budget: int, held: multiprocessing.Event, die: multiprocessing.Event) -> None:
    account = NodeBudget(budget, key="job", root=root)
    assert account.reserve(budget)
    held.set()
    die.wait(TIMEOUT)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: as the OOM killer leaves it


def test_a_killed_ranks_reservation_returns_to_the_node(tmp_path, caplog):
    spawn = multiprocessing.get_context("spawn")
    held, die = spawn.Event(), spawn.Event()
    rank = spawn.Process(target=_hold_then_die, args=(str(tmp_path), 8 * MIB, held, die))
    rank.start()
    try:
        assert held.wait(TIMEOUT), "the other rank never reserved"
        survivor = NodeBudget(8 * MIB, key="job", root=str(tmp_path))
        assert not survivor.reserve(1)  # alive, it holds the whole budget
        assert survivor.node_held() == (8 * MIB, 2)
        die.set()
        rank.join(TIMEOUT)
        assert rank.exitcode == -signal.SIGKILL
        with caplog.at_level(logging.WARNING, logger="actcfg.runtime.host_budget"):
            assert survivor.reserve(8 * MIB)
        assert survivor.reclaimed == 8 * MIB and survivor.node_held() == (8 * MIB, 1)
        assert "a rank of this job died holding 8.0 MiB of pin_budget_per_node" in caplog.text
        survivor.close()
    finally:
        if rank.is_alive():
            rank.kill()
            rank.join(10)


# --- four ranks offloading at once ------------------------------------------------------------------


def _offload_step(budget: int | None):
    """A model under `cpu_checkpointing` on the host loopback and one training step; returns
    (handle, the step's gradients, the OffloadWarnings it raised)."""
    import torch

    from actcfg.runtime.offload import host_loopback
    from actcfg.probes import blocks
    from actcfg.api import apply

    torch.manual_seed(0)
    model, x = blocks(n=4, d_model=64, heads=4, ffn=128, batch=4, seq=64, dtype=torch.float32,
                      device="cpu")
    policy = {"version": 1, "cpu_checkpointing": True}
    if budget is not None:
        policy["pin_budget_per_node"] = budget
    with host_loopback():
        handle = apply(model, policy)
        handle.engine.min_offload_bytes = 1 << 14
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return handle, grads, [str(w.message) for w in caught]


def _rank_pins_within_the_node(rank: int, out_dir: str, port: int, world: int, ledger: str,
                               budget: int) -> None:
    import torch.distributed as dist

    os.environ[LEDGER_DIR_ENV] = ledger
    init_group(rank, port, world=world)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("actcfg.runtime.host_budget")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    dist.barrier()  # every rank offloads at once: the ledger is contended
    handle, grads, warned = _offload_step(budget)
    stats = handle.engine.stats
    result = {"pinned": stats.pinned_bytes, "pageable": stats.pageable_bytes,
              "fallbacks": stats.pinned_fallbacks, "offloaded": stats.offloaded_bytes,
              "lines": lines, "warned": warned,
              "grads": {n: g.sum().item() for n, g in grads.items()}}
    dist.barrier()  # every pool has grown (pools only grow) before any rank unpins
    handle.remove()
    write_result(out_dir, rank, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_four_ranks_never_pin_more_than_the_node_budget_together(tmp_path):
    gloo_or_skip()
    handle, plain_grads, _ = _offload_step(None)
    need = handle.engine.stats.pinned_bytes  # what one rank pins, unbounded
    handle.remove()
    assert need > 0
    world = 4
    budget = need * 5 // 2  # room for two ranks and a half of the four
    out = tmp_path / "out"
    out.mkdir()
    ranks = run_ranks(_rank_pins_within_the_node, out, world, str(tmp_path / "ledger"), budget,
                      world=world, timeout=TIMEOUT)
    pinned = [r["pinned"] for r in ranks]
    print(f"one rank pins {need} B unbounded; node budget {budget} B; pinned per rank {pinned} "
          f"(sum {sum(pinned)}); pageable per rank {[r['pageable'] for r in ranks]}")
    assert 0 < sum(pinned) <= budget, pinned
    assert sum(pinned) >= budget - need  # the budget is used, not left idle by a wrong split
    assert sum(r["fallbacks"] for r in ranks) > 0  # and what did not fit went pageable
    for rank, r in enumerate(ranks):
        assert r["offloaded"] == ranks[0]["offloaded"] > 0  # every rank offloaded all the same
        # the host holds a whole step's offloads at the turn, pinned or not (how many spare
        # buffers the pool prepared on top depends on its thread's timing)
        assert r["pinned"] + r["pageable"] >= r["offloaded"]
        if r["fallbacks"]:
            assert any("pin_budget_per_node" in w and "Raise `pin_budget_per_node`" in w
                       for w in r["warned"]), r["warned"]
        assert r["grads"] == pytest.approx({n: g.sum().item() for n, g in plain_grads.items()})
        [line] = r["lines"]  # one line per rank, saying its share
        assert line.startswith(f"actcfg offload: local rank {rank} of {world} shares "
                               "pin_budget_per_node "), line
        assert "an even share would be" in line


# --- the key in the schema and the backends ---------------------------------------------------------


def test_the_key_takes_a_size_and_reaches_the_torch_plan():
    from actcfg.policy.schema import Policy
    from actcfg.translators.torch_native import to_torch_native

    policy = Policy.model_validate({"version": 1, "cpu_checkpointing": True,
                                    "pin_budget_per_node": "256GiB"})
    assert policy.pin_budget_per_node == 256 * 2**30
    assert to_torch_native(policy).offload.pin_budget_per_node == 256 * 2**30


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "`pin_budget_per_node` bounds host memory for offloaded activations, but "
         "`cpu_checkpointing` is off: nothing is offloaded"),
    ({"cpu_checkpointing": True, "pin": False},
     "`pin_budget_per_node` bounds pinned memory, but `pin: false` pins nothing"),
])
def test_a_node_budget_that_bounds_nothing_is_a_warning(extra, message):
    from actcfg.policy.schema import Policy, check_rules

    policy = Policy.model_validate({"version": 1, "pin_budget_per_node": "1GiB", **extra})
    assert [(f.code, f.path, f.message) for f in check_rules(policy)] == [
        ("unused-setting", ("pin_budget_per_node",), message)]


@pytest.mark.parametrize("backend", ["deepspeed", "hf", "lightning"])
def test_other_backends_refuse_the_key(backend):
    from actcfg.policy.schema import Policy, check_rules

    policy = Policy.model_validate({"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]},
                                    "cpu_checkpointing": True, "pin_budget_per_node": "1GiB"})
    [finding] = [f for f in check_rules(policy, (backend,)) if f.path == ("pin_budget_per_node",)]
    assert finding.severity == "error"
    assert finding.message.startswith("`pin_budget_per_node` ")
    assert "remove `pin_budget_per_node`" in finding.hint


def test_a_plan_that_offloads_keeps_the_node_budget_and_apply_reports_it(tmp_path, monkeypatch):
    import torch

    from actcfg.policy.checker import load
    from actcfg.runtime.offload import host_loopback
    from actcfg.plan.model import BlockProfile, Option, Profile
    from actcfg.plan.solve import Plan
    from actcfg.plan.write import policy_text
    from actcfg.probes import blocks
    from actcfg.api import apply
    from actcfg.policy.schema import Policy

    profile = Profile(blocks=(BlockProfile("blocks.0", 1.0, 2.0, {"offload": Option(held=0, moved=8)}),),
                      plain_step_ms=3.0, plain_peak=8, turn_peak=0, forward_after_ms=1.0,
                      backward_before_ms=1.0, device="cpu")
    source = Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
                                    "memory_budget": "1GiB", "pin_budget_per_node": "2GiB"})
    text = policy_text(Plan(("blocks.0",), ("offload",), 1, 3.0, 8, 2**30), profile, source)
    assert text.endswith("pin_budget_per_node: 2GiB\n")
    monkeypatch.setenv(LEDGER_DIR_ENV, str(tmp_path))
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    model, x = blocks(n=2, d_model=64, heads=4, ffn=128, batch=4, seq=64, dtype=torch.float32,
                      device="cpu")
    with host_loopback(), apply(model, load(path)) as handle:
        assert handle.report()["offload"]["pin_budget_per_node"] == 2 * 2**30
        handle.engine.min_offload_bytes = 1 << 14  # these blocks' activations are 64 KiB
        model(x).square().mean().backward()
        assert handle.engine.stats.pinned_bytes > 0  # the loopback's buffers, counted as pinned
