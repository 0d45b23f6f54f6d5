"""The offload engine's host pool grows ahead of need: where its buffers are made, their reuse, the budget.

On the host loopback (CPU CI runs these) the pool serves pageable buffers through the same code
that serves pinned ones on CUDA; the pinned accounting is exercised on the pool itself, with the
driver's registration call (which needs a GPU) replaced by nothing.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from actcfg.runtime import offload_pool
from actcfg.runtime.offload import OffloadEngine, OffloadStats, OffloadWarning, host_loopback

WIDTH = 1 << 14  # floats per layer's saved tensor: 64 KiB
ONE = WIDTH * 4


def _layers_step(engine: OffloadEngine, x: torch.Tensor, n: int) -> OffloadStats:
    """One forward+backward of n exp() layers, a group per layer (each saves one tensor of ONE bytes)."""
    with engine.step():
        h = x
        for _ in range(n):
            engine.mark_group()
            h = (h * 1.0).exp()
        out = h.sum()
    out.backward()
    del out, h
    gc.collect()  # the chunks die with the graph: their buffers go back to the pool
    return engine.stats


@pytest.fixture
def made_on(monkeypatch):
    """The thread each new host buffer is made on, in order (the pool's own allocator, watched)."""
    threads: list[str] = []
    touched = offload_pool._touched

    def watched(nbytes: int) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return touched(nbytes)

    monkeypatch.setattr(offload_pool, "_touched", watched)
    return threads


def test_first_step_makes_two_buffers_on_demand_and_the_rest_ahead_on_the_pool_thread(made_on):
    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, device="cpu")
        x = torch.randn(WIDTH, requires_grad=True)
        first = _layers_step(engine, x, 8)
        requests = first.offloaded_tensors
        assert requests == 7  # the last layer's group stays on the device
        # The first two of a size are made when a copy needs them; the second one shows the size
        # repeats, so from then on each request takes a buffer made ahead, and orders the next.
        assert first.host_buffers_on_demand == 2
        assert first.host_buffers_ahead == requests - 2 + 1  # one spare left after the last
        assert made_on[:2] == ["MainThread", "MainThread"]
        assert len(made_on) == 2 + first.host_buffers_ahead
        assert all(name.startswith("actcfg-host-pool") for name in made_on[2:])
        assert first.pageable_bytes == (requests + 1) * ONE
        engine.close()


def test_later_steps_reuse_every_buffer_and_order_nothing(made_on):
    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, device="cpu")
        x = torch.randn(WIDTH, requires_grad=True)
        _layers_step(engine, x, 8)
        grown = (engine.stats.pageable_bytes, engine.stats.host_buffers_ahead, len(made_on))
        for _ in range(3):
            st = _layers_step(engine, x, 8)
            assert st.offloaded_tensors == 7 and st.reloaded_bytes == 7 * ONE
            assert st.host_buffers_on_demand == 2  # lifetime counter: none since the first step
            assert (st.pageable_bytes, st.host_buffers_ahead, len(made_on)) == grown
        engine.close()


def test_gradients_through_buffers_made_ahead_equal_the_plain_run():
    x0 = torch.randn(WIDTH)
    plain = x0.clone().requires_grad_()
    h = plain
    for _ in range(8):
        h = (h * 1.0).exp() * 0.5
    h.sum().backward()
    with host_loopback():
        engine = OffloadEngine(pin=False, min_offload_bytes=0, device="cpu")
        for _ in range(2):
            x = x0.clone().requires_grad_()
            with engine.step():
                h = x
                for _ in range(8):
                    engine.mark_group()
                    h = (h * 1.0).exp() * 0.5
            h.sum().backward()
            assert torch.equal(x.grad, plain.grad)
        assert engine.stats.host_buffers_ahead > 0
        engine.close()


def test_a_size_seen_once_orders_no_spare():
    pool = offload_pool.HostPool(False, None, stats := OffloadStats())
    for n in (ONE, 3 * ONE, 7 * ONE):  # none serves another (best fit takes at most 2x)
        pool.acquire(n)
    assert stats.host_buffers_on_demand == 3 and stats.host_buffers_ahead == 0
    assert stats.pageable_bytes == 11 * ONE
    pool.close()


@pytest.fixture
def no_driver(monkeypatch):
    """Pinning needs the CUDA driver: on the CPU the registration is skipped and everything the
    pool decides and counts around it is real."""
    monkeypatch.setattr(offload_pool.HostPool, "_register", lambda self, buffer: None)
    monkeypatch.setattr(offload_pool.HostPool, "_unregister", lambda self, buffer: None)


