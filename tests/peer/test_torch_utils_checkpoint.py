"""PyTorch's TestCheckpoint, ported to actcfg.apply and run on every route it applies to.

Source: pytorch/pytorch, test/test_utils.py, class TestCheckpoint, at commit
0025348e03d0307b815c0043b702e2a64c2ef752 (the stored copy read for this port).

Ported (each test keeps its intent and assertions; only the wrapping call changes: torch's
`checkpoint(fn, ...)`/`checkpoint_sequential` become `actcfg.apply(model, policy)` on the modules
they wrapped): test_checkpoint_trigger, test_checkpoint_valid, test_checkpoint,
test_checkpoint_module_list, test_checkpoint_rng_cpu, test_checkpoint_rng_gpu (cuda),
test_checkpoint_non_tensor, test_checkpoint_non_tensor_inputs_outputs,
test_checkpoint_no_tensors, test_checkpoint_partial_grad,
test_checkpoint_preserves_device_context (cuda).

Not ported, because they test torch's free functions and not module wrapping:
checkpoint_sequential's argument checks (deprecated_multiple_args, deprecated_no_args),
get_device_states / _infer_device_type, and the early-free memory probe of a bare function.

Where a route differs on purpose, the test says so: torch's reentrant checkpoint and
DeepSpeed's (REENTRANT_LIKE) refuse `autograd.grad(create_graph=True)` and make an input
returned as an output a node of their own, as torch's reentrant checkpoint does.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._routes import REENTRANT_LIKE, ROUTES, applied, params
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._routes import REENTRANT_LIKE, ROUTES, applied, params

__all__ = ["ds_env"]

cuda = pytest.mark.cuda


class Counter(nn.Module):
    """test_checkpoint_trigger's Net: counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        # a tensor the multiplication saves, so that reentrant checkpointing has one to recompute
        return x * torch.tensor(2.0)


@pytest.mark.parametrize("route", params())
def test_checkpoint_trigger(route, request):
    """checkpoint_sequential(modules, 2, x): the first chunk (5 of 10) is recomputed."""
    model = nn.Sequential(*[Counter() for _ in range(10)])
    assert [m.counter for m in model] == [0] * 10
    x = torch.randn(3, 4, requires_grad=True)
    with applied(model, route, [str(i) for i in range(5)], request):
        out = model(x)
        assert [m.counter for m in model] == [1] * 10
        out.sum().backward()
    assert [m.counter for m in model[:5]] == [2] * 5
    assert [m.counter for m in model[5:]] == [1] * 5


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                         nn.Linear(20, 5), nn.ReLU())


@pytest.mark.parametrize("route", params())
def test_checkpoint_valid(route, request):
    """Reentrant checkpointing refuses autograd.grad(create_graph=True); non-reentrant works
    and gives plain's double-backward-able gradients."""
    plain = mlp()
    model = copy.deepcopy(plain)
    x = torch.randn(1, 100, requires_grad=True)
    want_out = plain(x)
    want = torch.autograd.grad([want_out], [x], [torch.ones(1, 5)], create_graph=True)
    with applied(model, route, ["0", "1", "2"], request):
        out = model(x)
        assert torch.equal(out, want_out)
        if route in REENTRANT_LIKE:
            # torch: "torch.utils.checkpoint is incompatible with .grad()"; DeepSpeed:
            # "Checkpointing is not compatible with .grad()"
            with pytest.raises(RuntimeError, match=r"(?i)(checkpoint|checkpointing) is (in|not )compatible"):
                torch.autograd.grad([out], [x], [torch.ones(1, 5)], create_graph=True)
            return
        got = torch.autograd.grad([out], [x], [torch.ones(1, 5)], create_graph=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0].requires_grad  # create_graph: the gradient is itself differentiable


class ModuleListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList(list(mlp()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


def _check_against_plain(plain: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """_check_checkpoint_sequential: outputs, input gradients and parameter gradients equal."""
    out = plain(x)
    out.sum().backward()
    want_out, want_x = out.detach().clone(), x.grad.detach().clone()
    want = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    detached = x.detach().requires_grad_()
    out = model(detached)
    out.sum().backward()
    assert torch.equal(out.detach(), want_out)
    torch.testing.assert_close(detached.grad, want_x, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("route", params())
def test_checkpoint(route, request):
    plain = mlp()
    model = copy.deepcopy(plain)
    with applied(model, route, ["0", "1", "2"], request):  # the first of 2 chunks
        _check_against_plain(plain, model, torch.randn(1, 100, requires_grad=True))


@pytest.mark.parametrize("route", params())
def test_checkpoint_module_list(route, request):
    plain = ModuleListNet()
    model = copy.deepcopy(plain)
    with applied(model, route, ["module_list.0", "module_list.1", "module_list.2"], request):
        _check_against_plain(plain, model, torch.randn(1, 100, requires_grad=True))


def _rng(route: str, request, device: str) -> None:
    for _ in range(5):
        inp = torch.randn(20000, device=device).requires_grad_()
        model = nn.Sequential(nn.Dropout(), nn.Dropout())
        state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
        with applied(model, route, ["1"], request):
            model(inp).sum().backward()
        with_checkpointing = inp.grad
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state)
        inp.grad = None
        model(inp).sum().backward()
        assert torch.equal(with_checkpointing, inp.grad)


@pytest.mark.parametrize("route", params())
def test_checkpoint_rng_cpu(route, request):
    """The recompute replays the forward's dropout mask (preserve_rng_state)."""
    _rng(route, request, "cpu")


@cuda
@pytest.mark.parametrize("route", params(("full", "reentrant", "selective", "rules")))
def test_checkpoint_rng_gpu(route, request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _rng(route, request, "cuda")


class MaybeAdd(nn.Module):
    def forward(self, tensor1: torch.Tensor, tensor2: torch.Tensor | None) -> torch.Tensor:
        if tensor2 is None:
            return tensor1 * 1.0  # torch's returns tensor1; a tensor op so there is a graph
        return tensor1 + tensor2


@pytest.mark.parametrize("route", params())
def test_checkpoint_non_tensor(route, request):
    model = nn.Sequential(MaybeAdd())
    x = torch.randn(1, 100, requires_grad=True)
    with applied(model, route, ["0"], request):
        model[0](x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones(1, 100))


class Foo(nn.Module):
    """test_checkpoint_non_tensor_inputs_outputs's foo, as a module."""

    def forward(self, t1, t2, scale, t3):
        t4 = t1 + t2 * t3
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("route", params())
def test_checkpoint_non_tensor_inputs_outputs(route, request):
    model = nn.Sequential(Foo())
    t1 = torch.rand(10, requires_grad=True)
    t2 = torch.rand(10, requires_grad=True)
    t3 = torch.rand(10)
    scale = random.randint(0, 10)
    with applied(model, route, ["0"], request):
        res = model[0](t1, t2, scale, t3)
        assert scale == res[0]
        assert torch.equal((t1 + t2 * t3) * scale, res[1])
        assert res[2] is None and res[3] is True and res[5] == "bar"
        assert torch.equal((t1 * t2 + t3) * scale, res[4])
        assert torch.equal(t1, res[6])
        if route == "deepspeed":
            # DeepSpeed's checkpoint drops what it saved after its first backward, even with
            # retain_graph=True (its CheckpointFunction.backward); one backward of the three
            torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
        else:
            res[1].sum().backward(retain_graph=True)
            res[4].sum().backward(retain_graph=True)
            res[6].sum().backward()
        if route == "deepspeed":
            pass
        elif route in REENTRANT_LIKE:
            # the input returned as an output is a node of the checkpoint's Function
            with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
                res[6].sum().backward()
        else:
            # actcfg's non-reentrant routes return the input itself, as plain does: a leaf
            # that backward can pass through again (it adds one more time).
            assert res[6] is t1
            res[6].sum().backward()
            t1.grad -= 1
    t1_grad, t2_grad = t1.grad, t2.grad
    t1.grad = t2.grad = None
    res = Foo()(t1, t2, scale, t3)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    torch.testing.assert_close(t1.grad, t1_grad)
    torch.testing.assert_close(t2.grad, t2_grad)


@pytest.mark.parametrize("route", params())
def test_checkpoint_no_tensors(route, request):
    model = nn.Sequential(Foo())
    t1, t2, t3 = random.random(), random.random(), random.random()
    scale = random.randint(0, 10)
    with applied(model, route, ["0"], request):
        res = model[0](t1, t2, scale, t3)
    assert res == (scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1)


class Pair(nn.Module):
    def forward(self, tensor1, tensor2):
        return tensor1, tensor2 * 1.0  # tensor 2 is used for other application logic


class First(nn.Module):
    def forward(self, tensor1, tensor2):
        return tensor1 * 1.0


@pytest.mark.parametrize("route", params())
def test_checkpoint_partial_grad(route, request):
    model = nn.Sequential(Pair(), First())
    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    with applied(model, route, ["0", "1"], request):
        model[0](a, b)[0].sum().backward()
        assert torch.equal(a.grad, torch.ones(1, 4))
        a, b = torch.randn(1, 4), torch.randn(1, 4, requires_grad=True)
        # Nothing the output depends on requires grad: torch's reentrant checkpoint says so
        # itself; on the other routes backward fails as it does without a checkpoint.
        out = model[1](a, b)
        if route == "deepspeed":
            # DeepSpeed's Function marks its output as requiring grad (an input does) and its
            # backward finds nothing to differentiate: no error, and a zero gradient for b
            # (which the output does not depend on: the value is right).
            out.sum().backward()
            assert a.grad is None and not b.grad.any()
            return
        match = ("none of output has requires_grad=True" if route == "reentrant"
                 else "does not require grad")
        with pytest.raises(RuntimeError, match=match):
            out.sum().backward()


class MakesTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.devices: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        intermediate = torch.empty(4)  # no device: the torch.device context's
        self.devices.append(intermediate.device)
        return x * intermediate.sum()


@cuda
@pytest.mark.parametrize("route", params(("full", "selective", "rules")))
def test_checkpoint_preserves_device_context(route, request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = nn.Sequential(MakesTensor())
    x = torch.randn(4, device="cuda", requires_grad=True)
    with applied(model, route, ["0"], request), torch.device("cuda"):
        y = model(x)
        assert model[0].devices[-1].type == "cuda"
        y.sum().backward()
        assert len(model[0].devices) == 2  # forward and recompute
        assert model[0].devices[-1].type == "cuda"


def test_every_route_is_covered():
    assert set(ROUTES) >= {"full", "reentrant", "selective", "rules", "offload", "deepspeed"}
