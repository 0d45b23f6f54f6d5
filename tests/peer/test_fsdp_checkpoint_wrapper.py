"""PyTorch's checkpoint_wrapper tests, ported to actcfg.apply and run on every route.

Source: pytorch/pytorch, test/distributed/fsdp/test_checkpoint_wrapper.py, CheckpointWrapperTest,
at commit 0536503aa51d4905efdff7febc67caefcb334867.

Ported: test_load_activation_checkpointed_module, test_checkpoint_wrapper_kwarg_support,
test_checkpoint_wrapper_parity (cuda), test_forward_missing_attributes,
test_apply_activation_checkpointing, test_fqn, test_checkpoint_wrapper_cpu_offload (on the host
loopback engine instead of CUDA).

Only the wrapping changes: `checkpoint_wrapper(module, ...)`, `offload_wrapper(module)` and
`apply_activation_checkpointing(model, check_fn=isinstance Linear)` become `actcfg.apply` with
the matching policy. Differences on purpose:
- actcfg swaps no module for a wrapper: where torch asserts a `CheckpointWrapper` in the tree
  (and reaches the weights through `_checkpoint_wrapped_module`), the port asserts the module is
  the same object, reported as checkpointed, with its own names.
- offload_wrapper moves every saved tensor to the host; actcfg's engine keeps tensors under
  `min_offload_bytes` (1 MiB by default) and the last group (keep_last: 1) on the device, where
  backward needs them first. The port lowers min_offload_bytes to 0 (as every offload route here
  does) and asserts what moved by the engine's counters, not by patching saved_tensors_hooks.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch import nn

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._routes import applied, params
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._routes import applied, params

__all__ = ["ds_env"]


@pytest.mark.parametrize("route", params())
def test_load_activation_checkpointed_module(route, request):
    lin = nn.Sequential(nn.Linear(10, 10, bias=False))
    with applied(lin, route, ["0"], request):
        state_dict = deepcopy(lin.state_dict())
        # load into a model without the policy
        lin_new = nn.Sequential(nn.Linear(10, 10, bias=False))
        lin_new.load_state_dict(state_dict)
        for p1, p2 in zip(lin.parameters(), lin_new.parameters()):
            assert torch.equal(p1, p2)
        # and the other way round, with different values
        with torch.no_grad():
            for p in lin_new.parameters():
                p.add_(0.5)
        lin.load_state_dict(deepcopy(lin_new.state_dict()))
        for p1, p2 in zip(lin.parameters(), lin_new.parameters()):
            assert torch.equal(p1, p2)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, a, b, c=None, d=None, **kwargs):
        return (self.lin(a), self.lin(b), self.lin(c), self.lin(d))


class ModelEnforceKwarg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, *, a=None, b=None):
        return (self.lin(a), self.lin(b))


@pytest.mark.parametrize("route", params())
def test_checkpoint_wrapper_kwarg_support(route, request):
    model = nn.Sequential(MyModel())
    with applied(model, route, ["0"], request) as handle:
        inp = torch.ones(4, 10, requires_grad=True)
        out = model[0](inp, inp, c=inp, d=inp, e=inp, f=inp)  # kwargs can be passed in
        assert isinstance(out, tuple) and len(out) == 4
        out_no_kwarg = model[0](inp, inp, inp, inp)  # the same gradient requirements without
        for t1, t2 in zip(out_no_kwarg, out):
            assert torch.equal(t1, t2)
            assert t1.requires_grad == t2.requires_grad
        assert handle.counters.calls == 2
    enforce = nn.Sequential(ModelEnforceKwarg())
    with applied(enforce, route, ["0"], request):
        out = enforce[0](a=inp, b=inp)
        assert len(out) == 2
        sum(o.sum() for o in out).backward()
    assert enforce[0].lin.weight.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("route", params(("full", "reentrant")))
def test_checkpoint_wrapper_parity(route, request):
    """actcfg's checkpointing of each layer peaks where torch's functional checkpoint of the
    same layers does, with the same reentrant setting."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.utils.checkpoint import checkpoint

    class Model(nn.Module):
        def __init__(self, functional: bool) -> None:
            super().__init__()
            self.functional = functional
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
                for _ in range(8))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=route == "reentrant") if self.functional else layer(x)
            return x

    def peak(model: nn.Module) -> int:
        x = torch.randn(10000, 256, requires_grad=True).cuda()
        torch.cuda.reset_peak_memory_stats()
        model(x).sum().backward()
        return torch.cuda.max_memory_allocated()

    functional = peak(Model(functional=True).cuda())
    model = Model(functional=False).cuda()
    with applied(model, route, ["layers.*"], request):
        assert peak(model) == functional


