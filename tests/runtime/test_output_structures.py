"""Any output structure a checkpointed module returns comes back unchanged in structure on every
route (tensors, None, scalars, strings, nested containers, tensors not computed from the
inputs), with gradients equal to plain.

Regressions it pins: a `None` in the output made the reentrant and deepspeed routes raise a
bare StopIteration (inside `map()` it silently ended the iteration), and a tensor the module
holds, returned beside the result, was marked in place by autograd and made backward recurse
until the process died.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._capped import assert_passed
    from tests.peer._routes import REENTRANT_LIKE, applied, params
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._capped import assert_passed
    from peer._routes import REENTRANT_LIKE, applied, params

__all__ = ["ds_env"]

D = 16


class Block(nn.Module):
    """Returns `structure(self, h)` where `h` is computed from the input."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.structure = structure
        self.register_buffer("mask", torch.ones(D))
        self.extra = (torch.randn(D), 2.5)  # a plain attribute, as DeepSpeed's ordering test has
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> object:
        h = torch.tanh(self.fc(x))
        return {
            "tensor": lambda: h,
            "none": lambda: (h, None),
            "scalars": lambda: (h, 2.5, 3, True, "text"),
            "nested": lambda: {"h": h, "more": [h * 2, None, ("s", h.sum())], "n": None},
            "buffer": lambda: (h, self.mask),
            "attribute": lambda: (h, self.extra),
            "parameter": lambda: (h, self.scale),
            "input": lambda: (h, x),
            "integer": lambda: (h, h.argmax(-1)),
            "only_held": lambda: (h, self.extra[0], None),
        }[self.structure]()


STRUCTURES = ("tensor", "none", "scalars", "nested", "buffer", "attribute", "parameter", "input",
              "integer", "only_held")


class Net(nn.Module):
    def __init__(self, structure: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(structure), Block(structure)])

    def forward(self, x: torch.Tensor) -> list[object]:
        outs = []
        for block in self.blocks:
            out = block(x)
            outs.append(out)
            x = tree_flatten(out)[0][0]
        return outs


def loss_of(outs: object) -> torch.Tensor:
    """What DeepSpeed's own test sums: every floating tensor that requires grad."""
    return sum(t.float().sum() for t in tree_flatten(outs)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad)


def run(model: Net, x: torch.Tensor) -> tuple[object, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    outs = model(x)
    loss_of(outs).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad
    return outs, grads


def assert_same_structure(got: object, want: object, model: Net, route: str) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    held = {id(t) for b in model.blocks for t in (b.mask, b.extra[0], b.scale)}
    for g, w in zip(got_leaves, want_leaves):
        assert type(g) is type(w) or (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor))
        if not isinstance(w, torch.Tensor):
            assert g == w
            continue
        assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad)
        torch.testing.assert_close(g, w)
        if id(w) in held or id(g) in held:
            # a tensor the module holds comes back as that very object, untouched by autograd
            assert g is w or (id(g) in held and g.grad_fn is None and w.grad_fn is None)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("route", params())
def test_output_structure_and_gradients_match_plain(route: str, structure: str, request) -> None:
    torch.manual_seed(0)
    plain = Net(structure)
    model = copy.deepcopy(plain)
    # The plain model's held tensors are its own; compare against the applied copy's.
    x = torch.randn(3, D)
    want, want_grads = run(plain, x)
    with applied(model, route, ["blocks.*"], request) as handle:
        got, got_grads = run(model, x)
        assert handle.counters.calls == 2
        got_again, again_grads = run(model, x)  # a second step: nothing left marked by the first
    for outs in (got, got_again):
        held_plain = {id(t) for b in plain.blocks for t in (b.mask, b.extra[0], b.scale)}
        # map each plain-held object to the copy's, so identity can be checked per model
        assert_same_structure(outs, _swap_held(want, plain, model, held_plain), model, route)
    for grads in (got_grads, again_grads):
        assert grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            if g is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name], g, msg=name)
    for b in model.blocks:  # the module's own tensors were never given a graph
        assert b.extra[0].grad_fn is None and not b.extra[0].requires_grad
        assert b.mask.grad_fn is None and not b.mask.requires_grad


def _swap_held(outs: object, plain: Net, model: Net, held: set[int]) -> object:
    """`outs` of the plain model with its held tensors replaced by the applied copy's."""
    from torch.utils._pytree import tree_map

    pairs = {}
    for pb, mb in zip(plain.blocks, model.blocks):
        pairs.update({id(pb.mask): mb.mask, id(pb.extra[0]): mb.extra[0], id(pb.scale): mb.scale})
    return tree_map(lambda v: pairs.get(id(v), v) if isinstance(v, torch.Tensor) else v, outs)


@pytest.mark.parametrize("route", params())
def test_none_in_output_inside_map_gives_every_result(route: str, request) -> None:
    """A StopIteration escaping the wrapped forward ended `map()` early without an error."""
    torch.manual_seed(0)
    model = Net("none")
    batches = [torch.randn(2, D) for _ in range(4)]
    with applied(model, route, ["blocks.*"], request):
        losses = list(map(lambda b: model(b)[-1][0].sum(), batches))
    assert len(losses) == 4


@pytest.mark.deepspeed
def test_deepspeed_route_in_capped_subprocess() -> None:
    pytest.importorskip("deepspeed")
    assert_passed([f"{__file__}::test_output_structure_and_gradients_match_plain",
                   f"{__file__}::test_none_in_output_inside_map_gives_every_result",
                   "-k", "deepspeed"], timeout_s=400)


def test_reentrant_like_routes_are_named() -> None:
    assert set(REENTRANT_LIKE) <= {"reentrant", "deepspeed"}
