"""actcfg.apply with the deepspeed backend, through the real DeepSpeed package on the CPU
(single-process gloo group): configure() state read back, routing, names, gradients, remove.

cpu_checkpointing alone breaks backward on DeepSpeed's CPU accelerator (BACKENDS.md 1.3) and
partition needs a model-parallel group > 1, so the input-emptying guard is proven on CUDA
(tests/runtime/test_runtime_cuda.py); here it is tested by emptying the alias the way DeepSpeed does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

try:
    from tests._deepspeed_env import ds_env, ds_globals
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env, ds_globals

from actcfg.runtime import deepspeed_applier as _apply_deepspeed
from actcfg.errors import PolicyApplyError
from actcfg.probes import linear_chain
from actcfg.api import apply, mpu_from_group
from _helpers import small_blocks, train_step

__all__ = ["ds_env"]

pytestmark = pytest.mark.deepspeed

DEFAULTS = {"partition_activations": False, "contiguous_checkpointing": False, "num_checkpoints": None,
            "checkpoint_in_cpu": False, "synchronize": False, "profile": False}


def ds_policy(**extra) -> dict:
    return {"version": 1, "backend": "deepspeed",
            "checkpoint": {"mode": "full", "modules": ["Block"]}, **extra}


def module_state(model: nn.Module) -> list:
    return [(n, sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks))
            for n, m in model.named_modules()]


@pytest.fixture
def ckpt(ds_env):
    """DeepSpeed's checkpointing module, reset to defaults around each test."""
    ds_env._configure_defaults()
    yield ds_env
    assert _apply_deepspeed._LIVE == [], "a test left a DeepSpeed policy applied"
    ds_env._configure_defaults()


@pytest.mark.parametrize("kwargs", [
    {"partition_activations": True},
    {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 3},
    {"checkpoint_in_cpu": True},
    {"synchronize": True},
    {"profile": True},
])
def test_the_read_back_table_is_what_configure_sets(ckpt, kwargs):
    """actcfg reads DeepSpeed's state through a kwarg -> global table; configure() itself is
    the oracle: each keyword changes exactly the global the table names for it."""
    from actcfg.runtime.deepspeed_applier import GLOBAL_BY_KWARG

    before = {name: getattr(ckpt, name) for name in GLOBAL_BY_KWARG.values()}
    ckpt.configure(None, **kwargs)
    after = {name: getattr(ckpt, name) for name in GLOBAL_BY_KWARG.values()}
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {GLOBAL_BY_KWARG[k] for k in kwargs}
    assert {k: ds_globals(ckpt)[k] for k in kwargs} == kwargs


def test_configures_every_kwarg_and_reads_the_state_back(ckpt):
    model, x = small_blocks(3)
    handle = apply(model, ds_policy(synchronize=True, profile=True))
    want = {**DEFAULTS, "synchronize": True, "profile": True}
    assert ds_globals(ckpt) == want
    assert ckpt.is_configured()
    assert handle.deepspeed.configure_kwargs == want
    assert handle.deepspeed.state == {**want, "is_configured": True, "mp_size": 1}
    assert handle.checkpointed == ("blocks.0", "blocks.1", "blocks.2")
    assert handle.checkpoint_api == "deepspeed.checkpointing.checkpoint"
    assert handle.summary() == (
        "actcfg: backend deepspeed; full checkpointing of 3 modules (blocks.0, blocks.1, blocks.2) "
        "via deepspeed.checkpointing.checkpoint; "
        "deepspeed.checkpointing.configure(synchronize, profile)"
    )
    handle.remove()


def test_backend_argument_overrides_the_policy_backend(ckpt):
    model, _ = small_blocks(3)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}}
    with apply(model, cfg, backend="deepspeed") as handle:
        assert handle.checkpoint_api == "deepspeed.checkpointing.checkpoint"


