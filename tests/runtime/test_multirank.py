"""actcfg across two ranks on the CPU: two gloo processes (torch.multiprocessing, spawn), nothing
mocked. FSDP2 sharding a policy-applied model in both orders; DeepSpeed partitioning checkpointed
inputs across a real model-parallel group on its CPU accelerator; DeepSpeed ZeRO-3 with a policy;
and `actcfg verify`'s gather, judge and render under a two-rank group.

Each test starts its ranks once (a module fixture for the parametrized ones); the ranks write
their numbers to JSON files that the test reads. The two-GPU versions are in
tests/runtime/test_distributed.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

try:
    from tests._multirank import (
        WORLD,
        finish,
        free_port,
        gloo_or_skip,
        init_group,
        run_ranks,
        write_result,
    )
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from _multirank import (WORLD, finish, free_port, gloo_or_skip, init_group, run_ranks,
                            write_result)
try:
    from tests._helpers import grads_of, max_rel_error, offload_blocks, train_step
except ImportError:
    from _helpers import grads_of, max_rel_error, offload_blocks, train_step

# Spawned ranks start a fresh interpreter each (torch, and DeepSpeed for some): the quick inner
# loop (`pytest -m "not slow"`) leaves them to CI.
pytestmark = pytest.mark.slow

FULL = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
FULL_OFFLOAD = {**FULL, "cpu_checkpointing": True}
SMALL = 1 << 14  # min_offload_bytes for these small models: a block input is 32 KiB per rank
STEPS = 2
N_BLOCKS = 4


# --- FSDP2 across two ranks ---------------------------------------------------------------------

ORDERS = ("apply-then-shard", "shard-then-apply")
FSDP_CASES = {"checkpoint": FULL, "checkpoint+cpu_checkpointing": FULL_OFFLOAD}


def _shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_worker(rank: int, out_dir: str, port: int) -> None:
    import actcfg
    from torch.distributed.device_mesh import init_device_mesh

    from actcfg.runtime.offload import host_loopback

    init_group(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    reference, x = offload_blocks(N_BLOCKS)
    want = train_step(reference, x)  # one unsharded process, the whole global batch
    local = x.chunk(WORLD)[rank]  # FSDP2 averages the ranks' gradients: the global mean's
    result = {}
    for order in ORDERS:
        for name, cfg in FSDP_CASES.items():
            model, _ = offload_blocks(N_BLOCKS)
            with host_loopback():
                if order == "apply-then-shard":
                    handle = actcfg.apply(model, cfg)
                    _shard(model, mesh)
                else:
                    _shard(model, mesh)
                    handle = actcfg.apply(model, cfg)
                if handle.engine is not None:
                    handle.engine.min_offload_bytes = SMALL
                for _ in range(STEPS):
                    got = train_step(model, local)
            stats = handle.engine.stats if handle.engine is not None else None
            result[f"{order}/{name}"] = {
                "class": type(model.blocks[0]).__name__,
                "shard_rows": model.blocks[0].fc1.weight.to_local().shape[0],
                "grad_error": max_rel_error(got, want),
                "checkpointed": list(handle.checkpointed),
                "recomputes": handle.counters.recomputes,
                "offloaded": None if stats is None else stats.offloaded_bytes,
                "reloaded": None if stats is None else stats.reloaded_bytes,
            }
            handle.remove()
    write_result(out_dir, rank, result)
    finish()


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    gloo_or_skip()
    return run_ranks(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("name", list(FSDP_CASES))
@pytest.mark.parametrize("order", ORDERS)
def test_fsdp2_on_two_ranks_gives_the_unsharded_gradients_and_the_policy_acts(
        fsdp_ranks, order, name):
    for rank, result in enumerate(fsdp_ranks):
        r = result[f"{order}/{name}"]
        assert r["class"] == "FSDPBlock"
        assert r["shard_rows"] == 128 // WORLD  # each rank holds half of fc1's rows
        # One process running the unsharded model on the whole batch got the same gradients.
        assert r["grad_error"] <= 1e-5, (rank, r)
        assert r["checkpointed"] == [f"blocks.{i}" for i in range(N_BLOCKS)]
        assert r["recomputes"] == STEPS * N_BLOCKS, (rank, r)
        if "cpu_checkpointing" in name:
            assert r["offloaded"] > 0 and r["reloaded"] == r["offloaded"], (rank, r)
        else:
            assert r["offloaded"] is None


# --- DeepSpeed partition across a real model-parallel group --------------------------------------

PARTITION = {**FULL, "backend": "deepspeed", "partition": True}
PARTITION_CASES = {
    "partition": {},
    "partition+contiguous": {"contiguous": True},  # num_checkpoints left to apply
    "partition+contiguous, num_checkpoints 6": {"contiguous": True, "num_checkpoints": 6},
    "partition+cpu_checkpointing": {"cpu_checkpointing": True},
    "partition+contiguous+cpu_checkpointing": {"contiguous": True, "cpu_checkpointing": True},
}


def held_by_deepspeed(output: torch.Tensor) -> list[tuple[int, str]]:
    """What DeepSpeed keeps for backward in each checkpoint node of `output`'s graph, in forward
    order: bytes and devices of the floating inputs it saved (`ctx.deepspeed_saved_tensors`;
    under partition each one's data is emptied and its kept shard is `saved_data`, ckpt.py).
    The one-element tensor actcfg adds to a call whose inputs need no gradient is left out."""
    held: list[tuple[int, str]] = []
    seen: set[int] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            saved = [t.saved_data if getattr(t, "saved_data", None) is not None else t
                     for t in node.deepspeed_saved_tensors if isinstance(t, torch.Tensor)]
            kept = [t for t in saved if t.is_floating_point() and t.numel() > 1]
            held.append((sum(t.numel() * t.element_size() for t in kept),
                         ",".join(sorted({t.device.type for t in kept}))))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return held[::-1]


def _partition_run(model: nn.Module, x: torch.Tensor, cfg: dict, mpu: Any) -> dict[str, Any]:
    import actcfg

    plain = copy.deepcopy(model)
    want = train_step(plain, x)
    handle = actcfg.apply(model, cfg, backend="deepspeed", mpu=mpu)
    held: list[tuple[int, str]] = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        out = model(x)
        held = held_by_deepspeed(out)
        out.square().mean().backward()
        del out
    got = grads_of(model)
    report = handle.report()
    handle.remove()
    return {
        "grad_error": max_rel_error(got, want),
        "mp_size": handle.deepspeed.mp_size,
        "configured": report["deepspeed"]["state"],
        "notes": report["checkpoint"]["notes"],
        "recomputes": handle.counters.recomputes,
        "held": held,
        "one_input": x.numel() * x.element_size(),
    }


def _refusal(call: Any) -> str:
    from actcfg.errors import PolicyApplyError

    try:
        call()
    except PolicyApplyError as e:
        return str(e)
    return "no error"


def _partition_worker(rank: int, out_dir: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import actcfg

    init_group(rank, port, deepspeed=True)
    model, x = offload_blocks(N_BLOCKS)
    # The control: checkpointing alone, no model-parallel group; DeepSpeed keeps whole inputs.
    unpartitioned = {**PARTITION, "partition": False}
    result: dict[str, Any] = {"checkpoint only": _partition_run(model, x, unpartitioned, None)}
    for name, extra in PARTITION_CASES.items():
        model, x = offload_blocks(N_BLOCKS)  # the same weights and input on both ranks, as tensor-parallel ranks see
        result[name] = _partition_run(model, x, {**PARTITION, **extra}, dist.group.WORLD)

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    model, x = offload_blocks(N_BLOCKS)
    result["2-D mesh"] = _refusal(lambda: actcfg.apply(model, PARTITION, mpu=mesh))
    result["mesh['tp']"] = _partition_run(model, x, PARTITION, mesh["tp"])

    # 3 x 7 = 21 elements do not split in two: refused before DeepSpeed's assert.
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(7, 7), nn.Linear(7, 7))
    cfg = {**PARTITION, "checkpoint": {"mode": "full", "modules": ["Linear"]}}
    with actcfg.apply(odd, cfg, mpu=dist.group.WORLD):
        result["indivisible"] = _refusal(lambda: odd(torch.randn(3, 7, requires_grad=True)))
    write_result(out_dir, rank, result)
    finish()


@pytest.fixture(scope="module")
def partition_ranks(tmp_path_factory):
    gloo_or_skip()
    pytest.importorskip("deepspeed")
    return run_ranks(_partition_worker, tmp_path_factory.mktemp("partition"))


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", [*PARTITION_CASES, "mesh['tp']"])
def test_partition_across_two_ranks_keeps_half_of_each_input_with_plain_gradients(
        partition_ranks, name):
    for rank, result in enumerate(partition_ranks):
        r = result[name]
        assert r["mp_size"] == 2, (rank, r)  # DeepSpeed's own mp_size, read back after configure
        assert r["grad_error"] <= 1e-6, (rank, r)
        assert r["recomputes"] == STEPS * N_BLOCKS
        # Each checkpointed Block keeps its rank's half of its input (on the host with
        # cpu_checkpointing); unpartitioned, DeepSpeed would keep all of it.
        device = "cpu"  # on the CPU accelerator the device is the host with or without it
        assert r["held"] == [[r["one_input"] // WORLD, device]] * N_BLOCKS, (rank, r)
        contiguous = "contiguous" in name
        assert r["configured"]["contiguous_checkpointing"] is contiguous
        assert r["configured"]["checkpoint_in_cpu"] is ("cpu_checkpointing" in name)
        if "num_checkpoints" in name:  # as the policy says: more buffers than calls is fine
            assert (r["configured"]["num_checkpoints"], r["notes"]) == (6, [])
        elif contiguous:  # num_checkpoints was omitted: apply filled in the routed count
            assert r["configured"]["num_checkpoints"] == N_BLOCKS
            assert r["notes"] == [
                f"num_checkpoints set to {N_BLOCKS}, the number of routed modules"]
        else:
            assert (r["configured"]["num_checkpoints"], r["notes"]) == (None, [])


@pytest.mark.deepspeed
def test_partition_refuses_a_two_dimensional_mesh_and_an_indivisible_input(partition_ranks):
    for result in partition_ranks:
        assert result["2-D mesh"] == (
            "mpu= is a 2-dimensional DeviceMesh: pass its model-parallel dimension, such as "
            "mpu=mesh['tp'] (dimensions: 'dp', 'tp')")
        assert result["indivisible"] == (
            "partition: a checkpointed Linear was called with a tensor of shape [3, 7] (21 "
            "elements), which does not split across the model-parallel group of 2: DeepSpeed "
            "partitions each checkpointed input evenly; make its size a multiple of 2 (batch, "
            "sequence or hidden size), or set `partition: false`")


@pytest.mark.deepspeed
def test_checkpointing_without_partition_keeps_whole_inputs_on_two_ranks(partition_ranks):
    # The control for the test above: the same count, unpartitioned, reads one whole input.
    for result in partition_ranks:
        r = result["checkpoint only"]
        assert (r["mp_size"], r["grad_error"]) == (1, 0.0)
        assert r["held"] == [[r["one_input"], "cpu"]] * N_BLOCKS


# --- DeepSpeed ZeRO-3 across two ranks ---------------------------------------------------------

ENGINE_STEPS = 3


def _engine_run(cfg: dict | None, backend: str | None, x: torch.Tensor) -> dict[str, Any]:
    import deepspeed

    import actcfg

    model, _ = offload_blocks(N_BLOCKS)
    handle = actcfg.apply(model, cfg, backend=backend) if cfg else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 3}})
    losses = []
    for _ in range(ENGINE_STEPS):
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weight = model.blocks[0].fc1.weight
    out = {"losses": losses, "stage": engine.zero_optimization_stage(),
           "shard": [weight.ds_tensor.numel(), weight.ds_numel],
           "recomputes": None if handle is None else handle.counters.recomputes}
    if handle is not None:
        handle.remove()
    return out


def _zero3_worker(rank: int, out_dir: str, port: int) -> None:
    import torch.nn.functional as F

    init_group(rank, port, deepspeed=True)
    _, x = offload_blocks(N_BLOCKS)
    local = x.chunk(WORLD)[rank]  # data parallel: each rank trains on its half of the batch
    linear = F.linear
    result = {}
    for name, cfg, backend in (("plain", None, None), ("torch", FULL, "torch"),
                               ("deepspeed", FULL, "deepspeed")):
        F.linear = linear  # ZeRO-3 replaces it process-wide and never puts it back
        result[name] = _engine_run(cfg, backend, local)
    F.linear = linear
    write_result(out_dir, rank, result)
    finish()


@pytest.mark.deepspeed
def test_zero3_on_two_ranks_trains_to_the_same_losses_under_a_policy_on_either_backend(tmp_path):
    gloo_or_skip()
    pytest.importorskip("deepspeed")
    ranks = run_ranks(_zero3_worker, tmp_path)
    for rank, result in enumerate(ranks):
        plain = result["plain"]
        assert plain["stage"] == 3
        assert plain["shard"] == [128 * 64 // WORLD, 128 * 64]  # each rank holds half of fc1
        for backend in ("torch", "deepspeed"):
            r = result[backend]
            assert r["losses"] == pytest.approx(plain["losses"], rel=1e-5), (rank, backend)
            assert r["recomputes"] == ENGINE_STEPS * N_BLOCKS
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]  # each rank its own data


# --- actcfg verify on two ranks: gather, judge, render; the CLI under a torchrun environment -----
# The GPU measurement itself needs CUDA (tests/runtime/test_distributed.py runs it); here each rank
# stands in synthetic numbers for it, and everything after (the gather over a real gloo group,
# the judging, the rendering, the CLI's group, output and exit codes) runs for real.

B = 1 << 20  # one block input of the synthetic measurements
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PARTITION_CONFIG = CONFIGS / "deepspeed-partition-model-parallel.yaml"


def synthetic(per_block: int, grad_error: float = 0.0) -> Any:
    """Measurements of 8 blocks whose checkpoint memory grows by `per_block` bytes per block."""
    from actcfg.verification import GradDiff, Measurements, RunMeasurement

    return Measurements(
        blocks=tuple(f"blocks.{i}" for i in range(8)), block_input_bytes=B,
        plain=RunMeasurement(tuple(4 * B * (i + 1) for i in range(8)), 40 * B, 0.010),
        policy=RunMeasurement(tuple(B + per_block * i for i in range(8)), 10 * B, 0.012),
        grads=(GradDiff("blocks.0.fc1.weight", grad_error),), dtype="bfloat16", mp_size=WORLD,
        recomputes=8)


def _gather_worker(rank: int, out_dir: str, port: int) -> None:
    from actcfg.errors import VerifyError
    from actcfg.policy.schema import Policy
    from actcfg.verification import VerifyReport, judge_ranks
    from actcfg.verification.measure import gather_ranks
    from actcfg.verification.render import render_text

    init_group(rank, port)
    policy = Policy.model_validate(PARTITION)
    # Rank 1 keeps whole block inputs: the partition promise must fail there, and so overall.
    ranks = gather_ranks(synthetic(B // 2 if rank == 0 else B))
    report = VerifyReport(policy, "deepspeed", ranks[0], tuple(judge_ranks(policy, ranks)), ranks)
    try:
        gather_ranks("the model failed under the policy: CUDA out of memory" if rank == 1
                     else synthetic(B // 2))
        failure = "no error"
    except VerifyError as e:
        failure = str(e)
    write_result(out_dir, rank, {"ok": report.ok, "text": render_text(report), "failure": failure,
                                 "mp_sizes": [m.mp_size for m in ranks]})
    finish()


def test_verify_gathers_every_ranks_measurements_and_all_ranks_reach_one_verdict(tmp_path):
    gloo_or_skip()
    ranks = run_ranks(_gather_worker, tmp_path)
    assert ranks[0] == ranks[1]  # every rank judged every rank's numbers alike
    r = ranks[0]
    assert r["ok"] is False and r["mp_sizes"] == [2, 2]
    assert r["text"].splitlines()[:5] == [
        "actcfg verify: backend deepspeed, 2 ranks, 8 blocks, bfloat16, 3 steps, "
        "model-parallel size 2",
        "",
        "rank  plain MiB/block  policy MiB/block  plain peak MiB  policy peak MiB  plain ms  "
        "policy ms  offloaded MiB  gradient error",
        "0                 4.0               0.5            40.0             10.0      10.0       "
        "12.0            n/a               0",
        "1                 4.0               1.0            40.0             10.0      10.0       "
        "12.0            n/a               0",
    ]
    assert "FAIL  partition  on rank 1 of 2: partition is on with model-parallel size 2 but held " \
           "checkpoint memory grew by 1.0 MB per block, 1.00 of one block input instead of about " \
           "1/2: the activations were not partitioned\n" in r["text"]
    assert "PASS  gradients  on all 2 ranks; rank 0: gradients match the plain run" in r["text"]
    # A rank that failed still joins the gather: every rank raises the same sentence.
    assert r["failure"] == ("rank 1 of 2 measured nothing: the model failed under the policy: "
                            "CUDA out of memory")


CLI_CASES = {  # name -> what each rank measures (a per-block growth, or an error it raises)
    "pass": (B // 2, B // 2),
    "rank 1 unpartitioned": (B // 2, B),
    "rank 1 failed": (B // 2, "the model failed under the policy: CUDA out of memory"),
}


def _cli_worker(rank: int, out_dir: str, port: int, ports: list[int]) -> None:
    import contextlib
    import io
    import os

    import torch.distributed as dist

    import actcfg.verification
    import actcfg.verification.measure as measure
    from actcfg.cli import main
    from actcfg.errors import VerifyError

    seen: list[Any] = []

    def measured_here(factory: Any, policy: Any, **options: Any) -> Any:
        mpu = options["mpu"]
        seen.append({"mpu_size": dist.get_world_size(mpu), "world": mpu is dist.group.WORLD,
                     "initialised": dist.is_initialized()})
        outcome = CLI_CASES[case][rank]
        if isinstance(outcome, str):
            raise VerifyError(outcome)
        return synthetic(outcome)

    actcfg.verification.require_cuda = measure.require_cuda = lambda: None
    measure.measure_here = measured_here
    result = {}
    for case, case_port in zip(CLI_CASES, ports):
        # What torchrun sets; the CLI starts (and ends) the group itself.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case_port), RANK=str(rank),
                          WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["verify", str(PARTITION_CONFIG), "--model", "actcfg.probes:blocks"])
        result[case] = {"code": code, "out": out.getvalue(), "err": err.getvalue(),
                        "group_left_up": dist.is_initialized()}
    result["seen"] = seen
    write_result(out_dir, rank, result)


@pytest.mark.deepspeed
def test_cli_under_torchrun_prints_once_on_rank_0_and_every_rank_exits_alike(tmp_path):
    gloo_or_skip()
    pytest.importorskip("deepspeed")
    ranks = run_ranks(_cli_worker, tmp_path, [free_port() for _ in CLI_CASES])
    for rank, result in enumerate(ranks):
        # The CLI started a group of both ranks and passed it as the model-parallel group.
        assert result["seen"] == [{"mpu_size": 2, "world": True, "initialised": True}] * 3
        for case in CLI_CASES:
            r = result[case]
            assert r["code"] == {"pass": 0, "rank 1 unpartitioned": 1, "rank 1 failed": 1}[case]
            assert r["group_left_up"] is False
            if rank == 1:
                assert (r["out"], r["err"]) == ("", ""), case  # only rank 0 writes
    zero = ranks[0]
    # stdout holds the report alone (DeepSpeed's own chatter, if any, goes to stderr)...
    assert zero["pass"]["out"].startswith("actcfg verify: backend deepspeed, 2 ranks, 8 blocks")
    assert "PASS  partition  on all 2 ranks; rank 0: held checkpoint memory grew by 0.5 MB per " \
           "block, 0.50 of one block input (about 1/2 or less)\n" in zero["pass"]["out"]
    assert "FAIL  partition  on rank 1 of 2: " in zero["rank 1 unpartitioned"]["out"]
    assert zero["rank 1 failed"]["out"] == ""
    # ...and stderr validate's warning (it cannot know about torchrun), then any error, once.
    ours = {case: [line for line in zero[case]["err"].splitlines()
                   if line.startswith((str(PARTITION_CONFIG), "actcfg"))] for case in CLI_CASES}
    warning = f"{PARTITION_CONFIG}:10:12: warning partition-needs-model-parallel: "
    assert [line[:len(warning)] for line in ours["pass"]] == [warning]
    assert ours["rank 1 failed"][1:] == [
        "actcfg: error: rank 1 of 2 measured nothing: the model failed under the policy: CUDA out "
        "of memory"]
