"""actcfg.apply on the CPU with real torch: wrapping, names, gradients, recompute, remove, errors."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from actcfg.errors import ActcfgError, PolicyApplyError
from actcfg.probes import Block, blocks, linear_chain
from actcfg.api import AppliedPolicy, apply
from actcfg.runtime.wrap import select_modules
from _helpers import offload_blocks, saved_bytes, small_blocks, train_step

API = "torch.utils.checkpoint.checkpoint"
NON_REENTRANT = {"use_reentrant": False, "preserve_rng_state": True}

# name -> (checkpoint section without modules, the kwargs the handle reports the api called with)
MODES = {
    "full": ({"mode": "full"}, NON_REENTRANT),
    "reentrant": ({"mode": "full", "reentrant": True}, {"use_reentrant": True, "preserve_rng_state": True}),
    "selective": ({"mode": "selective"}, NON_REENTRANT),
    "every2": ({"mode": "full", "every": 2}, NON_REENTRANT),
}


def policy(mode: str, modules: list[str]) -> dict:
    return {"version": 1, "checkpoint": {**MODES[mode][0], "modules": modules}}


def small_chain(n: int = 4) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return linear_chain(n=n, width=16, shape=(8,), dtype=torch.float32, device="cpu")


def names(model: nn.Module) -> tuple:
    return ([n for n, _ in model.named_modules()], [n for n, _ in model.named_parameters()],
            list(model.state_dict()))


def module_state(model: nn.Module) -> list:
    """Everything apply may touch on each module: __dict__ keys and the four hook tables."""
    return [(n, sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks),
             dict(m._forward_hooks_always_called), dict(m._forward_pre_hooks_with_kwargs))
            for n, m in model.named_modules()]


# --- wrapping ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_wraps_selected_modules_with_the_reported_api(mode):
    model, _ = small_blocks()
    handle = apply(model, policy(mode, ["Block"]))
    want = ("blocks.1", "blocks.3") if mode == "every2" else tuple(f"blocks.{i}" for i in range(4))
    assert handle.checkpointed == want
    assert handle.checkpoint_api == API
    assert handle.checkpoint.kwargs == MODES[mode][1]
    assert isinstance(handle, AppliedPolicy) and not handle.removed
    for name, module in model.named_modules():
        wrapped = name in want
        assert ("_actcfg_wrapped" in module.__dict__) == wrapped, name
        assert ("forward" in module.__dict__) == wrapped, name
        assert not module._forward_pre_hooks and not module._forward_hooks, name


@pytest.mark.parametrize("mode", list(MODES))
def test_apply_executes_the_translated_plan(mode):
    """What `actcfg translate --backend torch` prints is what runs: the same api and kwargs."""
    from actcfg.policy.checker import load
    from actcfg.translators import to_torch_native

    model, _ = small_blocks()
    cfg = policy(mode, ["Block"])
    plan = to_torch_native(load(cfg)).checkpoint
    handle = apply(model, cfg)
    assert (handle.checkpoint_api, handle.checkpoint.kwargs) == (plan.api, plan.kwargs())


def test_every_counts_matches_in_module_order():
    model, _ = small_chain(6)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Linear"], "every": 3}}
    assert apply(model, cfg).checkpointed == ("2", "5")


def test_qualified_name_star_does_not_cross_dots():
    model, _ = small_blocks(2)
    assert [n for n, _ in select_modules(model, ("blocks.*",), 1)] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in select_modules(model, ("blocks.*.fc?",), 1)] == [
        "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]


def test_summary_is_logged_once(caplog):
    model, _ = small_blocks(2)
    with caplog.at_level(logging.INFO, logger="actcfg"):
        handle = apply(model, policy("full", ["Block"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "actcfg"]
    assert lines == [handle.summary()]
    assert handle.summary() == (
        "actcfg: backend torch; full checkpointing of 2 modules (blocks.0, blocks.1) "
        "via torch.utils.checkpoint.checkpoint"
    )


def test_report_is_plain_data():
    model, _ = small_blocks(2)
    handle = apply(model, policy("selective", ["Block"]))
    report = handle.report()
    assert report["backend"] == "torch"
    assert report["checkpoint"]["modules"] == ["blocks.0", "blocks.1"]
    assert report["checkpoint"]["save_ops"][0] == "aten.mm"
    assert report["offload"] is None and report["deepspeed"] is None
    assert report["effect"] == {"checkpoint": {"calls": 0, "runs": 0, "recomputes": 0}, "offload": None}
    json.dumps(report)


def test_cfg_can_be_yaml_text_or_policy_object():
    from actcfg.policy.checker import load

    text = "version: 1\ncheckpoint:\n  mode: full\n  modules: [Block]\n"
    a, _ = small_blocks(2)
    b, _ = small_blocks(2)
    assert apply(a, text).checkpointed == apply(b, load(text)).checkpointed == ("blocks.0", "blocks.1")


# --- names, state_dict, optimizer ----------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_names_state_dict_and_optimizer_groups_unchanged(mode):
    model, _ = small_blocks()
    before = names(model)
    opt = torch.optim.AdamW(model.parameters())
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    handle = apply(model, policy(mode, ["Block"]))
    assert names(model) == before
    assert [[id(p) for p in g["params"]] for g in torch.optim.AdamW(model.parameters()).param_groups] == groups
    handle.remove()
    assert names(model) == before


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_round_trips_with_and_without_actcfg(mode):
    plain, x = small_blocks()
    applied = copy.deepcopy(plain)
    with torch.no_grad():
        for p in applied.parameters():
            p.add_(1.0)
    apply(applied, policy(mode, ["Block"]))
    fresh = copy.deepcopy(plain)
    fresh.load_state_dict(applied.state_dict(), strict=True)  # saved with actcfg, loaded without
    torch.testing.assert_close(fresh(x), applied(x), rtol=0, atol=0)
    applied.load_state_dict(plain.state_dict(), strict=True)  # saved without, loaded with
    torch.testing.assert_close(applied(x), plain(x), rtol=0, atol=0)


# --- gradients and recompute ------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("probe", [small_blocks, small_chain])
def test_gradients_identical_to_plain_model(mode, probe):
    model, x = probe()
    plain = copy.deepcopy(model)
    pattern = "Block" if probe is small_blocks else "Linear"
    apply(model, policy(mode, [pattern]))
    want = train_step(plain, x)
    got = train_step(model, x)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name  # CPU fp32: bitwise
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def block_flops(d: int, ffn: int, tokens: int) -> dict[str, int]:
    """Forward matmul FLOPs of one `Block` by layer (FlopCounterMode counts 2*m*n*k)."""
    return {"qkv": 2 * tokens * d * 3 * d, "proj": 2 * tokens * d * d,
            "fc1": 2 * tokens * d * ffn, "fc2": 2 * tokens * ffn * d}


def count_flops(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        model(x).square().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(("mode", "recomputed"), [
    # Non-reentrant checkpoint stops recomputing once the last saved tensor is regenerated
    # (early_stop): fc2's saved input is GELU's output, so fc2 itself is never rerun.
    ("full", ("qkv", "proj", "fc1")),
    ("every2", ("qkv", "proj", "fc1")),
    ("reentrant", ("qkv", "proj", "fc1", "fc2")),
    # The default save list keeps every matmul output: nothing with FLOPs is recomputed.
    ("selective", ()),
])
def test_recompute_costs_exactly_the_recomputed_forward(mode, recomputed):
    model, x = small_blocks()
    x.requires_grad_()  # so that plain and reentrant runs both compute the input gradient
    plain = count_flops(copy.deepcopy(model), x)
    handle = apply(model, policy(mode, ["Block"]))
    per_block = block_flops(32, 64, 2 * 8)
    extra = len(handle.checkpointed) * sum(per_block[k] for k in recomputed)
    assert count_flops(model, x) == plain + extra


def test_selective_with_a_narrower_save_list_recomputes_what_is_not_saved():
    model, x = small_blocks()
    x.requires_grad_()
    plain = count_flops(copy.deepcopy(model), x)
    cfg = {"version": 1, "checkpoint": {"mode": "selective", "modules": ["Block"], "save_ops": ["aten.mm"]}}
    apply(model, cfg)  # nn.Linear with a bias runs aten.addmm: not saved, so recomputed
    per_block = block_flops(32, 64, 16)
    assert count_flops(model, x) == plain + 4 * (per_block["qkv"] + per_block["proj"] + per_block["fc1"])


@pytest.mark.parametrize("mode", list(MODES))
def test_no_grad_and_eval_forwards_do_not_recompute(mode):
    model, x = small_blocks()
    plain = copy.deepcopy(model)
    apply(model, policy(mode, ["Block"]))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model.eval()
    plain.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    with torch.no_grad(), FlopCounterMode(display=False) as plain_counter:
        plain(x)
    assert counter.get_total_flops() == plain_counter.get_total_flops()


# --- copies ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_deepcopy_is_independent_and_uses_its_own_weights(mode):
    model, x = small_blocks()
    apply(model, policy(mode, ["Block"]))
    reference = copy.deepcopy(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    # The copy's checkpointed forward runs on the copy's weights, recompute included...
    expected = small_blocks()[0]
    expected.load_state_dict(twin.state_dict())
    torch.testing.assert_close(twin(x), expected(x), rtol=0, atol=0)
    assert train_step(twin, x).keys() == train_step(expected, x).keys()
    for (n, g), (_, w) in zip(train_step(twin, x).items(), train_step(expected, x).items()):
        assert torch.equal(g, w), n
    # ...and the original still computes with its own.
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for (n, g), (_, w) in zip(train_step(model, x).items(), train_step(reference, x).items()):
        assert torch.equal(g, w), n
    assert all(p.grad is None or not torch.equal(p.grad, q.grad)
               for p, q in zip(model.parameters(), twin.parameters()) if p.grad is not None)


def test_a_copy_of_an_applied_model_cannot_be_applied_again():
    model, _ = small_blocks(2)
    apply(model, policy("reentrant", ["Block"]))
    twin = copy.deepcopy(model)
    with pytest.raises(PolicyApplyError, match=r"^the model already carries an actcfg policy"):
        apply(twin, policy("full", ["Block"]))


# --- apply twice, remove -------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_applying_twice_is_an_error_and_wraps_nothing_more(mode):
    model, x = small_blocks()
    handle = apply(model, policy(mode, ["Block"]))
    state = module_state(model)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, policy(mode, ["Block"]))
    assert str(info.value) == (
        f"the model already carries an actcfg policy ({handle.summary()}); call remove() on the "
        "handle apply() returned before applying again (a copy.deepcopy of an applied model "
        "carries the policy with it: actcfg.strip_policy(copy) takes it off)"
    )
    assert module_state(model) == state


def test_applying_to_a_submodule_of_an_applied_model_is_an_error():
    model, _ = small_blocks(2)
    apply(model, policy("full", ["Block"]))
    with pytest.raises(PolicyApplyError, match=r"^the model already carries an actcfg policy "
                       r"\(checkpointed \(full\)\); "):
        apply(model.blocks[0], policy("full", ["Linear"]))


def test_torch_composable_checkpoint_already_applied_is_refused():
    from torch.distributed._composable import checkpoint

    model, _ = small_blocks(2)
    checkpoint(model.blocks[0])
    with pytest.raises(PolicyApplyError, match=r"^`blocks\.0` is already checkpointed by "
                       r"torch\.distributed\._composable\.checkpoint; "):
        apply(model, policy("full", ["Block"]))


@pytest.mark.parametrize("mode", list(MODES))
def test_remove_restores_every_module_exactly(mode):
    model, x = small_blocks()
    before = module_state(model)
    plain = copy.deepcopy(model)
    with apply(model, policy(mode, ["Block"])) as handle:
        assert module_state(model) != before
    assert handle.removed
    assert module_state(model) == before
    handle.remove()  # idempotent
    x.requires_grad_()
    assert count_flops(model, x) == count_flops(plain, x)  # nothing is recomputed any more
    again = apply(model, policy(mode, ["Block"]))  # and a policy can be applied afresh
    assert again.checkpointed


def test_an_instance_forward_set_before_apply_is_wrapped_and_restored():
    model, x = small_blocks(2)
    block = model.blocks[0]
    calls = []

    def spy(inp):
        calls.append(inp.shape)
        return Block.forward(block, inp)

    block.forward = spy
    handle = apply(model, policy("reentrant", ["Block"]))
    train_step(model, x)
    assert len(calls) == 2  # forward, then the recompute in backward
    handle.remove()
    assert block.forward is spy


# --- errors ------------------------------------------------------------------------------


def test_pattern_matching_nothing_names_it_and_what_exists():
    model, _ = small_blocks(2)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, policy("full", ["Block", "TransformerLayer"]))
    assert str(info.value) == (
        "checkpoint.modules: pattern 'TransformerLayer' matches no module of BlockStack; "
        "class names here: Block, BlockStack, LayerNorm, Linear, ModuleList; "
        "qualified names: blocks, blocks.0, blocks.0.norm1, blocks.0.qkv, blocks.0.proj, "
        "blocks.0.norm2, ..."
    )
    assert module_state(model) == module_state(small_blocks(2)[0])


def test_nested_matches_are_refused():
    model, _ = small_blocks(2)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, policy("full", ["Block", "Linear"]))
    assert str(info.value) == (
        "checkpoint.modules: `blocks.0` (Block) and its submodule `blocks.0.qkv` (Linear) are "
        "both matched: nested checkpointing recomputes the inner module twice; narrow the "
        "patterns so that only one of them matches"
    )


def test_a_container_without_forward_is_refused():
    model, _ = small_blocks(2)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, policy("full", ["blocks"]))
    assert str(info.value) == (
        "checkpoint.modules: `blocks` (ModuleList) has no forward of its own (a container); "
        "checkpoint its children instead, such as `blocks.*`"
    )


def test_unknown_save_op_is_refused():
    model, _ = small_blocks(2)
    cfg = {"version": 1, "checkpoint": {"mode": "selective", "modules": ["Block"],
                                        "save_ops": ["aten.mm", "aten.not_an_op"]}}
    with pytest.raises(PolicyApplyError) as info:
        apply(model, cfg)
    assert str(info.value) == (
        f"checkpoint.save_ops: 'aten.not_an_op' is not an op torch {torch.__version__} knows; "
        "write `namespace.op` or `namespace.op.overload`, such as `aten.mm` (see torch.ops.aten)"
    )


def test_save_op_resolves_to_every_overload_or_the_named_one():
    from actcfg.runtime.torch_applier import resolve_ops

    assert set(resolve_ops(("aten.mm",))) == {getattr(torch.ops.aten.mm, o) for o in torch.ops.aten.mm.overloads()}
    assert torch.ops.aten.mm.default in resolve_ops(("aten.mm",))
    assert resolve_ops(("aten.mm.out",)) == [torch.ops.aten.mm.out]


def test_bad_backend_and_mpu_with_torch_are_refused():
    model, _ = small_blocks(2)
    with pytest.raises(ActcfgError, match=r"^unknown backend 'jax': choose one of deepspeed, hf, lightning, torch$"):
        apply(model, policy("full", ["Block"]), backend="jax")
    with pytest.raises(PolicyApplyError, match=r"^mpu= is for the deepspeed backend"):
        apply(model, policy("full", ["Block"]), mpu=object())
    assert module_state(model) == module_state(small_blocks(2)[0])


def test_not_a_module_is_refused():
    with pytest.raises(PolicyApplyError, match=r"^apply\(\) needs a torch\.nn\.Module, got dict$"):
        apply({}, policy("full", ["Block"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only refusal")
@pytest.mark.parametrize("ckpt", [{"mode": "none"}, {"mode": "full", "modules": ["Block"]}])
def test_cpu_offload_without_cuda_is_a_clear_error(ckpt):
    model, _ = small_blocks(2)
    before = module_state(model)
    with pytest.raises(PolicyApplyError) as info:
        apply(model, {"version": 1, "checkpoint": ckpt, "cpu_checkpointing": True})
    assert str(info.value) == (
        "cpu_checkpointing: true needs a CUDA GPU (activations are offloaded from GPU memory to "
        "the host), and torch sees none here; set `cpu_checkpointing: false` to run on the CPU"
    )
    assert module_state(model) == before


class TakesKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


@pytest.mark.parametrize("mode", ["full", "reentrant"])
def test_tensor_keyword_arguments_get_their_gradients(mode):
    torch.manual_seed(0)
    outer = nn.Sequential(TakesKeywords())
    plain = copy.deepcopy(outer)
    apply(outer, policy(mode, ["TakesKeywords"]))
    x = torch.randn(2, 4, requires_grad=True)
    grads = []
    for model in (plain, outer):
        scale = torch.full((1,), 3.0, requires_grad=True)
        model[0](x, scale=scale).square().sum().backward()
        grads.append((x.grad.clone(), scale.grad.clone(), model[0].lin.weight.grad.clone()))
        x.grad = None
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)


# --- faults ------------------------------------------------------------------------------


class Flaky(nn.Module):
    """A block that raises on demand, in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("mode", list(MODES))