def test_routes_through_deepspeed_checkpoint_with_same_gradients(ckpt, monkeypatch):
    model, x = small_blocks(3)
    plain = copy.deepcopy(model)
    calls = []
    real = ckpt.CheckpointFunction.apply

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(ckpt.CheckpointFunction, "apply", counting)
    with apply(model, ds_policy()):
        got, want = train_step(model, x), train_step(plain, x)
        assert len(calls) == 3  # one DeepSpeed checkpoint per block, per forward
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_first_module_gets_gradients_although_the_input_needs_none(ckpt):
    # DeepSpeed's checkpoint is reentrant: without an input that requires grad the first
    # routed module's parameters would get no gradient at all.
    torch.manual_seed(0)
    model, x = linear_chain(n=3, width=16, shape=(4,), dtype=torch.float32, device="cpu")
    plain = copy.deepcopy(model)
    cfg = {"version": 1, "backend": "deepspeed", "checkpoint": {"mode": "full", "modules": ["Linear"]}}
    with apply(model, cfg):
        assert not x.requires_grad
        got, want = train_step(model, x), train_step(plain, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_names_and_state_dict_unchanged_and_remove_restores(ckpt):
    model, x = small_blocks(3)
    names = ([n for n, _ in model.named_modules()], [n for n, _ in model.named_parameters()],
             list(model.state_dict()))
    before = module_state(model)
    handle = apply(model, ds_policy(synchronize=True))
    assert ([n for n, _ in model.named_modules()], [n for n, _ in model.named_parameters()],
            list(model.state_dict())) == names
    fresh = small_blocks(3)[0]
    fresh.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(fresh.state_dict(), strict=True)
    handle.remove()
    assert module_state(model) == before
    assert ds_globals(ckpt) == DEFAULTS


def test_remove_restores_the_state_from_before_apply(ckpt):
    ckpt.configure(None, synchronize=True)
    model, _ = small_blocks(3)
    apply(model, ds_policy(profile=True)).remove()
    assert ds_globals(ckpt) == {**DEFAULTS, "synchronize": True}


def test_deepcopy_routes_with_its_own_weights(ckpt):
    model, x = small_blocks(3)
    with apply(model, ds_policy()):
        reference = copy.deepcopy(model)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        expected = small_blocks(3)[0]
        expected.load_state_dict(twin.state_dict())
        torch.testing.assert_close(twin(x), expected(x), rtol=0, atol=0)
        for (n, g), (_, w) in zip(train_step(twin, x).items(), train_step(expected, x).items()):
            assert torch.equal(g, w), n
        for (n, g), (_, w) in zip(train_step(model, x).items(), train_step(reference, x).items()):
            assert torch.equal(g, w), n


def test_alias_guard_keeps_the_callers_tensor_when_deepspeed_empties_its_input(ckpt, monkeypatch):
    """Do to the alias what DeepSpeed's partition/cpu paths do (`arg.data = torch.empty([])`,
    ckpt.py:456/491/545): a residual around the routed block must still see its input."""
    real = ckpt.checkpoint

    def emptying(function, *args, **kwargs):
        out = real(function, *args, **kwargs)
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point():
                a.saved_data = a.data  # DeepSpeed's backward puts it back from here (ckpt.py:700)
                a.data = torch.empty([], device=a.device).data
        return out

    class Residual(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.inner(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Residual(nn.Sequential(nn.Linear(16, 16), nn.GELU())))
    x = torch.randn(4, 16)
    plain = copy.deepcopy(model)
    monkeypatch.setattr(ckpt, "checkpoint", emptying)
    cfg = {"version": 1, "backend": "deepspeed", "checkpoint": {"mode": "full", "modules": ["1.inner"]}}
    with apply(model, cfg):
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
        got, want = train_step(model, x), train_step(plain, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_alias_is_not_a_view_so_it_holds_no_reference_to_the_caller():
    x = torch.randn(4, requires_grad=True) * 1.0
    alias = _apply_deepspeed.fresh_alias(x)
    assert alias is not x and alias._base is None and alias.data_ptr() == x.data_ptr()
    alias.data = torch.empty([]).data
    assert x.shape == (4,)
    alias2 = _apply_deepspeed.fresh_alias(x)
    alias2.sum().backward()
    assert alias2.grad_fn is not None


def test_partition_without_model_parallel_group_is_refused(ckpt):
    model, _ = small_blocks(3)
    before = module_state(model)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, ds_policy(partition=True))
    assert str(info.value) == (
        "partition: true needs a model-parallel group larger than one, and no mpu= was given: "
        "DeepSpeed would shard nothing, and on one GPU its partition path returned wrong "
        "gradients in three of four small models; pass mpu= with model-parallel size > 1, or set "
        "`partition: false`"
    )
    import torch.distributed as dist

    with pytest.raises(PolicyApplyError, match=r"^partition: true needs a model-parallel group "
                       r"larger than one, and mpu= has model-parallel size 1: "):
        apply(model, ds_policy(partition=True), mpu=mpu_from_group(dist.group.WORLD))
    assert module_state(model) == before
    assert ds_globals(ckpt) == DEFAULTS


def test_mpu_from_group_answers_what_deepspeed_asks(ckpt):
    import torch.distributed as dist

    mpu = mpu_from_group(dist.group.WORLD)
    assert (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) == (0, 1)
    assert mpu.get_tensor_model_parallel_group() is dist.group.WORLD
    model, _ = small_blocks(3)
    with apply(model, ds_policy(), mpu=dist.group.WORLD) as handle:  # a group works directly
        assert ckpt.mpu is not None and ckpt.mp_size == 1
        assert handle.deepspeed.mp_size == 1
    assert ckpt.mpu is None


def test_two_policies_on_the_same_group_share_deepspeed(ckpt):
    import torch.distributed as dist

    a, _ = small_blocks(3)
    b, _ = small_blocks(3)
    with apply(a, ds_policy(), mpu=dist.group.WORLD), apply(b, ds_policy(), mpu=dist.group.WORLD):
        assert len(_apply_deepspeed._LIVE) == 2
    assert ckpt.mpu is None


def test_cpu_checkpointing_on_deepspeeds_cpu_accelerator_is_refused(ckpt):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed runs on a GPU accelerator here")
    model, _ = small_blocks(3)
    before = module_state(model)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, ds_policy(cpu_checkpointing=True))
    assert str(info.value) == (
        "cpu_checkpointing: true with the deepspeed backend needs a GPU: DeepSpeed's CPU "
        "accelerator offloads nothing useful and its backward fails; set "
        "`cpu_checkpointing: false` to run on the CPU"
    )
    assert module_state(model) == before
    assert ds_globals(ckpt) == DEFAULTS


def test_an_mpu_without_the_queries_is_refused(ckpt):
    model, _ = small_blocks(3)
    with pytest.raises(PolicyApplyError, match=r"^mpu='object' has neither get_tensor_model_parallel_"):
        apply(model, ds_policy(), mpu=object())


def test_num_checkpoints_below_routed_modules_is_refused(ckpt):
    class MP:  # a model-parallel unit of size 2, as DeepSpeed reads one; nothing runs
        def get_model_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return 2

        def get_model_parallel_group(self):
            return None

    model, _ = small_blocks(3)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, ds_policy(partition=True, contiguous=True, num_checkpoints=2), mpu=MP())
    assert str(info.value) == (
        "num_checkpoints: 2 is fewer than the 3 modules routed through "
        "deepspeed.checkpointing.checkpoint (DeepSpeed's contiguous buffers would fail with "
        "IndexError); set `num_checkpoints: 3` or more"
    )


