"""Long-run and fault behaviour of an applied offload policy on the GPU (issue 6, runtime faults).

Marked `cuda`: skipped where torch sees no GPU, run on the GPU machine with `pytest -m cuda`.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import actcfg
from actcfg import probes
from _helpers import grads_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POLICY = {"version": 1, "backend": "torch", "checkpoint": {"mode": "full", "modules": ["Block"]},
          "cpu_checkpointing": True}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _small_stack():
    torch.manual_seed(0)
    # fp32 so that "identical gradients" can be held to 1e-6: bf16 reductions leave more room
    return probes.blocks(n=6, d_model=512, heads=8, ffn=2048, batch=4, seq=512, dtype=torch.float32)


def test_200_steps_memory_flat_and_gradients_equal_every_step():
    plain, x = _small_stack()
    model = copy.deepcopy(plain)
    handle = actcfg.apply(model, POLICY)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gpu, host, pinned = [], [], []
    worst = 0.0
    for _ in range(200):
        for m, o in ((plain, opt_plain), (model, opt)):
            o.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        for a, b in zip(grads_of(plain).values(), grads_of(model).values()):
            worst = max(worst, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
        opt_plain.step()
        opt.step()
        torch.cuda.synchronize()
        # requested bytes, not memory_allocated(): the allocator may hand a tensor a block up
        # to 1 MiB larger than asked, which moved memory_allocated() by 1 MiB steps here
        gpu.append(torch.cuda.memory_stats()["requested_bytes.all.current"])
        host.append(_rss())
        pinned.append(handle.engine.stats.pinned_bytes)
    assert worst <= 1e-6, f"gradients drifted from the plain run: max rel. error {worst:.2e}"
    assert handle.engine.stats.offloaded_bytes > 0  # the policy really offloaded
    assert len(set(gpu[1:])) == 1, f"GPU memory moved after step 2: {sorted(set(gpu[1:]))[:5]}"
    assert len(set(pinned[1:])) == 1, "the pinned pool grew after the first step"
    # host RSS: allow allocator noise of 64 MiB over 198 steps, far below one step's offload
    assert max(host[1:]) - host[1] < 64 * 2**20, f"host memory grew {(max(host[1:]) - host[1]) / 2**20:.0f} MiB"
    handle.remove()


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_eval_and_no_grad_forwards_leak_nothing(mode):
    model, x = _small_stack()
    handle = actcfg.apply(model, POLICY)
    model(x).sum().backward()  # one training step warms the pool
    offloaded_steps = handle.engine.stats.steps
    if mode == "eval":
        model.eval()
    gpu, host = [], []
    ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with ctx:
        for _ in range(100):
            out = model(x)
            del out
            torch.cuda.synchronize()
            gpu.append(torch.cuda.memory_stats()["requested_bytes.all.current"])
            host.append(_rss())
    # The offload acts by grad mode (issue 20): eval() with grad on goes through the engine,
    # under no_grad nothing does; neither keeps memory.
    expected = offloaded_steps + (100 if mode == "eval" else 0)
    assert handle.engine.stats.steps == expected
    assert len(set(gpu[1:])) == 1
    assert max(host[1:]) - host[1] < 64 * 2**20
    handle.remove()


def test_exception_in_forward_and_backward_then_training_and_remove_still_work():
    plain, x = _small_stack()
    model = copy.deepcopy(plain)
    names = [n for n, _ in model.named_parameters()]
    handle = actcfg.apply(model, POLICY)
    boom = model.blocks[3].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    boom.remove()

    out = model(x)
    hook = out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))
    with pytest.raises(RuntimeError, match="boom in backward"):
        out.square().mean().backward()
    hook.remove()
    del out

    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
    for a, b in zip(grads_of(plain).values(), grads_of(model).values()):
        assert ((a - b).norm() / a.norm()).item() <= 1e-6
    handle.remove()
    assert [n for n, _ in model.named_parameters()] == names
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()  # the plain model again: no hooks left behind
    for a, b in zip(grads_of(plain).values(), grads_of(model).values()):
        assert ((a - b).norm() / a.norm()).item() <= 1e-6