def test_an_exception_in_forward_leaves_the_next_step_working(mode):
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), Flaky(), Flaky(), Flaky())
    x = torch.randn(8, 16)
    plain = copy.deepcopy(model)
    before = module_state(model)
    handle = apply(model, policy(mode, ["Flaky"]))
    model[2].fail = True
    with pytest.raises(RuntimeError, match="^boom$"):
        train_step(model, x)
    model[2].fail = False
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    handle.remove()
    assert module_state(model) == before


class _FailInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailInBackward.armed:
            _FailInBackward.armed = False
            raise RuntimeError("boom in backward")
        return grad


class FlakyBackward(Flaky):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailInBackward.apply(torch.relu(self.lin(x)))


@pytest.mark.parametrize("mode", list(MODES))
def test_an_exception_in_backward_leaves_the_next_step_working(mode):
    torch.manual_seed(0)
    model = nn.Sequential(*(FlakyBackward() for _ in range(4)))
    x = torch.randn(8, 16)
    plain = copy.deepcopy(model)
    before = module_state(model)
    handle = apply(model, policy(mode, ["FlakyBackward"]))
    _FailInBackward.armed = True
    with pytest.raises(RuntimeError, match="^boom in backward$"):
        train_step(model, x)
    assert not _FailInBackward.armed
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    handle.remove()
    assert module_state(model) == before