@pytest.mark.parametrize("route", params())
def test_forward_missing_attributes(route, request):
    lin = nn.Linear(1, 1)
    m = nn.Sequential(lin, lin)
    outer = nn.Sequential(m)
    with applied(outer, route, ["0"], request):
        assert outer[0] is m and m[0] is lin  # indexing reaches the module itself
        m._foo = "bar"
        assert outer[0]._foo == "bar"


class LinearWithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.bn = nn.BatchNorm1d(10)
        self.nested_linear = nn.Sequential(nn.Linear(10, 10))

    def forward(self, x):
        return self.bn(self.nested_linear(self.lin(x)))


class Seq3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(LinearWithBatchNorm(), LinearWithBatchNorm(), LinearWithBatchNorm())

    def forward(self, x):
        return self.seq(x)


@pytest.mark.parametrize("route", params())
def test_apply_activation_checkpointing(route, request):
    """check_fn=isinstance(Linear): every Linear is checkpointed, the model trains with a
    keyword input, and the checkpointed weights get gradients."""
    model = Seq3()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with applied(model, route, ["Linear"], request) as handle:
        assert handle.checkpointed == tuple(names)
        assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears  # nothing swapped
        inp = torch.randn(4, 10, requires_grad=True)
        for _ in range(6):
            loss = model(x=inp).sum()
            assert loss.requires_grad
            loss.backward()
            for j in range(3):
                for param in (model.seq[j].lin.weight, model.seq[j].lin.bias,
                              model.seq[j].nested_linear[0].weight, model.seq[j].nested_linear[0].bias):
                    assert param.requires_grad
                    assert param.grad is not None
        assert handle.counters.calls == 6 * len(linears)


@pytest.mark.parametrize("route", params())
def test_fqn(route, request):
    lin = nn.Sequential(nn.Linear(10, 10, bias=False))
    with applied(lin, route, ["0"], request):
        state_dict = lin.state_dict()
        for fqn, _ in lin.named_parameters():
            assert fqn in state_dict, f"{fqn} not in state_dict."
        assert list(state_dict) == ["0.weight"]


def test_checkpoint_wrapper_cpu_offload():
    """offload_wrapper's test: the saved tensors of the forward go to the host. On actcfg's
    loopback engine (the policy `cpu_checkpointing: true`, no recompute) every group but the
    kept last one moves, and backward brings back exactly what moved."""
    from actcfg.runtime.offload import host_loopback
    from actcfg.api import apply

    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    plain = deepcopy(model)
    with host_loopback():
        handle = apply(model, {"version": 1, "cpu_checkpointing": True})
    handle.engine.min_offload_bytes = 0
    inp = torch.randn(3, 10)
    loss = model(inp).sum()
    stats = handle.engine.stats
    # the second Linear's input (3 x 10 floats, as inp): the first's is inp, the caller's batch,
    # which stays; the third is the last group, kept; the weights are parameters
    assert stats.offloaded_bytes == inp.nbytes
    loss.backward()
    assert stats.reloaded_bytes == stats.offloaded_bytes
    plain(inp).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    handle.remove()
