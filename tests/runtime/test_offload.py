"""The offload engine on real torch: lossless, bounded, flat, and clean after faults.

CUDA tests run on the GPU machine (`pytest -m cuda`); without a GPU only the CPU contract runs.
"""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
from torch import nn

from actcfg.errors import OffloadError
from _helpers import FLAT_GROWTH, grads_of, growth_per_block

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_engine_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from actcfg.runtime.offload import OffloadEngine

    with pytest.raises(OffloadError, match=r"^cpu_checkpointing needs a CUDA GPU: .* set `cpu_checkpointing: false`\.$"):
        OffloadEngine()


# --- the engine's decisions and pool, on the host loopback (CPU CI runs these) ---------------


@pytest.fixture
def host():
    from actcfg.runtime.offload import OffloadEngine, host_loopback

    with host_loopback():
        yield OffloadEngine(pin=False, min_offload_bytes=1024, device="cpu")


def _saved_by(engine, fn, *tensors):
    """Pack what `fn` saves under the engine's hooks; returns (output, engine stats)."""
    with engine.step():
        out = fn(*tensors)
    return out


def test_loopback_round_trip_keeps_values_and_layout_of_every_view(host):
    base = torch.randn(64, 3 * 32)
    w0 = torch.randn(32, 32)

    def run(engine):
        x, w = base.clone().requires_grad_(), w0.clone().requires_grad_()

        def body():
            q, k, v = (x * 1.0).view(64, 3, 32).unbind(1)  # three strided views of one storage
            return (q @ w).sum() + (k @ w).sum() + (v.t() @ v).sum()

        if engine is None:
            out = body()
        else:
            with engine.step():
                out = body()
                engine.mark_group()  # the views' group leaves; backward reloads it
                out = out * 1.0
        out.backward()
        return x.grad, w.grad

    want, got = run(None), run(host)
    assert all(torch.equal(g, h) for g, h in zip(got, want))
    stats = host.stats
    assert stats.offloaded_tensors == 1  # q, k and v travelled as their one storage
    assert stats.offloaded_bytes == base.numel() * 4 == stats.reloaded_bytes


def test_loopback_what_stays_in_place_is_decided_when_saved(host):
    from torch import nn as tnn

    lin = tnn.Linear(32, 32)  # parameter: stays
    buf = torch.randn(64, 32)
    holder = tnn.Module()
    holder.register_buffer("b", buf)
    host.skip_tensors_of(holder)
    leaf = torch.randn(64, 32, requires_grad=True)  # a leaf the caller holds: stays
    small = torch.randn(4, 4, requires_grad=True) * 1.0  # under min_offload_bytes: stays
    with host.step():
        a = lin(torch.randn(64, 32, requires_grad=True) * 1.0)  # saves its input (moves), weight (stays)
        b = (leaf.sin() + a.detach().requires_grad_() * holder.b).sum()  # leaf, buffer: stay
        c = small.exp()  # small: stays
        host.mark_group()
        d = a.sum()
    reasons = host.stats.kept_bytes_by_reason
    assert reasons["parameter"] == lin.weight.numel() * 4
    assert reasons["leaf"] == leaf.numel() * 4 and reasons["buffer"] == buf.numel() * 4
    assert host.stats.offloaded_bytes == 64 * 32 * 4
    (b + c.sum() + d).backward()