# --- offload wiring, through the real engine on the host (tests/runtime/test_offload.py: the engine) --


@pytest.fixture
def loopback():
    from actcfg.runtime.offload import host_loopback

    with host_loopback():
        yield


def apply_offload(model: nn.Module, cfg: dict) -> AppliedPolicy:
    handle = apply(model, cfg)
    handle.engine.min_offload_bytes = 1 << 14
    return handle


def test_offload_groups_are_the_block_children_and_every_group_but_the_last_moves(loopback):
    model, x = offload_blocks(3)
    plain = copy.deepcopy(model)
    before = module_state(model)
    handle = apply_offload(model, {"version": 1, "cpu_checkpointing": True, "pin_budget": "1GiB"})
    assert handle.offload.groups == ("blocks.0", "blocks.1", "blocks.2")
    assert handle.offload.grouping == "children of `blocks`"
    assert handle.offload.pin is False  # nothing is pinned on the host loopback
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    stats = handle.engine.stats
    assert stats.steps == 1 and stats.groups == 4  # one open before the first mark
    # everything blocks 0 and 1 save (but parameters and x); block 2 is the last group, kept
    saved = saved_bytes(plain, x, list(plain.blocks), 1 << 14)
    assert stats.offloaded_bytes == saved[0] + saved[1] and stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.kept_bytes > 0  # the last block's activations never left
    assert handle.report()["effect"]["offload"]["offloaded_bytes"] == stats.offloaded_bytes
    handle.remove()
    assert module_state(model) == before