def test_a_second_policy_with_other_settings_is_refused_while_one_is_live(ckpt):
    a, _ = small_blocks(3)
    b, _ = small_blocks(3)
    with apply(a, ds_policy(synchronize=True)):
        with pytest.raises(PolicyApplyError, match=r"^another DeepSpeed policy is live in this process"):
            apply(b, ds_policy())
        with apply(b, ds_policy(synchronize=True)):  # the same settings may share the globals
            pass
        assert ds_globals(ckpt)["synchronize"] is True  # still live for `a`
    assert ds_globals(ckpt) == DEFAULTS


def test_a_state_mismatch_after_configure_fails_loudly_and_undoes(ckpt, monkeypatch):
    real = ckpt.configure

    def lossy(mpu, **kwargs):  # a DeepSpeed that drops a kwarg, as readers have done
        real(mpu, **{**kwargs, "profile": None})

    monkeypatch.setattr(ckpt, "configure", lossy)
    model, _ = small_blocks(3)
    before = module_state(model)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, ds_policy(profile=True))
    assert str(info.value) == (
        "DeepSpeed's activation-checkpointing state after configure() differs from the policy: "
        "profile: wanted True, DeepSpeed has False"
    )
    assert module_state(model) == before
    assert ds_globals(ckpt) == DEFAULTS


def test_a_configure_that_fails_half_way_is_undone(ckpt, monkeypatch):
    ckpt.configure(None, synchronize=True)
    real = ckpt.configure

    def failing(mpu, **kwargs):  # resets the globals, then asserts, as DeepSpeed's own checks do
        real(mpu, **{**kwargs, "synchronize": False})
        raise AssertionError("Must specify the number of layers with contiguous memory checkpointing")

    monkeypatch.setattr(ckpt, "configure", failing)
    model, _ = small_blocks(3)
    with pytest.raises(PolicyApplyError, match=r"^deepspeed\.checkpointing\.configure refused the "
                       r"policy: AssertionError\('Must specify the number of layers"):
        apply(model, ds_policy())
    assert ds_globals(ckpt) == {**DEFAULTS, "synchronize": True}
    assert _apply_deepspeed._LIVE == []


def test_no_grad_forward_bypasses_deepspeed(ckpt, monkeypatch):
    model, x = small_blocks(3)
    plain = copy.deepcopy(model)
    calls = []
    monkeypatch.setattr(ckpt.CheckpointFunction, "apply", lambda *a: calls.append(a))
    with apply(model, ds_policy()), torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert calls == []


def test_an_exception_in_a_routed_forward_leaves_the_next_step_working(ckpt):
    model, x = small_blocks(3)
    plain = copy.deepcopy(model)
    with apply(model, ds_policy()):
        with pytest.raises(RuntimeError):
            model(x[..., :5])  # wrong width: fails inside the routed block
        got, want = train_step(model, x), train_step(plain, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