def test_loopback_a_buffer_stays_as_it_is_now_written_in_place_or_replaced(host):
    # The buffers are read from each module as the step runs: one written in place with data
    # that requires grad (a cache a training step fills; no longer a leaf) and one replaced
    # after skip_tensors_of stay, as a plain one does.
    from torch import nn as tnn

    holder = tnn.Module()
    holder.register_buffer("cache", torch.zeros(64, 32))
    holder.register_buffer("swapped", torch.zeros(64, 32))
    host.skip_tensors_of(holder)
    holder.swapped = torch.randn(64, 32)  # a new tensor in the slot
    x = torch.randn(64, 32, requires_grad=True)
    with host.step():
        holder.cache.copy_(x * 2.0)  # autograd history: requires grad, not a leaf
        assert holder.cache.requires_grad and not holder.cache.is_leaf
        a = (x * 1.0) * holder.cache  # saves both operands: the buffer stays, x * 1.0 moves
        b = (x * 1.0) * holder.swapped  # saves the buffer alone (x * 1.0 needs no gradient of it)
        host.mark_group()
        z = (a + b).sum()
    z.backward()
    assert host.stats.kept_bytes_by_reason["buffer"] == 2 * 64 * 32 * 4
    assert host.stats.offloaded_bytes == 64 * 32 * 4
    torch.testing.assert_close(x.grad, 4 * x.detach() + holder.swapped)  # d(2x * x) + swapped


def test_loopback_min_offload_bytes_is_the_threshold(host):
    for n, moves in ((255, False), (256, True)):  # 256 floats = 1024 bytes
        host._stats.offloaded_bytes = 0
        x = torch.randn(n, requires_grad=True)
        with host.step():
            y = (x * 1.0).exp()
            host.mark_group()
            z = y.sum()
        assert host.stats.offloaded_bytes == (n * 4 if moves else 0)  # exp saves its output
        z.backward()


def test_loopback_pool_reuses_buffers_step_after_step_and_grows_only_on_a_miss(host):
    x = torch.randn(1024, requires_grad=True)
    sizes = []
    for _ in range(4):
        with host.step():
            y = (x * 1.0).exp()
            host.mark_group()
            z = y.sum()
        z.backward()
        del y, z
        gc.collect()
        sizes.append(host.stats.pageable_bytes)
    assert sizes[0] == 1024 * 4 and sizes == [sizes[0]] * 4  # reused, never grown
    bigger = torch.randn(4096, requires_grad=True)
    with host.step():
        y = (bigger * 1.0).exp()
        host.mark_group()
        z = y.sum()
    z.backward()
    assert host.stats.pageable_bytes == sizes[0] + 4096 * 4  # a miss allocates


@pytest.mark.parametrize(("prefetch", "late"), [(0, 3), (1, 0)])
def test_loopback_prefetch_reloads_the_group_below_before_it_is_needed(prefetch, late):
    from actcfg.runtime.offload import OffloadEngine, host_loopback

    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, prefetch=prefetch, device="cpu")
        x = torch.randn(256, requires_grad=True)
        with engine.step():
            h = x
            for _ in range(4):
                engine.mark_group()
                h = (h * 1.0).exp()
            out = h.sum()
        out.backward()
        assert engine.stats.late_reloads == late


def _chain_step(engine, x, n, *, rules=(), gaps=False):
    """One forward+backward of n exp() layers under `engine`, a group per layer; `rules[i]`
    False keeps layer i's group on the device; `gaps` closes each group at the layer's exit,
    with an extra exp() between layers (what a module no rule matches saves)."""
    with engine.step():
        if gaps:
            engine.end_group()
        h = x
        for i in range(n):
            engine.mark_group(offload=rules[i] if rules else True)
            h = (h * 1.0).exp()
            if gaps:
                engine.end_group()
                h = h.sin()
        out = h.sum()
    out.backward()
    return engine.stats


def _moved(stats):
    return [i for i, b in enumerate(stats.group_offloaded_bytes) if b]