def test_no_grad_forwards_are_not_offloaded(loopback):
    model, x = offload_blocks(3)
    handle = apply_offload(model, {"version": 1, "cpu_checkpointing": True})
    with torch.no_grad():
        model(x)
    model.eval()
    with torch.inference_mode():
        model(x)
    assert handle.engine.stats.steps == 0


def test_a_training_step_in_eval_mode_offloads_as_in_train_mode(loopback):
    # Autograd saves by grad mode, whatever module.training says: training in eval() (dropout
    # off) offloaded 0 bytes, silently, while the checkpoint still ran (issue 20).
    model, x = offload_blocks(3)
    plain = copy.deepcopy(model).eval()
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True}
    handle = apply_offload(model, cfg)
    model.eval()
    want, got = train_step(plain, x), train_step(model, x)
    assert handle.engine.stats.steps == 1
    # block 1's input; block 0's is x, the caller's batch (its owner holds it), and block 2's
    # is the last group, kept on the device
    assert handle.engine.stats.offloaded_bytes == x.nbytes
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_checkpoint_inputs_are_what_moves_with_checkpointing(loopback):
    model, x = offload_blocks(4)
    plain = copy.deepcopy(model)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True}
    handle = apply_offload(model, cfg)
    assert handle.offload.groups == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Blocks 1 and 2 each move one input of x's size; block 0's is x itself, the caller's batch,
    # which stays (its owner holds it); block 3's is the last group, kept on the device.
    stats = handle.engine.stats
    assert (stats.offloaded_bytes, stats.kept_bytes) == (2 * x.numel() * 4, x.numel() * 4)
    assert stats.kept_bytes_by_reason == {"input": x.numel() * 4}
    assert handle.counters.recomputes == 4


