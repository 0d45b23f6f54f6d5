"""actcfg/plan/probe.py on the CPU: `LiveBytes`, the CPU's meter, counts the storages ops make and
nothing that existed before it started (a parameter seen through a view of it included)."""

from __future__ import annotations

import torch
from torch import nn

from actcfg.plan.probe import LiveBytes


def test_views_and_in_place_writes_of_older_storages_count_nothing():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64)
    live = LiveBytes()
    live.start()
    try:
        with torch.no_grad():
            y = lin(x)  # addmm(bias, x, weight.t()): the weight's view is no allocation
            made = live.now
            weight_view = lin.weight.view(-1)
            x.add_(1.0)  # in place on a tensor made before start
            after = live.now
    finally:
        live.stop()
    assert made == y.untyped_storage().nbytes() == 8 * 64 * 4
    assert after == made and weight_view.untyped_storage().data_ptr() == lin.weight.data_ptr()


def test_a_step_of_linears_holds_its_saved_activations_not_its_weights():
    # Two Linear layers in training: what is live after forward is what autograd saved (the
    # input is the caller's) plus the output; the weights (4x the activations here) are not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    x = torch.randn(16, 256)
    live = LiveBytes()
    live.start()
    try:
        out = model(x)
        live._sweep()
        held = live.now
    finally:
        live.stop()
    act = 16 * 256 * 4
    # the first Linear's output (freed once tanh made its own), tanh's output (saved by tanh and
    # by the second Linear), the second's output
    assert held == 2 * act, held / act
    del out


def test_storages_held_at_start_are_the_base_and_their_frees_count():
    # As `memory_allocated() - base` on a GPU: a gradient alive at the start (Lightning's
    # previous step's) is in the base, and its free lowers what is counted below 0.
    grad = torch.ones(1000)  # 4000 bytes
    live = LiveBytes()
    live.start(held=[grad, grad.view(10, 100)])  # a view is the same storage, counted once
    try:
        del grad
        small = torch.zeros(250)  # 1000 bytes, after the 4000 went
        low = live.now
        large = torch.zeros(2000)  # 8000 bytes
    finally:
        live.stop()
    assert low == 1000 - 4000
    assert live.peak == 1000 - 4000 + 8000  # without `held`: 9000
    del small, large
