"""Byte counting: what autograd saves inside each candidate block's forward.

Saved-tensor hooks count the storages saved inside each module's forward (its first call; each
storage once); for selective checkpointing, a dispatch mode counts the outputs of the ops it
saves. Which saved tensors count is the offload engine's own test (`actcfg.runtime.offload.stays`):
the bytes counted are the bytes an offload would move.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from actcfg.runtime.offload import stays

__all__ = ["counted", "saved_bytes"]


def counted(tensor: torch.Tensor) -> bool:
    """A saved tensor that is an activation: one the offload engine would consider moving
    (its own test, on the tensor's own device; buffers are not told apart here)."""
    return stays(tensor, tensor.device, set()) is None


class _Attribution:
    """Which candidate's forward is running (first call only), for the byte counts."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.current: int | None = None
        self.seen: set[int] = set()
        self.handles = []
        # Never traced (see `Probe`): in a model compiled whole, dynamo would replay these
        # attribute writes after its graph, when the saved tensors are already packed.
        for i, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(torch.compiler.disable(self._enter(i))))
            self.handles.append(module.register_forward_hook(torch.compiler.disable(self._leave(i))))

    def _enter(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if i not in self.seen:
                self.seen.add(i)
                self.current = i
        return hook

    def _leave(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.current == i:
                self.current = None
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _Storages:
    """Storages counted so far, each once while it lives. An address alone is not a storage: a
    saved op output the plain forward frees (Llama's q, k, o and down projections: the next op
    saves only its other operand) leaves its address to the next allocation, which the CUDA
    allocator (and the CPU's) hands out at once; keyed by address only, that next storage was
    taken for the freed one and never counted (on the CPU's tiny Llama, one block input per
    layer of what `selective` keeps)."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._expired = torch.UntypedStorage._expired  # type: ignore[attr-defined]
        self._seen: dict[int, Any] = {}

    def add(self, storage: torch.UntypedStorage) -> bool:
        """True when `storage` is new (and now counted); False when it was counted already."""
        key = storage.data_ptr()
        known = self._seen.get(key)
        if known is not None and not self._expired(known.cdata):
            return False
        self._seen[key] = self._ref(storage)
        return True

    def alive(self, key: int) -> bool:
        """True when a storage counted under address `key` is still alive."""
        known = self._seen.get(key)
        return known is not None and not self._expired(known.cdata)


class _OpOutputs(TorchDispatchMode):
    """Adds the storage bytes of every output of `ops` to the running candidate's count."""

    def __init__(self, ops: set[Any], where: _Attribution, out: list[int], seen: _Storages) -> None:
        super().__init__()
        self.ops, self.where, self.out, self.seen = ops, where, out, seen
        self.made: dict[int, tuple[int, int]] = {}  # address -> (candidate, bytes), each counted one

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        i = self.where.current
        if i is not None and (func in self.ops or getattr(func, "overloadpacket", None) in self.ops):
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.nbytes() and self.seen.add(storage):
                        self.out[i] += storage.nbytes()
                        self.made[storage.data_ptr()] = (i, storage.nbytes())
        return result

    def count_passed_on(self, modules: Sequence[nn.Module], into: list[int]) -> list[Any]:
        """Adds to `into`, per candidate, the bytes of counted outputs of earlier candidates it
        takes as inputs (a lone Linear's output is the next one's input); returns the hooks
        that count them."""
        def taking(j: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                for t in tree_flatten((args, kwargs))[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    # Still alive: it is an input now, so its address is still its own.
                    made = self.made.get(t.untyped_storage().data_ptr())
                    if made is not None and made[0] < j:
                        into[j] += made[1]
                        del self.made[t.untyped_storage().data_ptr()]
            return hook
        return [m.register_forward_pre_hook(torch.compiler.disable(taking(j)), with_kwargs=True)
                for j, m in enumerate(modules)]


class _Created(TorchDispatchMode):
    """Remembers the storages ops create inside each candidate's forward (not an input's, and
    each once), to read at the turn which of them are still alive without being saved."""

    def __init__(self, where: _Attribution, skip_ops: set[Any]) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.where, self.skip_ops, self._ref = where, skip_ops, StorageWeakRef
        self.made: dict[int, tuple[Any, int, int]] = {}  # address -> (weak ref, bytes, candidate)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        i = self.where.current
        # Outputs of the ops selective checkpointing saves are kept by its own cache, beside
        # autograd's hooks: they are what `selective` holds (counted apart), not left over.
        if i is None or func in self.skip_ops or getattr(func, "overloadpacket", None) in self.skip_ops:
            return result
        given = None
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if not storage.nbytes():
                    continue
                if given is None:  # a view, or an op that wrote into its input: nothing new
                    given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                             if isinstance(a, torch.Tensor)}
                if storage.data_ptr() not in given:
                    self.made[storage.data_ptr()] = (self._ref(storage), storage.nbytes(), i)
        return result

    def left(self, n: int, saved: _Storages, passed: set[int]) -> list[int]:
        """Per candidate, bytes of the storages it made that are alive now, neither saved nor in
        `passed` (what the last candidate takes and gives: the caller holds both)."""
        out = [0] * n
        expired = torch.UntypedStorage._expired  # type: ignore[attr-defined]
        revive = torch.UntypedStorage._new_with_weak_ptr  # type: ignore[attr-defined]
        for key, (ref, nbytes, i) in self.made.items():
            if expired(ref.cdata) or revive(ref.cdata).data_ptr() != key or key in passed:
                continue
            if saved.alive(key):
                continue
            out[i] += nbytes
        return out


def saved_bytes(model: nn.Module, modules: Sequence[nn.Module], args: tuple[Any, ...],
                kwargs: dict[str, Any], save_ops: Sequence[Any] = (),
                largest: list[int] | None = None, sizes: list[list[int]] | None = None,
                left: list[int] | None = None, kept_apart: Sequence[Any] = (),
                passed_on: list[int] | None = None, shared_in: list[int] | None = None,
                shared_out: list[int] | None = None) -> list[int]:
    """Bytes of the storages autograd saves inside each module's forward (its first call; each
    storage counted once, parameters and leaves that require grad left out); with `save_ops`,
    the bytes of those ops' outputs there instead (what selective checkpointing keeps besides
    the inputs: up to torch 2.13 they bypass saved-tensor hooks). One forward, graph dropped.
    `largest`, when given (one entry per module), gets each module's largest storage counted:
    the unit of the offload engine's copy window. `sizes`, when given (one list per module),
    gets the bytes of each storage counted, in the order saved.

    `left`, when given (one entry per module, not with `save_ops`), gets what each module's
    forward leaves alive when the last module's forward ends beyond the storages saved: storages
    it made that something other than autograd holds until the turn. Under autocast these are
    the casts of the weights it did not save (autocast caches a parameter's cast until its
    region ends, past the loss inside a Hugging Face model's forward): a checkpointed block
    saves none of them and still holds them all through the rest of the forward. `kept_apart`:
    ops whose outputs the policy keeps by other means (selective checkpointing's saved ops),
    not left over. `passed_on`, when given (one entry per module, with `save_ops`), has added to
    each module's entry the bytes of the counted outputs of earlier modules it takes as its
    input: selective checkpointing holds such a storage once, where the counts give it twice
    (the earlier module's saved output, and the input this module's checkpoint keeps). Eager
    only: compiled graphs run below the dispatch mode that sees the ops.

    `shared_in` and `shared_out`, when given (one entry per module, not with `save_ops`), get
    the storages one module saves that an earlier one counted (each storage once per module):
    into the later module's `shared_in` and, once per storage, into the module that counted
    it's `shared_out`. A Llama gives every layer its rotary cos/sin, counted to layer 0 alone:
    where layer 0 offloads them and a later layer saves them in place, they stay on the device
    (`BlockProfile.shared_in`)."""
    where = _Attribution(modules)
    out = [0] * len(modules)
    seen = _Storages()
    # address -> (the module that counted the storage there, its number): a new storage at an
    # address a freed one had is another storage, with a number of its own
    owner: dict[int, tuple[int, int]] = {}
    shared: set[tuple[int, int]] = set()  # (module, storage number) counted in `shared_in`
    passed: set[int] = set()  # storage numbers counted in `shared_out`
    numbers = itertools.count()

    def pack(t: torch.Tensor) -> torch.Tensor:
        i = where.current
        if i is not None and not save_ops and counted(t):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and seen.add(storage):
                out[i] += storage.nbytes()
                owner[key] = (i, next(numbers))
                if largest is not None:
                    largest[i] = max(largest[i], storage.nbytes())
                if sizes is not None:
                    sizes[i].append(storage.nbytes())
            elif storage.nbytes() and shared_in is not None and key in owner:
                # Counted already (the same live storage: `seen.add` said so), maybe by an
                # earlier module.
                j, number = owner[key]
                if j != i and (i, number) not in shared:
                    shared.add((i, number))
                    shared_in[i] += storage.nbytes()
                    if shared_out is not None and number not in passed:
                        passed.add(number)
                        shared_out[j] += storage.nbytes()
        # Never `t` itself: an op that saves its own output (tanh, gelu, sdpa) would then hold
        # that output through its own grad_fn, a cycle inside autograd's C++ that gc cannot
        # see, and this forward (never followed by backward) would keep everything it saved.
        return t.detach()

    made = _Created(where, set(kept_apart)) if left is not None else None
    turn = []
    if made is not None:
        def at_turn(module: nn.Module, given: Any, named: Any, output: Any) -> None:
            if turn:
                return
            passed = {t.untyped_storage().data_ptr() for t in tree_flatten((given, named, output))[0]
                      if isinstance(t, torch.Tensor)}
            turn.append(made.left(len(modules), seen, passed))
        turn_hook = modules[-1].register_forward_hook(at_turn, with_kwargs=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mode = _OpOutputs(set(save_ops), where, out, seen) if save_ops else made or contextlib.nullcontext()
            taking: list[Any] = []
            if passed_on is not None and isinstance(mode, _OpOutputs):
                taking = mode.count_passed_on(modules, passed_on)
            try:
                with mode:
                    result = model(*args, **kwargs)
            finally:
                for h in taking:
                    h.remove()
        del result
    finally:
        where.remove()
        if made is not None:
            turn_hook.remove()
    if left is not None and turn:
        left[:] = turn[0]
    return out