def test_every_2_offloads_what_the_unchecked_blocks_save_with_the_group_before(loopback):
    model, x = offload_blocks(4)
    plain = copy.deepcopy(model)
    cfg = {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"], "every": 2},
           "cpu_checkpointing": True}
    handle = apply_offload(model, cfg)
    assert handle.offload.groups == ("blocks.1", "blocks.3")
    assert handle.offload.grouping == (
        "the checkpointed modules (one in every 2 matches; what the modules between them save is "
        "offloaded with the group before it)")
    train_step(model, x)
    # group blocks.1 also carries what the unchecked block 2 saves; group 0 what block 0 saves;
    # blocks.3 is the last group, kept
    saved = saved_bytes(plain, x, list(plain.blocks), 1 << 14)
    assert handle.engine.stats.groups == 3
    assert handle.engine.stats.offloaded_bytes == saved[0] + x.nbytes + saved[2]


def test_offload_step_is_closed_when_forward_raises(loopback):
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), Flaky(), Flaky())
    handle = apply_offload(model, {"version": 1, "cpu_checkpointing": True})
    handle.engine.min_offload_bytes = 0
    assert handle.offload.grouping == "children of the model"
    model[1].fail = True
    with pytest.raises(RuntimeError, match="^boom$"):
        model(torch.randn(2, 16))
    assert handle.engine._step is None  # the scope closed with the exception
    model[1].fail = False
    train_step(model, torch.randn(2, 16))
    assert handle.engine.stats.steps == 2


