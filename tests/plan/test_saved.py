"""actcfg/plan/saved.py on the CPU: what each block saves, counted once per storage, and a storage
told apart by what it is, not by its address (which a freed storage leaves to the next one)."""

from __future__ import annotations

import numpy
import torch
from torch import nn

from actcfg.plan.saved import saved_bytes
from actcfg.plan.probe import LiveBytes
from _helpers import tiny_llama

ROWS, WIDTH = 64, 64
ONE = ROWS * WIDTH * 4


class Reused(nn.Module):
    """Two matmul outputs, one after the other, in the same memory but in two storages: the first
    is gone when the second is made, as a freed activation's memory goes to the next one (which
    the CUDA caching allocator does at once, and the CPU's often). Host memory from numpy makes
    the reuse certain."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(WIDTH))
        self.memory = numpy.zeros((ROWS, WIDTH), dtype=numpy.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x
        for _ in range(2):
            out = torch.from_numpy(self.memory)  # a new storage over the same memory
            torch.mm(x.detach(), self.w.detach(), out=out)
            total = total + out.sum()
            del out
        return total


def test_an_op_output_made_where_a_freed_one_was_is_counted_too():
    torch.manual_seed(0)
    model = Reused()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    ops = [torch.ops.aten.mm.out]
    # Keyed by address alone, the second output was taken for the first: one counted, not two.
    assert saved_bytes(model, [model], (x,), {}, save_ops=ops) == [2 * ONE]


def test_each_llama_layer_counts_what_it_holds_and_the_shared_rotary_tables_once():
    """Counted with hooks against the meter: between two layers' starts the live bytes grow by
    what the first holds. cos and sin, made once before the layers and saved by every one, are
    counted once, in the first layer (they are alive before it: what it holds is one table
    pair less than its count); the layers above name them as saved by an earlier one."""
    torch.manual_seed(0)
    model = tiny_llama(3, hidden_size=64, intermediate_size=176, num_attention_heads=2,
                       num_key_value_heads=2).train()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    layers = list(model.model.layers)
    shared_in, shared_out = [0] * 3, [0] * 3
    counted = saved_bytes(model, layers, (), {"input_ids": ids}, shared_in=shared_in, shared_out=shared_out)
    live = LiveBytes()
    starts: list[int] = []

    def mark(module, args, kwargs):
        live._sweep()
        starts.append(live.now)

    handles = [layer.register_forward_pre_hook(mark, with_kwargs=True) for layer in layers]
    live.start()
    try:
        out = model(input_ids=ids)
    finally:
        live.stop()
        for h in handles:
            h.remove()
    del out
    held = [b - a for a, b in zip(starts, starts[1:])]
    tables = 2 * 32 * (64 // 2) * 4  # cos and sin: (1, sequence, head_dim) float32
    assert counted[1:-1] == held[1:]
    assert counted[0] == held[0] + tables
    assert counted[1] == counted[2]
    # every layer above the first saves the tables layer 0 counted (`BlockProfile.shared_in`)
    assert shared_in == [0, tables, tables] and shared_out == [tables, 0, 0]


class _Cast(nn.Module):
    """A Linear block, checkpointed or not, its forward under CPU autocast (bf16) from outside."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=False).relu()
        return self.linear(x).relu()


class _Autocast(nn.Module):
    def __init__(self, checkpointed: bool, autocast: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Cast(checkpointed) for _ in range(3))
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            for block in self.blocks:
                x = block(x)
            return x.float().sum()


def test_what_a_block_leaves_until_the_forward_ends_is_its_unsaved_weight_casts():
    """autocast caches each weight's bf16 cast until its region ends: a kept Linear saves its
    weight's cast (counted as held) and leaves its bias's; a checkpointed one saves neither and
    leaves both. Without autocast nothing is left."""
    torch.manual_seed(0)
    # Not a leaf (autocast caches a leaf's cast too), and it requires grad (else the first
    # Linear saves no weight cast: it needs none for an input that needs no gradient).
    x = torch.randn(ROWS, WIDTH, requires_grad=True) * 1.0
    weight, bias = WIDTH * WIDTH * 2, WIDTH * 2  # bf16
    for checkpointed, autocast, expected in [(False, True, bias), (True, True, weight + bias),
                                             (False, False, 0), (True, False, 0)]:
        model = _Autocast(checkpointed, autocast)
        left = [0] * 3
        held = saved_bytes(model, list(model.blocks), (x,), {}, left=left)
        assert left == [expected] * 3, (checkpointed, autocast)
        if autocast and not checkpointed:
            assert all(h >= weight for h in held)  # the weight's cast is saved, so held


def test_an_output_a_later_module_takes_as_its_input_is_told_as_counted_twice():
    """A lone Linear's output is a saved op's output (selective keeps it) and the next Linear's
    input (its checkpoint keeps that): one storage. `passed_on` names it on the taker, so a
    uniform selective run's blocks before b are read as holding it once."""
    from actcfg.policy.schema import DEFAULT_SAVE_OPS
    from actcfg.runtime.torch_applier import resolve_ops

    torch.manual_seed(0)
    chain = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    x = torch.randn(ROWS, WIDTH)
    passed = [0] * 3
    outputs = saved_bytes(chain, list(chain), (x,), {}, save_ops=resolve_ops(DEFAULT_SAVE_OPS),
                          passed_on=passed)
    assert outputs == [ONE, ONE, ONE]  # each Linear's addmm output
    assert passed == [0, ONE, ONE]  # the first takes the batch; each later one an earlier output
