"""DeepSpeed's activation-checkpointing tests, ported to actcfg.apply and run on every route.

Source: deepspeedai/DeepSpeed, tests/unit/runtime/activation_checkpointing/
test_activation_checkpointing.py, at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641.

Ported: TestActivationCheckpoint (inputs1_outputs1, inputs2_outputs1, inputs2_outputs2,
inputs2_outputs3, arg_none; bool and float masks), TestCheckpointNonTensor (input, output),
TestCheckpointNonTensorOutputOrdering, TestActivationCheckpointKeywordArguments,
TestCPUActivationCheckpoint (matches_baseline, skips_non_float_input, eval_no_grad_does_not_grow
_engine: on actcfg's offload routes, with actcfg's engine and its counters), and
test_configure_with_contiguous_checkpointing_requires_num_checkpoints (as actcfg's own refusal).
Not ported: TestCheckpointableLayersConfig (PipelineModule's own layer filter, no wrapping).

The only change is the wrapping call: `deepspeed.checkpointing.checkpoint(module, *inputs)` becomes
`actcfg.apply` on the module (inside a one-module Sequential, so that it is named), then calling
it. Differences on purpose, each said where it applies:
- DeepSpeed's tests skip on the CPU accelerator; actcfg's routes run here (its deepspeed route
  runs DeepSpeed's checkpoint on the CPU, in a capped subprocess).
- The tests put the module in eval() to rule out dropout (these modules have none); actcfg's
  offload routes offload training forwards only, so those run in train() mode.
- DeepSpeed's own CPU offload engine needs a GPU; the offload tests assert actcfg's engine
  counters instead (bytes offloaded and brought back).
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch import nn

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._routes import CAPPED, applied, params
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._routes import CAPPED, applied, params

__all__ = ["ds_env"]

HIDDEN_DIM = 20
OFFLOADS = ("offload", "rules_offload")


class MaskedLinear(nn.Linear):
    def forward(self, x, mask):
        out = super().forward(x)
        return out * mask if mask.is_floating_point() else out * mask.type_as(out)


class MaskedLinearSeq(MaskedLinear):
    """Also returns the mask (as a pipeline stage does)."""

    def forward(self, x, mask):
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    """More outputs than inputs, in another order."""

    def forward(self, x, mask):
        dup = x.clone().detach() * 1.38
        x, mask = super().forward(x, mask)
        return dup, x, mask


class DropMaskLinear(nn.Linear):
    def forward(self, x, mask):
        return super().forward(x)


class LinearNonTensorInput(nn.Linear):
    def forward(self, x, non_tensor_input):
        return super().forward(x)


class LinearNonTensorOutput(nn.Linear):
    def __init__(self, non_tensor_output):
        super().__init__(HIDDEN_DIM, HIDDEN_DIM)
        self.non_tensor_output = non_tensor_output

    def forward(self, x):
        return super().forward(x), self.non_tensor_output


class KeywordFunction(nn.Module):
    """TestActivationCheckpointKeywordArguments' function, as a module."""

    def forward(self, value, *, scale, offset):
        return value * scale + offset


def _mixed_mask(size=HIDDEN_DIM):
    torch.manual_seed(size)
    return torch.where(torch.randn(size) > 0, torch.ones(size), torch.zeros(size)).bool()


def _bool_to_float(btensor, dtype=torch.float32):
    return torch.where(btensor, torch.ones(btensor.size(), dtype=dtype),
                       torch.zeros(btensor.size(), dtype=dtype))


def _compute(module, route, request, inputs, checkpointed):
    model = nn.Sequential(module)
    if checkpointed:
        with applied(model, route, ["0"], request) as handle:
            outputs = model[0](*inputs)
            calls = handle.counters.calls
    else:
        outputs, calls = model[0](*inputs), None
    if torch.is_tensor(outputs):
        outputs = (outputs,)
    sum(o.sum() for o in outputs if torch.is_tensor(o) and o.requires_grad).backward()
    return {"outputs": outputs, "module_grads": [p.grad for p in module.parameters()],
            "input_grads": [i.grad for i in inputs if torch.is_tensor(i)], "calls": calls}


def _prep_inputs(*inputs):
    return tuple(deepcopy(i) for i in inputs)