def test_keyboard_interrupt_closes_the_offload_scope_and_leaves_no_hooks_on(loopback):
    """The scope is a `with` around the root's forward: a KeyboardInterrupt leaves it, and
    tensors saved outside the model afterwards are not packed."""

    class Interrupting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.interrupt = False

        def forward(self, x):
            if self.interrupt:
                raise KeyboardInterrupt
            return self.lin(x)

    model = nn.Sequential(Interrupting(), Interrupting())
    handle = apply_offload(model, {"version": 1, "cpu_checkpointing": True})
    model[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 16))
    assert handle.engine._step is None
    packed = handle.engine.stats.packed_tensors
    w = torch.randn(16, 16, requires_grad=True)
    (torch.randn(2, 16) @ w).sum().backward()  # outside the model: no hook may see it
    assert handle.engine.stats.packed_tensors == packed


def test_every_larger_than_the_matches_is_refused_not_a_silent_no_op():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.every: 4, but only 3 module\(s\) match 'Linear': "
                       r"every n-th match is checkpointed, so none would be; set `every` to at most 3$"):
        apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": ["Linear"], "every": 4}})
    assert not any("_actcfg" in k for m in model.modules() for k in m.__dict__)  # nothing left behind


# --- per-module rules (checkpoint.mode: rules) --------------------------------------------------