@pytest.mark.parametrize(("keep_last", "first", "moved"), [
    (0, [1, 2, 3], [1, 2, 3]), (1, [1, 2, 3], [1, 2, 3]), (2, [1, 2, 3], [1, 2]), (3, [1, 2, 3], [1]),
])
def test_loopback_keep_last_keeps_the_newest_groups_marked_for_offload(keep_last, first, moved):
    """Groups 1-4 hold one layer each (0 is the empty group open before the first mark); the
    group still open at the end (4) never moves; keep_last keeps the newest ones before it too.
    In the first step the engine knows the last groups only by the copies still in flight at
    the end, and a loopback copy is done (and its group released, at the next pack) as soon as
    it is launched: none; from the second step on, by the step before."""
    from actcfg.runtime.offload import OffloadEngine, host_loopback

    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, keep_last=keep_last, device="cpu")
        x = torch.randn(256, requires_grad=True)
        assert _moved(_chain_step(engine, x, 4)) == first
        second = _chain_step(engine, x, 4)
        assert _moved(second) == moved
        one = 256 * 4
        assert second.kept_bytes == (4 - len(moved)) * one
        assert second.offloaded_bytes == len(moved) * one == second.reloaded_bytes
        assert second.copy_waits == 0  # loopback copies are done when launched


def test_loopback_groups_marked_offload_false_stay_and_are_counted():
    from actcfg.runtime.offload import OffloadEngine, host_loopback

    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, keep_last=0, device="cpu")
        x = torch.randn(256, requires_grad=True)
        plain = x.detach().clone().requires_grad_()
        h = plain
        for _ in range(4):
            h = (h * 1.0).exp().sin()
        h.sum().backward()
        stats = _chain_step(engine, x, 4, rules=(True, False, True, False), gaps=True)
        one = 256 * 4
        # groups: 0 (empty), 1 gap, then layer i at 2 + 2i and its gap at 3 + 2i
        assert _moved(stats) == [2, 6]
        assert stats.group_kept_bytes[4] == stats.group_kept_bytes[8] == one
        # each gap keeps the sin() input; layers 1 and 3 keep their exp() input
        assert stats.kept_by_rule_bytes == 4 * one + 2 * one
        assert stats.offloaded_bytes == 2 * one == stats.reloaded_bytes
        assert stats.late_reloads == 0  # the kept groups above each one started its reload
        assert torch.equal(x.grad, plain.grad)


class _Pending:
    """A loopback copy that is never done early: the engine must wait for it (a slow link)."""

    def query(self) -> bool:
        return False


@pytest.mark.parametrize(("max_inflight", "most"), [(1, 2), (2, 3)])
def test_loopback_max_inflight_bounds_the_copies_in_flight(monkeypatch, max_inflight, most):
    """With copies that finish late, the compute stream waits for the oldest copy once the
    window of `max_inflight` x WINDOW_STORAGES storages is full (each group here saves one; in
    the first step the window is of the largest storage met so far): two copies in flight at
    most, or all three with a window of four. The copies still in flight at the turn are the
    groups keep_last keeps in the first step (here keep_last 3: the two newest), and the oldest
    is waited for once, in the forward or at the turn."""
    from actcfg.runtime import offload

    monkeypatch.setattr(offload._HostStream, "record_event", lambda self: _Pending())
    with offload.host_loopback():
        engine = offload.OffloadEngine(pin=False, min_offload_bytes=0, max_inflight=max_inflight,
                                       keep_last=3, device="cpu")
        x = torch.randn(256, requires_grad=True)
        stats = _chain_step(engine, x, 4)
        assert stats.most_inflight == most
        assert _moved(stats) == [1]
        assert stats.copy_waits == 1


def test_loopback_first_step_reports_a_group_that_left_in_part(monkeypatch):
    """In a first step a group leaves storage by storage: with late copies and a window of two
    storages, group 3's first storage is waited for (and released) while its other two are
    still in flight at the turn, where keep_last 2 keeps them for backward. The group reports
    one storage moved and two that stayed (it reported all three as stayed, nothing moved)."""
    from actcfg.runtime import offload

    monkeypatch.setattr(offload._HostStream, "record_event", lambda self: _Pending())
    with offload.host_loopback():
        engine = offload.OffloadEngine(pin=False, min_offload_bytes=0, max_inflight=1, keep_last=2,
                                       device="cpu")
        x = torch.randn(256, requires_grad=True)
        with engine.step():
            h = x
            for _ in range(4):  # three storages a group
                engine.mark_group()
                a = (h * 1.0).exp()
                b = (a * 1.0).exp()
                h = (b * 1.0).exp()
            out = h.sum()
        out.backward()
    one = 256 * 4
    stats = engine.stats
    assert stats.group_offloaded_bytes == [0, 3 * one, 3 * one, one, 0]
    assert stats.group_kept_bytes == [0, 0, 0, 2 * one, 3 * one]
    assert stats.group_first_reload_bytes == [0, 2 * one, 2 * one, one, 0]
    assert stats.kept_bytes == 5 * one  # marked for offload, on the device at the turn
    assert stats.offloaded_bytes == 9 * one  # copies made: the two that stayed among them