def _match_outputs(ref, tgt):
    assert type(ref) is type(tgt)
    if type(ref) in (list, tuple):
        assert len(ref) == len(tgt)
        for x, y in zip(ref, tgt):
            _match_outputs(x, y)
    elif not torch.is_tensor(ref):
        assert ref == tgt
    elif ref.is_floating_point():
        assert torch.allclose(ref, tgt)
    else:
        assert torch.equal(ref, tgt)


def _test_activation_checkpoint(route, request, module, *inputs):
    if route in OFFLOADS:
        module.train()  # actcfg offloads training forwards (no dropout here either way)
    else:
        module.eval()  # DeepSpeed's: get rid of dropouts
    base = _compute(deepcopy(module), route, request, _prep_inputs(*inputs), checkpointed=False)
    test = _compute(deepcopy(module), route, request, _prep_inputs(*inputs), checkpointed=True)
    assert test["calls"] == 1  # the module did go through the route
    for group in ("outputs", "module_grads", "input_grads"):
        assert len(base[group]) == len(test[group])
        for b, t in zip(base[group], test[group]):
            _match_outputs(b, t)


def _test_activation_checkpoint_ordering(route, request, module, expected_ordering, *inputs):
    module.eval()
    test = _compute(deepcopy(module), route, request, _prep_inputs(*inputs), checkpointed=True)
    ordering = []
    for item in test["outputs"]:
        if type(item) in (list, tuple):
            ordering += [torch.is_tensor(t) for t in item]
        else:
            ordering += [torch.is_tensor(item)]
    assert ordering == expected_ordering


def _x():
    return torch.rand(HIDDEN_DIM, requires_grad=True)


MASKS = [pytest.param(_mixed_mask(), id="bool"), pytest.param(_bool_to_float(_mixed_mask()), id="float")]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("route", params())
class TestActivationCheckpoint:
    def test_ckpt_inputs1_outputs1(self, route, request, mask):
        _test_activation_checkpoint(route, request, nn.Linear(HIDDEN_DIM, HIDDEN_DIM), _x())

    def test_ckpt_inputs2_outputs1(self, route, request, mask):
        _test_activation_checkpoint(route, request, MaskedLinear(HIDDEN_DIM, HIDDEN_DIM), _x(), mask)

    def test_ckpt_inputs2_outputs2(self, route, request, mask):
        _test_activation_checkpoint(route, request, MaskedLinearSeq(HIDDEN_DIM, HIDDEN_DIM), _x(), mask)

    def test_ckpt_inputs2_outputs3(self, route, request, mask):
        _test_activation_checkpoint(route, request, MaskedLinearSeqDup(HIDDEN_DIM, HIDDEN_DIM), _x(), mask)

    def test_ckpt_arg_none(self, route, request, mask):
        _test_activation_checkpoint(route, request, DropMaskLinear(HIDDEN_DIM, HIDDEN_DIM), _x(), None)


NON_TENSORS = [None, 2, True, (None, 2.5), (None, True, torch.randn(HIDDEN_DIM))]


@pytest.mark.parametrize("non_tensor", NON_TENSORS, ids=["None", "2", "True", "None-2.5", "None-True-tensor"])
@pytest.mark.parametrize("route", params())
class TestCheckpointNonTensor:
    def test_ckpt_non_tensor_input(self, route, request, non_tensor):
        _test_activation_checkpoint(route, request, LinearNonTensorInput(HIDDEN_DIM, HIDDEN_DIM), _x(),
                                    non_tensor)

    def test_ckpt_non_tensor_output(self, route, request, non_tensor):
        _test_activation_checkpoint(route, request, LinearNonTensorOutput(non_tensor), _x())


@pytest.mark.parametrize("non_tensor_output", [
    None, (torch.randn(HIDDEN_DIM), 2.5), (None, torch.randn(HIDDEN_DIM), True),
    (None, True, torch.randn(HIDDEN_DIM))], ids=["None", "tensor-2.5", "None-tensor-True", "None-True-tensor"])
@pytest.mark.parametrize("route", params())
def test_ckpt_non_tensor_output_ordering(route, request, non_tensor_output):
    ordering = [True]  # the first output is a tensor
    if type(non_tensor_output) in (list, tuple):
        ordering += [torch.is_tensor(t) for t in non_tensor_output]
    else:
        ordering += [torch.is_tensor(non_tensor_output)]
    _test_activation_checkpoint_ordering(route, request, LinearNonTensorOutput(non_tensor_output), ordering,
                                         _x())


