"""The checkpoint tests of PyTorch's test/test_autograd.py that apply to wrapping a module,
ported to actcfg.apply and run on every route they apply to.

Source: pytorch/pytorch, test/test_autograd.py (class TestAutograd). The stored copy read for
this port is commit 0011ee059a1ed8ca92d609383f466095d1bb1fcf, which has test_checkpointing; the
others are named as in pytorch main and keep the intent of the behaviour they pin in torch 2.x.

Ported: test_checkpointing (one module checkpointed once per input, many inputs; the input count
is 64 here, not 2000, to keep the CPU run short), test_checkpointing_without_reentrant_memory_savings
(cuda), test_checkpointing_non_reentrant_autocast_cpu, test_checkpointing_without_reentrant_custom
_function_works, test_checkpointing_without_reentrant_detached_tensor (both routes it names:
non-reentrant ones), test_checkpoint_valid_reset_on_error (reentrant routes).
Not ported: tests of torch.utils.checkpoint internals (early stop, the non-determinism check's
error text, nested and compiled checkpoint internals, DataParallel replicas), which wrap
functions and not modules.

Added to each, as actcfg promises it: gradients equal the plain module's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._routes import REENTRANT_LIKE, TORCH_ROUTES, applied, params
    from tests._helpers import assert_grads_close, grads_of
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._routes import REENTRANT_LIKE, TORCH_ROUTES, applied, params
    from _helpers import assert_grads_close, grads_of

__all__ = ["ds_env"]

NON_REENTRANT = tuple(r for r in TORCH_ROUTES if r not in REENTRANT_LIKE)


@pytest.mark.parametrize("route", params())
def test_checkpointing(route, request):
    """The same checkpointed module called once per input, then one backward over all."""
    torch.manual_seed(0)
    num_inp, nz_inp, nz_bottleneck = 64, 10, 1000
    model = nn.Sequential(nn.Sequential(nn.Linear(nz_inp, nz_bottleneck), nn.ReLU(),
                                        nn.Linear(nz_bottleneck, nz_inp)))
    plain = copy.deepcopy(model)
    data = [torch.empty(1, nz_inp).uniform_().requires_grad_() for _ in range(num_inp)]
    torch.stack([plain(d) for d in data]).mean().backward()
    want = grads_of(plain, skip_missing=True)
    with applied(model, route, ["0"], request) as handle:
        torch.stack([model(d.detach().requires_grad_()) for d in data]).mean().backward()
        assert handle.counters.calls == num_inp
    assert_grads_close(grads_of(model, skip_missing=True), want)


@pytest.mark.cuda
# Not the selective route, on purpose: actcfg's selective checkpointing saves every matmul's
# output (save_ops' default), and this model is nothing but Linear layers, so it has nothing to
# recompute and saves what plain saves (docs/peer-differences.md).
@pytest.mark.parametrize("route", params(("full", "reentrant")))
def test_checkpointing_without_reentrant_memory_savings(route, request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
                for _ in range(8))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def peak(model: nn.Module) -> int:
        x = torch.randn(10000, 256, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    plain_peak = peak(Model().cuda())
    model = Model().cuda()
    with applied(model, route, ["layers.*"], request):
        assert peak(model) < plain_peak


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        assert y.dtype == torch.bfloat16  # the recompute runs under the forward's autocast too
        return y.float().sin()


@pytest.mark.parametrize("route", params())
def test_checkpointing_non_reentrant_autocast_cpu(route, request):
    torch.manual_seed(0)
    model = nn.Sequential(Autocast())
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).sum().backward()
    want = grads_of(plain, skip_missing=True)
    with applied(model, route, ["0"], request) as handle:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.detach().requires_grad_())
        out.sum().backward()  # backward outside autocast, as the original does
        assert handle.counters.recomputes >= 1
    assert_grads_close(grads_of(model, skip_missing=True), want)


class Saves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, twice):
        ctx.save_for_backward(x, y)
        ctx.twice = twice
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        if ctx.twice:
            x, y = ctx.saved_tensors
        return grad * y, grad * x, None


class UsesCustomFunction(nn.Module):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))
        self.twice = twice

    def forward(self, x):
        return Saves.apply(x.sin(), self.w, self.twice).sin()


@pytest.mark.parametrize("route", params())
def test_checkpointing_without_reentrant_custom_function_works(route, request):
    torch.manual_seed(0)
    model = nn.Sequential(UsesCustomFunction())
    plain = copy.deepcopy(model)
    x = torch.randn(5, requires_grad=True)
    plain(x).sum().backward()
    want = grads_of(plain, skip_missing=True)
    with applied(model, route, ["0"], request):
        model(x.detach().requires_grad_()).sum().backward()
    assert_grads_close(grads_of(model, skip_missing=True), want)


@pytest.mark.parametrize("route", params())
def test_custom_function_reading_saved_tensors_twice(route, request):
    """torch's non-reentrant checkpoint refuses a second `ctx.saved_tensors` in one backward
    (CheckpointError, naming the fix); actcfg's non-reentrant routes say the same, never a
    wrong gradient. The reentrant ones recompute into ordinary saved tensors and allow it."""
    torch.manual_seed(0)
    model = nn.Sequential(UsesCustomFunction(twice=True))
    plain = copy.deepcopy(model)
    x = torch.randn(5, requires_grad=True)
    plain(x).sum().backward()
    with applied(model, route, ["0"], request):
        out = model(x.detach().requires_grad_()).sum()
        if route in REENTRANT_LIKE:
            out.backward()
            assert_grads_close(grads_of(model, skip_missing=True), grads_of(plain, skip_missing=True))
        else:
            with pytest.raises(torch.utils.checkpoint.CheckpointError, match="already unpacked once"):
                out.backward()


class Detaches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + h.detach().exp()  # a part of the output is cut from the graph


@pytest.mark.parametrize("route", params())
def test_checkpointing_without_reentrant_detached_tensor(route, request):
    torch.manual_seed(0)
    model = nn.Sequential(Detaches())
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4, requires_grad=True)
    plain(x).sum().backward()
    want = grads_of(plain, skip_missing=True)
    with applied(model, route, ["0"], request):
        model(x.detach().requires_grad_()).sum().backward()
    assert_grads_close(grads_of(model, skip_missing=True), want)


@pytest.mark.parametrize("route", params(REENTRANT_LIKE))
def test_checkpoint_valid_reset_on_error(route, request):
    """After autograd.grad refuses the reentrant checkpoint, a later backward still works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    with applied(model, route, ["0"], request):
        out = model(x).exp().sum()
        with pytest.raises(RuntimeError, match=r"(?i)checkpoint(ing)? is (in|not )compatible"):
            torch.autograd.grad(out, x)
        model(x).exp().sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


def test_non_reentrant_routes_are_the_rest():
    assert set(NON_REENTRANT) == {"full", "selective", "rules", "offload", "rules_offload"}