def rules_policy(*rules: dict, **section) -> dict:
    return {"version": 1, "checkpoint": {"mode": "rules", "rules": list(rules), **section}}


def test_each_module_runs_its_rule_first_match_wins_and_remove_restores_everything():
    model, x = small_blocks(4)
    plain = copy.deepcopy(model)
    before, named = module_state(model), names(model)
    handle = apply(model, rules_policy(
        {"modules": ["blocks.0", "blocks.3"], "mode": "full"},
        {"modules": ["blocks.1"], "mode": "none"},  # keeps blocks.1 out of the next rule
        {"modules": ["Block"], "mode": "selective", "save_ops": ["aten.mm", "aten.addmm"]},
    ))
    assert [(r.index, r.modules, r.checkpoint, r.offload, r.save_ops) for r in handle.rules] == [
        (0, ("blocks.0", "blocks.3"), "full", False, None),
        (1, ("blocks.1",), "none", False, None),
        (2, ("blocks.2",), "selective", False, ("aten.mm", "aten.addmm")),
    ]
    assert handle.checkpointed == ("blocks.0", "blocks.2", "blocks.3")
    assert handle.ruled == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert handle.engine is None and handle.offload is None  # no rule offloads
    assert names(model) == named
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    assert [c.to_json() for c in handle.rule_counters] == [
        {"calls": 2, "runs": 4, "recomputes": 2}, {"calls": 0, "runs": 0, "recomputes": 0},
        {"calls": 1, "runs": 2, "recomputes": 1}]
    assert handle.counters.recomputes == 3
    assert handle.report()["effect"]["rules"][0] == {"calls": 2, "runs": 4, "recomputes": 2}
    assert handle.summary() == (
        "actcfg: backend torch; per-module rules over 4 modules (2 full, 1 none, 1 selective) "
        "via torch.utils.checkpoint.checkpoint")
    handle.remove()
    assert module_state(model) == before


def test_selective_rule_recomputes_only_what_it_does_not_save():
    model, x = small_blocks(2)

    def flops() -> int:
        with FlopCounterMode(display=False) as counter:
            train_step(model, x)
        return sum(counter.get_flop_counts()["Global"].values())

    plain = flops()
    with apply(model, rules_policy({"modules": ["Block"], "mode": "selective", "save_ops": ["aten.mm", "aten.addmm"]})):
        assert flops() == plain  # every matmul output saved: no matmul runs again
    with apply(model, rules_policy({"modules": ["Block"], "mode": "full"})):
        assert flops() > 1.2 * plain