def _settle(pool: offload_pool.HostPool) -> None:
    """Wait for the spares in preparation (their bytes are already counted)."""
    for future in [f for queue in list(pool._queued.values()) for f in list(queue)]:
        future.result()


def test_spares_stay_within_pin_budget_and_requests_past_it_fall_back_once(no_driver):
    stats = OffloadStats()
    budget = 5 * ONE
    pool = offload_pool.HostPool(True, budget, stats)
    pinned = []
    with pytest.warns(OffloadWarning, match=r"pin_budget \(\d+ bytes\) is reached") as caught:
        for _ in range(7):
            pinned.append(pool.acquire(ONE)[2])
            _settle(pool)
            assert stats.pinned_bytes <= budget
    assert len(caught) == 1  # warned once, not per request
    # 2 on demand, 3 made ahead; a 6th spare would pass the budget, so none was ordered
    assert pinned == [True] * 5 + [False] * 2
    assert stats.pinned_bytes == budget and stats.pinned_allocations == 5
    assert stats.host_buffers_ahead == 3 and stats.pinned_fallbacks == 2
    pool.close()


def test_an_unused_spare_gives_way_to_a_request_under_the_budget(no_driver):
    stats = OffloadStats()
    pool = offload_pool.HostPool(True, 4 * ONE, stats)
    for _ in range(2):
        assert pool.acquire(ONE)[2]
    _settle(pool)
    assert stats.pinned_bytes == 3 * ONE  # two taken, one spare ready
    buffer, _, pinned = pool.acquire(2 * ONE)  # fits only without the spare
    assert pinned and buffer.numel() == 2 * ONE
    assert stats.pinned_bytes == 4 * ONE and stats.pinned_fallbacks == 0
    assert not pool._spares  # the spare was unpinned to make room
    pool.close()


def test_a_spare_that_fails_to_pin_is_dropped_and_the_next_request_warns(monkeypatch):
    calls = []

    def register(self, buffer):
        calls.append(threading.current_thread().name)
        if len(calls) > 2:  # the spare, on the pool's thread
            raise RuntimeError("cudaHostRegister returned error 2")

    monkeypatch.setattr(offload_pool.HostPool, "_register", register)
    monkeypatch.setattr(offload_pool.HostPool, "_unregister", lambda self, buffer: None)
    stats = OffloadStats()
    pool = offload_pool.HostPool(True, None, stats)
    pool.acquire(ONE)
    pool.acquire(ONE)
    _settle(pool)
    assert calls[2].startswith("actcfg-host-pool")
    assert stats.pinned_bytes == 2 * ONE and stats.pinned_allocations == 2  # the reservation undone
    with pytest.warns(OffloadWarning, match=r"pinning host memory failed earlier \(cudaHostRegister returned error 2\)"):
        assert pool.acquire(ONE)[2] is False
    pool.close()


def test_close_stops_the_pool_thread_and_drops_every_buffer(no_driver):
    pool = offload_pool.HostPool(True, None, OffloadStats())
    pool.acquire(ONE)
    pool.acquire(ONE)
    pool.close()
    assert pool._worker is None and not pool._queued and not pool._free and not pool._registered
    assert not any(t.name.startswith("actcfg-host-pool") and t.is_alive() for t in threading.enumerate())


def test_a_spare_behind_a_released_buffer_gives_way_too(no_driver):
    stats = OffloadStats()
    pool = offload_pool.HostPool(True, 5 * ONE, stats)
    b1, _, _ = pool.acquire(ONE)
    pool.acquire(ONE)  # the size repeats: a spare is ordered
    _settle(pool)
    pool.acquire(ONE)  # takes the spare, orders the next
    pool.release(b1, None, True)  # a used buffer lands in the free list before the new spare
    _settle(pool)
    assert [e[0].data_ptr() in pool._spares for e in pool._free[ONE]] == [False, True]
    assert stats.pinned_bytes == 4 * ONE
    buffer, _, pinned = pool.acquire(2 * ONE)
    assert pinned and stats.pinned_bytes == 5 * ONE and stats.pinned_fallbacks == 0
    assert [e[0] is b1 for e in pool._free[ONE]] == [True]  # the used buffer stays
    pool.close()