# --- helpers -----------------------------------------------------------------------------


class Chain(nn.Module):
    """Linear+GELU layers; a forward pre-hook marks each layer as an offload group."""

    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _run(model, x, engine=None, hooks_on=None):
    model.zero_grad(set_to_none=True)
    if engine is None:
        out = model(x)
    else:
        handles = [m.register_forward_pre_hook(lambda *_: engine.mark_group()) for m in hooks_on]
        try:
            with engine.step():
                out = model(x)
        finally:
            for h in handles:
                h.remove()
    out.float().square().mean().backward()
    return out.detach(), grads_of(model)


def _pair(n=6, width=1024, rows=2048, dtype=torch.float32):
    torch.manual_seed(0)
    model = Chain(n, width).cuda().to(dtype)
    x = torch.randn(rows, width, device="cuda", dtype=dtype, requires_grad=True)
    return model, x


# --- CUDA ----------------------------------------------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("pin", [True, False])
def test_offload_is_lossless(pin):
    """Every saved activation goes to the host and back; gradients are bitwise the plain run's."""
    from actcfg.runtime.offload import OffloadEngine

    model, x = _pair()
    plain_out, plain_grads = _run(model, x)
    engine = OffloadEngine(pin=pin)
    engine.skip_tensors_of(model)
    for _ in range(2):
        out, grads = _run(model, x, engine, model.layers)
        assert torch.equal(out, plain_out)
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], plain_grads[name]), name
    st = engine.stats
    # 6 layers x (linear input, gelu input): the last layer's group stays on the GPU, and
    # the model's input is a leaf that requires grad, held by its owner: it stays too.
    per_tensor = 2048 * 1024 * 4
    assert st.offloaded_tensors == 9 and st.offloaded_bytes == 9 * per_tensor
    assert st.kept_bytes == 2 * per_tensor
    assert st.reloaded_bytes > 0
    assert (st.pinned_bytes > 0) == pin and (st.pageable_bytes > 0) == (not pin)
    engine.close()


@pytest.mark.cuda
@cuda
def test_memory_held_per_block_is_flat_and_pool_is_reused():
    from actcfg.runtime.offload import OffloadEngine

    n, width, rows = 12, 1024, 4096
    model, x = _pair(n, width, rows)
    one = rows * width * 4
    engine = OffloadEngine()
    engine.skip_tensors_of(model)
    held: list[int] = []
    probes = [m.register_forward_hook(lambda *_: held.append(torch.cuda.memory_allocated())) for m in model.layers]
    allocations = []
    for _ in range(3):
        held.clear()
        _run(model, x, engine, model.layers)
        allocations.append(engine.stats.pinned_allocations)
    for p in probes:
        p.remove()
    growth = growth_per_block(held)  # the last layer's activations stay for backward by design
    assert growth < FLAT_GROWTH * one, f"memory grew {growth / one:.2f} layer inputs per layer: {held}"
    # Plain autograd would hold 2 tensors per layer; the engine holds a bounded few.
    assert max(held) - held[0] < 4 * one
    assert allocations[1] == allocations[0] == allocations[2], allocations
    engine.close()


