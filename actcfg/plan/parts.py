"""The parts of each candidate block (`checkpoint.submodules`): the finer candidates a plan may
checkpoint one by one instead of the whole block.

A block split into parts is planned as one unit (the `split` choice): each part gets its own
checkpoint, and what the block saves outside its parts (an attention kernel between two
projections, a residual) stays saved. Only one part is recomputed at a time in backward, so the
block's recompute peaks at its largest part, not at the whole block: the way below the peak of
checkpointing every block, which comes in the first block's backward (Megatron-Core's
fine-grained recompute names the same parts: attention, MLP, norms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from actcfg.errors import PlanError
from actcfg.runtime.wrap import pattern_matches

__all__ = ["find_parts", "input_storages"]


def _children(block: nn.Module) -> list[tuple[str, nn.Module]]:
    # Direct children that hold parameters: what a block is built from (a Llama layer's norms,
    # self_attn and mlp); a parameterless child (a dropout, an activation) has nothing to split.
    return [(n, m) for n, m in block.named_children() if any(True for _ in m.parameters())]


def _matching(block: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in block.named_modules()
            if n and any(pattern_matches(p, n, m) for p in patterns)]


def find_parts(blocks: Sequence[tuple[str, nn.Module]],
               submodules: str | Sequence[str]) -> list[tuple[tuple[str, nn.Module], ...]]:
    """Per block (name, module), its parts as (qualified name, module), in module order:
    `none` gives none, `children` the direct children holding parameters, patterns the
    submodules they match (relative names segment by segment, or class names). PlanError
    for a block no pattern finds a part in, and for a part inside another (it would be
    recomputed twice)."""
    if submodules == "none":
        return [() for _ in blocks]
    out = []
    for name, block in blocks:
        found = _children(block) if submodules == "children" else _matching(block, submodules)
        if not found:
            said = ("has no child that holds parameters" if submodules == "children" else
                    f"has no submodule matching {', '.join(repr(p) for p in submodules)}")
            children = ", ".join(n for n, _ in block.named_children()) or "none"
            raise PlanError(
                f"checkpoint.submodules: candidate {name} ({type(block).__name__}) {said} (its "
                f"children: {children}); name parts every candidate has, relative to it "
                "(`[self_attn, mlp]`), or set `submodules: none` to plan whole modules")
        for (outer, _), (inner, _) in zip(found, found[1:]):
            if inner.startswith(outer + "."):
                raise PlanError(
                    f"checkpoint.submodules: in candidate {name}, {outer} and {inner} both match, "
                    "one inside the other: the inner part would be recomputed twice; narrow the "
                    "patterns so that only one of them matches")
        out.append(tuple((f"{name}.{n}", m) for n, m in found))
    return out


@contextlib.contextmanager
def input_storages(parts: Sequence[Sequence[tuple[str, nn.Module]]], into: list[int]) -> Iterator[None]:
    """While the `with` block runs, append to `into` the bytes of each storage a part's first
    call takes as a tensor input (each storage once per part; parts in module order over every
    block): what `split_offload` copies to the host (a checkpointed part keeps its inputs and
    nothing else). Read in the keep count, before any offload run, so the host pool can make
    their buffers ahead: a GPT-2 GELU part's input is its 4x-wide projection (100 MB at n_embd
    1536, batch 8 x 1024, bf16), which no block input matches in size, and pinning those on
    demand was 5 plain steps of a 24-step profile (H200)."""
    flat = [m for ps in parts for _, m in ps]
    called = [False] * len(flat)

    def record(index: int, args: tuple, kwargs: dict) -> None:
        if called[index]:
            return
        called[index] = True
        seen: set[int] = set()
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    into.append(storage.nbytes())

    hooks = [m.register_forward_pre_hook(lambda _m, a, k, i=i: record(i, a, k), with_kwargs=True)
             for i, m in enumerate(flat)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