def test_engines_in_a_shared_pool_scope_reuse_its_buffers_and_it_is_closed_at_the_end(made_on):
    """The planner's offload trials run one after another: within `shared_host_pool` the second
    engine finds every buffer the first made, its stats show the pool it uses, and only the
    scope's end frees the pool."""
    with host_loopback():
        x = torch.randn(WIDTH, requires_grad=True)
        with offload_pool.shared_host_pool(False, None, register=False) as pool:
            first = OffloadEngine(pin=False, min_offload_bytes=0, device="cpu")
            grown = _layers_step(first, x, 8)
            made, held = len(made_on), grown.pageable_bytes
            assert first._pool is pool and made == 2 + grown.host_buffers_ahead
            first.close()
            assert not pool._closed and pool._free  # given back, buffers and all
            second = OffloadEngine(pin=False, min_offload_bytes=0, device="cpu")
            st = _layers_step(second, x, 8)
            assert second._pool is pool and st.offloaded_tensors == 7
            assert len(made_on) == made  # nothing made again
            assert (st.pageable_bytes, st.host_buffers_on_demand) == (held, 2)  # the pool's, carried
            second.close()
        assert pool._closed and not pool._free and not pool._queued


def test_prepare_makes_every_buffer_asked_ahead_on_the_pool_thread_within_the_budget(no_driver, made_on):
    """The planner orders the offload run's buffers before the run (`HostPool.prepare`): several
    of one size are queued, each made in order on the pool's thread; the requests then find them
    and make nothing; past the budget nothing more is ordered."""
    stats = OffloadStats()
    pool = offload_pool.HostPool(True, 6 * ONE, stats)
    pool.prepare([ONE] * 4 + [2 * ONE] * 2)  # the second 2 * ONE would pass the budget
    buffers = [pool.acquire(ONE) for _ in range(4)] + [pool.acquire(2 * ONE)]
    assert all(pinned for _, _, pinned in buffers)
    _settle(pool)
    # the last spare of each size taken orders the next, which the budget has no room for
    assert len(made_on) == 5 and all(t.startswith("actcfg-host-pool") for t in made_on)
    assert (stats.host_buffers_on_demand, stats.host_buffers_ahead) == (0, 5)
    assert stats.pinned_bytes == 6 * ONE and stats.pinned_fallbacks == 0
    assert not pool._queued  # every queued buffer made
    pool.close()


def test_an_engine_the_shared_pool_does_not_fit_makes_its_own():
    """Another pin setting, a per-node budget, or a pool another engine holds now: its own pool."""
    with host_loopback(), offload_pool.shared_host_pool(False, None, register=False) as pool:
        holder = OffloadEngine(pin=False, device="cpu")
        at_once = OffloadEngine(pin=False, device="cpu")
        pinned = OffloadEngine(pin=True, device="cpu")
        per_node = OffloadEngine(pin=False, pin_budget_per_node=1 << 30, device="cpu")
        assert holder._pool is pool
        assert all(e._pool is not pool for e in (at_once, pinned, per_node))
        for e in (holder, at_once, pinned, per_node):
            e.close()
        assert not pool._closed  # engines never close the shared pool
        after = OffloadEngine(pin=False, device="cpu")
        assert after._pool is pool  # free again once its holder closed
        after.close()
    # outside the scope nothing is lent (never the closed pool)
    assert offload_pool.borrow_shared_pool(False, None, False, OffloadStats()) is None


def test_a_llama_with_checkpoint_and_offload_grows_its_pool_ahead_in_the_first_step_only():
    """Through actcfg.apply, on a small Hugging Face Llama (the issue's model family): each layer
    offloads its input, one size; the first step makes two on demand and the rest ahead."""
    import warnings

    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation notes on import
        from transformers import LlamaConfig, LlamaForCausalLM

    import actcfg

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (1, 256))  # a layer input: 256 x 64 fp32 = 64 KiB
    policy = {"version": 1, "checkpoint": {"mode": "full", "modules": ["LlamaDecoderLayer"]},
              "cpu_checkpointing": True}
    with host_loopback():
        handle = actcfg.apply(model, policy)
        handle.engine.min_offload_bytes = 1 << 15  # the layer inputs move, the rotary cos/sin stay
        seen = []
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            gc.collect()
            st = handle.engine.stats
            seen.append((st.host_buffers_on_demand, st.host_buffers_ahead, st.pageable_bytes))
        moved = st.offloaded_tensors
        handle.remove()
    layer_input = 256 * 64 * 4
    assert moved >= 4 and st.offloaded_bytes == moved * layer_input  # layer inputs only
    assert seen[0][:2] == (2, moved - 1)  # one spare left after the first step
    assert seen[1] == seen[0] == seen[2]  # later steps reuse every buffer