def test_rules_offload_only_the_groups_whose_rule_says_so(loopback):
    model, x = offload_blocks(4)
    plain = copy.deepcopy(model)
    handle = apply_offload(model, rules_policy(
        {"modules": ["blocks.0"], "mode": "none", "cpu_checkpointing": True},
        {"modules": ["blocks.1"], "mode": "full", "cpu_checkpointing": True},
        {"modules": ["blocks.2"], "mode": "full"},
        {"modules": ["blocks.3"], "mode": "none"},
        keep_last=0,
    ))
    assert handle.offload.scope == "rules" and handle.offload.groups == tuple(f"blocks.{i}" for i in range(4))
    assert (handle.engine.keep_last, handle.engine.max_inflight) == (0, 1)
    want, got = train_step(plain, x), train_step(model, x)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    groups = {g["module"]: g for g in handle.offload_groups()}
    one = x.numel() * 4
    assert groups["blocks.1"] == {"module": "blocks.1", "offloaded_bytes": one, "kept_bytes": 0,
                                  "first_reload_bytes": one}  # its input, the one storage it moved
    assert groups["blocks.0"]["offloaded_bytes"] > 3 * one  # everything block 0 saves
    # what backward reloads of it first: its two newest storages, the MLP's hidden (fc1's output
    # and GELU's, ffn 128: twice a block input each)
    assert groups["blocks.0"]["first_reload_bytes"] == 2 * 2 * one
    assert groups["blocks.2"]["offloaded_bytes"] == 0 and groups["blocks.2"]["kept_bytes"] == one
    assert groups["blocks.3"]["offloaded_bytes"] == 0 and groups["blocks.3"]["kept_bytes"] > 3 * one
    stats = handle.engine.stats
    assert stats.offloaded_bytes == groups["blocks.0"]["offloaded_bytes"] + one == stats.reloaded_bytes
    assert stats.late_reloads == 0  # each reload started one block ahead, at the block above
    assert handle.counters.recomputes == 2
    assert [g["module"] for g in handle.report()["effect"]["offload_groups"]] == list(groups)


def test_rules_keep_last_keeps_the_newest_offloaded_modules_from_the_second_step(loopback):
    model, x = offload_blocks(4)
    handle = apply_offload(model, rules_policy({"modules": ["Block"], "mode": "none", "cpu_checkpointing": True},
                                               keep_last=2, max_inflight=2))
    assert (handle.engine.keep_last, handle.engine.max_inflight) == (2, 2)
    train_step(model, x)
    train_step(model, x)
    moved = [g["module"] for g in handle.offload_groups() if g["offloaded_bytes"]]
    assert moved == ["blocks.0", "blocks.1"]


def test_a_rule_that_applies_to_nothing_is_refused():
    model, _ = small_blocks(2)
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.rules\.1: every module its patterns match was "
                       r"taken by an earlier rule \(checkpoint\.rules\.0; the first match wins\), so it applies to none; "
                       r"remove it, or narrow the earlier rule$"):
        apply(model, rules_policy({"modules": ["Block"]}, {"modules": ["blocks.1"], "mode": "selective"}))
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.rules\.0\.modules: pattern 'Blok' matches no module"):
        apply(model, rules_policy({"modules": ["Blok"]}))
    with pytest.raises(PolicyApplyError, match=r"^checkpoint\.rules: `blocks\.0` \(Block\) and its submodule "
                       r"`blocks\.0\.qkv` \(Linear\) are both matched: each module takes one rule"):
        apply(model, rules_policy({"modules": ["blocks.0"], "mode": "none"}, {"modules": ["blocks.*.qkv"]}))
    assert not any("_actcfg" in k for m in model.modules() for k in m.__dict__)


def test_auto_without_inputs_is_refused_with_both_ways_out():
    model, _ = small_blocks(2)
    cfg = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1GiB"}
    with pytest.raises(PolicyApplyError, match=(
            r"^checkpoint\.mode auto plans from a profile of one training step, and apply\(\) got no "
            r"example inputs: pass inputs= \(a batch, as the model takes it\) to plan here, or write "
            r"the plan with `actcfg plan CONFIG --model pkg\.module:factory -o plan\.yaml` and apply "
            r"that file$")):
        apply(model, cfg)
    with pytest.raises(PolicyApplyError, match=r"^inputs= and loss_fn= are for checkpoint\.mode auto"):
        apply(model, policy("full", ["Block"]), inputs=torch.randn(2, 8, 32))
    assert not any("_actcfg" in k for m in model.modules() for k in m.__dict__)