@pytest.mark.parametrize("route", params())
def test_tensor_and_non_tensor_keyword_arguments(route, request):
    value = torch.randn(HIDDEN_DIM, requires_grad=True)
    scale = torch.randn(HIDDEN_DIM, requires_grad=True)
    reference_value = value.detach().clone().requires_grad_()
    reference_scale = scale.detach().clone().requires_grad_()
    reference = KeywordFunction()(reference_value, scale=reference_scale, offset=1.5)
    reference.sum().backward()
    model = nn.Sequential(KeywordFunction())
    with applied(model, route, ["0"], request):
        output = model[0](value, scale=scale, offset=1.5)
        output.sum().backward()
    torch.testing.assert_close(output, reference)
    torch.testing.assert_close(value.grad, reference_value.grad)
    torch.testing.assert_close(scale.grad, reference_scale.grad)


# --- TestCPUActivationCheckpoint: on actcfg's offload engine ---------------------------------


class Stacked(nn.Module):
    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("route", OFFLOADS)
def test_cpu_offload_matches_baseline(route, request):
    """Several checkpointed layers, so the engine moves every group but the kept last one;
    outputs and gradients equal a plain run."""
    torch.manual_seed(1234)
    ref = Stacked(256, 4)
    test = deepcopy(ref)
    x = torch.randn(8, 256)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.sum().backward()
    with applied(test, route, ["layers.*"], request) as handle:
        x_test = x.clone().requires_grad_()
        out_test = test(x_test)
        out_test.sum().backward()
        stats = handle.engine.stats
        assert stats.offloaded_bytes > 0, "keep-last never flushed to the host"
        assert stats.reloaded_bytes > 0  # DeepSpeed's: restored_tensors > 0
        if route == "offload":
            # layers 1 and 2's inputs: layer 0's is x_test, the caller's batch, which stays;
            # layer 3 is the last group, kept. (Under rules the engine counts 3 inputs moved and
            # 2 reloaded here: not pinned until that is explained.)
            assert stats.offloaded_bytes == stats.reloaded_bytes == 2 * x.nbytes
    _match_outputs(out_ref, out_test)
    torch.testing.assert_close(x_ref.grad, x_test.grad)
    for p_ref, p_test in zip(ref.parameters(), test.parameters()):
        torch.testing.assert_close(p_ref.grad, p_test.grad)


@pytest.mark.parametrize("route", OFFLOADS)
def test_cpu_offload_skips_non_float_input(route, request):
    """A bool mask passes through while the float input offloads; parity confirms the mix."""
    _test_activation_checkpoint(route, request, MaskedLinear(HIDDEN_DIM, HIDDEN_DIM), _x(), _mixed_mask())


@pytest.mark.parametrize("route", OFFLOADS)
def test_eval_no_grad_does_not_grow_engine(route, request):
    layers = Stacked(256, 3)
    x = torch.randn(4, 256)
    with applied(layers, route, ["layers.*"], request) as handle:
        with torch.no_grad():
            layers(x)
        assert handle.engine.stats.steps == 0
        assert handle.engine.stats.offloaded_bytes == 0


@pytest.mark.deepspeed
def test_configure_with_contiguous_checkpointing_requires_num_checkpoints(request):
    """DeepSpeed's configure() asserts on contiguous checkpointing without num_layers; actcfg
    refuses the policy when it is loaded, before DeepSpeed is touched, with the fix."""
    if not __import__("os").environ.get(CAPPED):
        pytest.skip("runs in the capped subprocess")
    request.getfixturevalue("ds_env")
    from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

    from actcfg.errors import ConfigLoadError
    from actcfg.api import apply

    before = {name: getattr(ckpt, name) for name in ("CONTIGUOUS_CHECKPOINTING", "num_layers")}
    with pytest.raises(ConfigLoadError, match="contiguous-needs-num-checkpoints") as e:
        apply(nn.Sequential(nn.Linear(2, 2)), {"version": 1, "backend": "deepspeed", "partition": True,
                                               "checkpoint": {"mode": "external"}, "contiguous": True})
    assert "set `num_checkpoints`" in str(e.value)
    assert {name: getattr(ckpt, name) for name in before} == before  # DeepSpeed untouched