@pytest.mark.cuda
@cuda
def test_pin_budget_bounds_pinned_memory_and_falls_back_once():
    from actcfg.runtime.offload import OffloadEngine, OffloadWarning

    model, x = _pair()
    _, plain_grads = _run(model, x)
    one = 2048 * 1024 * 4
    budget = 5 * one  # half of the 10 tensors a step offloads
    engine = OffloadEngine(pin_budget=budget)
    engine.skip_tensors_of(model)
    with pytest.warns(OffloadWarning, match=r"pin_budget \(\d+ bytes\) is reached"):
        _, grads = _run(model, x, engine, model.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not every step
        _, grads2 = _run(model, x, engine, model.layers)
    for g in (grads, grads2):
        for name in g:
            assert torch.equal(g[name], plain_grads[name]), name
    assert 0 < engine.stats.pinned_bytes <= budget
    assert engine.stats.pageable_bytes > 0
    engine.close()


@pytest.mark.cuda
@cuda
def test_failing_pinned_allocator_falls_back_to_pageable(monkeypatch):
    from actcfg.runtime import offload, offload_pool

    def refuse(self, buffer):
        raise RuntimeError("cudaHostRegister returned error 2")

    monkeypatch.setattr(offload_pool.HostPool, "_register", refuse)
    model, x = _pair()
    _, plain_grads = _run(model, x)
    engine = offload.OffloadEngine()
    engine.skip_tensors_of(model)
    with pytest.warns(offload.OffloadWarning, match=r"pinning \d+ bytes of host memory failed"):
        _, grads = _run(model, x, engine, model.layers)
    for name in grads:
        assert torch.equal(grads[name], plain_grads[name]), name
    assert engine.stats.pinned_bytes == 0 and engine.stats.pageable_bytes > 0
    engine.close()


@pytest.mark.cuda
@cuda
def test_in_place_change_of_a_saved_tensor_is_an_error_not_a_wrong_gradient():
    from actcfg.runtime.offload import OffloadEngine

    lin = nn.Linear(1024, 1024).cuda()
    engine = OffloadEngine()
    engine.skip_tensors_of(lin)
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    with engine.step():
        h = x * 2
        y = lin(h)  # saves h
        engine.mark_group()
        h.add_(1)  # autograd without hooks raises for this at backward
        z = lin(y)
        engine.mark_group()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    engine.close()


@pytest.mark.cuda
@cuda
def test_exception_in_forward_leaves_the_engine_usable():
    from actcfg.runtime.offload import OffloadEngine

    model, x = _pair()
    _, plain_grads = _run(model, x)
    engine = OffloadEngine()
    engine.skip_tensors_of(model)
    with pytest.raises(ValueError, match="boom"):
        with engine.step():
            model.layers[0](x)
            engine.mark_group()
            raise ValueError("boom")
    # the hooks are gone: autograd saves normally outside the scope
    y = model.layers[0](x)
    assert y.grad_fn is not None
    _, grads = _run(model, x, engine, model.layers)
    for name in grads:
        assert torch.equal(grads[name], plain_grads[name]), name
    engine.close()


@pytest.mark.cuda
@cuda
def test_out_of_memory_on_reload_names_the_setting():
    from actcfg.runtime.offload import OffloadEngine

    model, x = _pair(n=4, width=4096, rows=8192)
    engine = OffloadEngine()
    engine.skip_tensors_of(model)
    handles = [m.register_forward_pre_hook(lambda *_: engine.mark_group()) for m in model.layers]
    with engine.step():
        out = model(x)
    for h in handles:
        h.remove()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    filler = []
    try:
        # Fill the GPU so that only the backward of the kept group fits, not a reload.
        chunk = 1 << 30
        while True:
            try:
                filler.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                if chunk <= 1 << 20:
                    break
                chunk //= 2
        # The original OutOfMemoryError (code that catches it to retry still does), with a note.
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            out.sum().backward()  # sum's backward allocates nothing: the reload is the first allocation
        assert any(re.match(r"^actcfg: out of GPU memory while reloading \d+ MiB .*`checkpoint.modules`", n)
                   for n in getattr(info.value, "__notes__", []))
    finally:
        filler.clear()
        torch.cuda.empty_cache()
    engine.close()
