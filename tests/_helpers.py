"""Test scaffolding stated once: the tiny Llama, the small block stack and the gradient comparison.

Test files import these (`from _helpers import ...`; pytest puts tests/ on the path) instead of
keeping their own copies, so a change to what "the plain gradients" means is made in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actcfg.probes import blocks


class Layer(nn.Module):
    """Linear then GELU: saves its input (Linear) and the Linear's output (GELU's input). The
    planner's tests name it by class (`Layer`) as their candidate."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.lin(x))


def tiny_llama(layers: int = 2, *, seed: int = 0, **config: Any) -> Any:
    """A randomly initialised Hugging Face Llama small enough to train on the CPU in a fraction of
    a second; `config` adds or overrides LlamaConfig fields (e.g. attention_dropout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config}))


def small_blocks(n: int = 4) -> tuple[nn.Module, torch.Tensor]:
    """`n` transformer blocks (d_model 32) and a batch for them, float32 on the CPU, seed 0."""
    torch.manual_seed(0)
    return blocks(n=n, d_model=32, heads=4, ffn=64, batch=2, seq=8, dtype=torch.float32, device="cpu")


def offload_blocks(n: int = 3) -> tuple[nn.Module, torch.Tensor]:
    """`n` blocks whose inputs (4 x 64 x 64 float32, 64 KiB) pass a lowered min_offload_bytes
    (16 KiB), so the loopback engine moves them; float32 on the CPU, seed 0."""
    torch.manual_seed(0)
    return blocks(n=n, d_model=64, heads=4, ffn=128, batch=4, seq=64, dtype=torch.float32, device="cpu")


def grads_of(model: nn.Module, *, as_float: bool = False, skip_missing: bool = False) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient by name (a sharded DTensor's gathered with full_tensor),
    detached copies; `as_float` upcasts them, `skip_missing` leaves out parameters with no grad."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None and skip_missing:
            continue
        g = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach()
        out[name] = g.float().clone() if as_float else g.clone()
    return out


def train_step(model: nn.Module, x: torch.Tensor, run: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """One forward (through `run` when given, e.g. a compiled wrapper) and backward of the mean of
    squares; the gradients by parameter name."""
    model.zero_grad(set_to_none=True)
    (model if run is None else run)(x).square().mean().backward()
    return grads_of(model)


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                       tol: float | None = None) -> None:
    """The same parameters, each gradient within `tol` (absolute and relative; None: torch's
    defaults for the dtype, 0.0: bit-identical)."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)


def assert_grads_within(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float,
                        *, check_keys: bool = True) -> None:
    """Each gradient finite and within `rtol` of the plain one in relative norm (for low-precision
    runs where elementwise closeness is too strict)."""
    if check_keys:
        assert got.keys() == want.keys()
    for name, w in want.items():
        g, w = got[name].float(), w.float()
        assert torch.isfinite(g).all(), name
        err = float((g - w).norm() / w.norm().clamp_min(1e-30))
        assert err <= rtol, f"{name}: relative gradient error {err:.3g}"


def max_rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|got - want| / max|want|; inf when a gradient is missing (a
    number, so a spawned rank can write it to its result file for the parent to judge)."""
    if got.keys() != want.keys():
        return float("inf")
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def saved_bytes(model: nn.Module, x: torch.Tensor, modules: list[nn.Module], min_bytes: int) -> list[int]:
    """What autograd saves while each of `modules` runs in one plain training step of `model`:
    bytes of distinct tensors (by data pointer), leaving out parameters, the caller's batch `x` and tensors under
    `min_bytes` (none of which the offload engine moves). Measured on the plain model, so a test
    can state exactly what an offloading run of a copy must move."""
    params = {p.data_ptr() for p in model.parameters()} | {x.data_ptr()}
    seen: list[set[int]] = [set() for _ in modules]
    sizes: dict[int, int] = {}
    current: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.data_ptr()
        if current[0] is not None and t.nbytes >= min_bytes and ptr not in params:
            seen[current[0]].add(ptr)
            sizes[ptr] = max(sizes.get(ptr, 0), t.nbytes)
        return t

    def enter(i: int) -> Any:
        return lambda *_: current.__setitem__(0, i)

    handles = [m.register_forward_pre_hook(enter(i)) for i, m in enumerate(modules)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).square().mean().backward()
    finally:
        for h in handles:
            h.remove()
    return [sum(sizes[p] for p in ptrs) for ptrs in seen]



FLAT_GROWTH = 0.5
"""Growth per block, in block inputs, below which memory held across blocks counts as flat on
the GPU. The engine copies storage by storage with up to two storages in flight, so one reading
can sit up to about a block input above its neighbours depending on when a copy finishes; a
policy whose offload does not take effect holds at least one more block input per block."""


def growth_per_block(held: list[int]) -> float:
    """Bytes by which the memory held after each block grows per block: the least-squares slope
    over every reading but the last. The last block's activations stay on the GPU for backward by
    design (its group never leaves), and a slope over all the others is not swayed, as endpoints
    are, by one reading taken while a copy was still in flight."""
    ys = held[:-1]
    n = len(ys)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    return sum((i - mean_x) * (y - mean_y) for i, y in enumerate(ys)) / sum((i - mean_x) ** 2 for i in range(n))


def readme_snippet(heading: str) -> str:
    """The first ```python block under `heading` in README.md."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def watch_host_pools(monkeypatch: Any) -> tuple[list[tuple[int, str]], list[Any]]:
    """Record every host buffer the offload pools make (its size and the thread that made it)
    and every pool built, while `monkeypatch` lasts: (made, pools), filled as they happen."""
    import threading

    from actcfg.runtime import offload_pool

    made: list[tuple[int, str]] = []
    pools: list[offload_pool.HostPool] = []
    touched, init = offload_pool._touched, offload_pool.HostPool.__init__

    def watched(nbytes: int) -> torch.Tensor:
        made.append((nbytes, threading.current_thread().name))
        return touched(nbytes)

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        pools.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(offload_pool, "_touched", watched)
    monkeypatch.setattr(offload_pool.HostPool, "__init__", counted)
    return made, pools


def python_calls(step: Callable[[], Any]) -> int:
    """Python function calls (frames entered) while `step` runs."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(previous)
    return calls
