"""verification.measure on CPU tensors: what it reads from the handle, the seeded dropout masks,
gradient comparison and dtype. The measurement itself is in test_verify_cuda.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from actcfg.verification import GradDiff

from _verify_cases import OFFLOAD, ROOT, policy


def _handle(torch, model, *, checkpointed=(), groups=None, engine=None, mp_size=None):
    """The runtime's own handle, with the reports `apply` would have recorded."""
    from actcfg.runtime.reports import CheckpointReport, DeepSpeedReport, OffloadReport
    from actcfg.runtime.handle import AppliedPolicy
    from actcfg.policy.schema import Backend

    handle = AppliedPolicy(model, OFFLOAD, Backend.TORCH)
    if checkpointed:
        handle.set_checkpoint(CheckpointReport("full", "torch.utils.checkpoint.checkpoint",
                                               tuple(checkpointed), 1, False, None))
    if groups is not None:
        handle.set_offload(OffloadReport("actcfg.runtime.offload.OffloadEngine", "all_saved", True, None,
                                         1, "cuda:0", tuple(groups), "top-level children of the model"))
    if mp_size is not None:
        handle.set_deepspeed(DeepSpeedReport({}, {}, mp_size, None, ""), dict)
    handle.engine = engine
    return handle


def test_blocks_are_checkpointed_modules_else_offload_groups_else_top_level_children():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _blocks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert _blocks(_handle(torch, model, checkpointed=("0",), groups=("1",)), model) == ("0",)
    assert _blocks(_handle(torch, model, groups=("1",)), model) == ("1",)
    assert _blocks(_handle(torch, model), model) == ("0", "1")


def test_blocks_of_a_rules_policy_are_every_module_a_rule_took():
    torch = pytest.importorskip("torch")
    from actcfg.api import apply
    from actcfg.verification.measure import _blocks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with apply(model, {"version": 1, "checkpoint": {"mode": "rules", "rules": [
            {"modules": ["2"], "mode": "full"}, {"modules": ["0"], "mode": "none"}]}}) as handle:
        assert handle.checkpointed == ("2",)
        assert _blocks(handle, model) == ("0", "2")


def test_host_bytes_are_the_engines_account_read_from_handle_engine():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from actcfg.runtime.offload import OffloadStats
    from actcfg.verification.measure import _host_bytes

    model = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(stats=OffloadStats(pinned_bytes=3, pageable_bytes=4))
    assert _host_bytes(_handle(torch, model, engine=engine, groups=("0",)), None) == (3, 4)
    assert _host_bytes(_handle(torch, model, groups=("0",)), None) == (None, None)


def test_a_handle_without_the_runtimes_attributes_is_not_guessed_at():
    # verify read `handle.groups` and an engine under `handle.offload`, which the runtime never
    # sets: such a handle silently measured the wrong blocks instead of failing.
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from actcfg.runtime.offload import OffloadStats
    from actcfg.verification.measure import _blocks, _host_bytes

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(AttributeError, match=r"'checkpointed'"):
        _blocks(SimpleNamespace(groups=("1",)), model)
    with pytest.raises(AttributeError, match=r"'engine'"):
        _host_bytes(SimpleNamespace(offload=SimpleNamespace(stats=OffloadStats())), None)


def test_a_process_group_counts_with_its_size():
    # apply() takes a ProcessGroup as mpu=; verify once counted it as size 1 and failed `partition`.
    # A fresh process: torch's fake two-rank world needs no default group to exist already, and
    # the DeepSpeed tests keep one for the whole session.
    pytest.importorskip("torch")
    code = (
        "import torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from actcfg.runtime.deepspeed_applier import as_mpu, model_parallel_size\n"
        "dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())\n"
        "print(model_parallel_size(as_mpu(dist.group.WORLD)), model_parallel_size(as_mpu(None)))\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stdout) == (0, "2 1\n"), done.stderr


def test_mp_size_is_what_deepspeed_read_back_after_configure():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _mp_size

    assert _mp_size(_handle(torch, torch.nn.Linear(2, 2), mp_size=4)) == 4
    assert _mp_size(_handle(torch, torch.nn.Linear(2, 2))) == 1


def test_an_mpu_deepspeed_cannot_read_is_refused():
    from actcfg.runtime.deepspeed_applier import model_parallel_size
    from actcfg.errors import PolicyApplyError

    with pytest.raises(PolicyApplyError, match=r"^mpu='object' has neither get_tensor_model_par"):
        model_parallel_size(object())


# --- RNG: both runs draw the same dropout masks; the caller's state is put back ----------------


def _dropout_steps(torch, steps: int) -> list:
    """What a train-mode Dropout draws in each step of one run, seeded as _measure seeds it."""
    from actcfg.verification.measure import _seed_step

    drop = torch.nn.Dropout(0.5).train()
    masks = []
    for step in range(steps):
        _seed_step(step)
        masks.append(drop(torch.ones(256)) != 0)
    return masks


def test_the_plain_and_policy_runs_draw_the_same_dropout_masks_step_by_step():
    # Unseeded, the policy run continued the plain run's RNG stream: other dropout masks, other
    # gradients, and a false `gradients` failure for any model with dropout in train mode.
    torch = pytest.importorskip("torch")
    plain = _dropout_steps(torch, 3)
    torch.rand(7)  # whatever the plain run drew outside the seeded steps
    policy = _dropout_steps(torch, 3)
    assert all(torch.equal(p, q) for p, q in zip(plain, policy))
    assert not torch.equal(plain[0], plain[1])  # each step its own seed, not one mask for all


def test_the_seeded_runs_put_the_callers_rng_state_back():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _caller_rng_kept, _seed_step

    torch.manual_seed(99)
    before = torch.get_rng_state()
    with _caller_rng_kept():
        _seed_step(0)
        torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)


# --- gradient comparison and dtype, on CPU tensors ---------------------------------------------


def _pair(torch):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    b = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1
        q.grad = p.grad.clone()
    return a, b


def test_grad_diffs_are_max_abs_error_over_max_abs_plain():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _grad_diffs

    a, b = _pair(torch)
    b[0].weight.grad[0, 0] += 8.0  # plain max |g| of 0.weight is 16
    b[0].bias.grad = None
    b[1].weight.grad[1, 1] = float("nan")
    assert _grad_diffs(a, b) == (
        GradDiff("0.weight", 0.5),
        GradDiff("0.bias", math.inf, "got no gradient under the policy"),
        GradDiff("1.weight", math.inf, "has a non-finite gradient under the policy"),
    )


def test_equal_gradients_have_zero_error():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _grad_diffs

    a, b = _pair(torch)
    assert [g.error for g in _grad_diffs(a, b)] == [0.0, 0.0, 0.0]


def test_dtype_is_the_loosest_of_parameters_and_inputs():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _loosest_dtype

    model = torch.nn.Linear(2, 2)
    assert _loosest_dtype(model, ((torch.ones(2),), {})) == "float32"
    assert _loosest_dtype(model, ((torch.ones(2, dtype=torch.bfloat16),), {})) == "bfloat16"
    assert _loosest_dtype(model.half(), ((torch.ones(2, dtype=torch.long),), {})) == "float16"


def test_default_loss_is_nonlinear_in_the_output():
    torch = pytest.importorskip("torch")
    from actcfg.runtime.step import default_loss

    out = torch.tensor([1.0, -2.0], dtype=torch.float16)
    loss = default_loss((out, "aux"))
    assert loss.dtype == torch.float32 and loss.item() == 5.0
