"""What both appliers do to a model's modules: select them, override their forward, call them
through a checkpoint function with every tensor argument visible, and prepare Hugging Face models.

Module selection recognises modules by what they are (every class of their MRO, so FSDP2's
`FSDPBlock` is a `Block`), and names them as the user wrote them. A forward override is a small
callable in the instance's `__dict__`: module, parameter and state_dict names stay unchanged,
`copy.deepcopy` rebinds it to the copy, torch.compile traces through it, and pickling an
applied model stops with a sentence instead of saving actcfg's machinery with the weights.

A deep copy of an applied model carries the policy, as a copy of a model wrapped by torch's
checkpoint_wrapper or with Hugging Face checkpointing on stays checkpointed: a copy that trains
keeps the memory it was promised. The copy has no handle of its own (the original's `remove()`
takes back the original's edits only), so `strip_overrides` (`actcfg.strip_policy`)
takes actcfg's edits off a copy.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from actcfg.errors import ActcfgError, PolicyApplyError

__all__ = [
    "APPLIED",
    "NotPicklable",
    "Undo",
    "WRAPPED",
    "call_inner",
    "call_with_flat_tensors",
    "class_name",
    "drop_cache_for_recompute",
    "label",
    "pattern_matches",
    "override_forward",
    "prepare_hf_model",
    "refuse_stacked_checkpointing",
    "select_by_rules",
    "select_modules",
    "strip_overrides",
]

log = logging.getLogger("actcfg")

# Set in a module's __dict__ by apply (APPLIED, on the root) and by each override (WRAPPED);
# copy.deepcopy carries them, so a copy of an applied model is recognised too.
APPLIED = "_actcfg_applied"
WRAPPED = "_actcfg_wrapped"


class Undo(Protocol):
    """Where an edit registers the step that takes it back (`AppliedPolicy.undo`)."""

    def push(self, step: Callable[[], None]) -> None: ...


class NotPicklable:
    """Refuses pickling with a sentence; `copy.deepcopy` still copies (see each subclass).
    What actcfg puts on a module (overrides, markers, the offload scope whose methods are
    hooks) is one of these, which is how `strip_overrides` recognises it."""

    def __reduce__(self) -> Any:
        raise ActcfgError(
            "this model carries an actcfg policy, which cannot be pickled with it (torch.save of "
            "the whole model): save model.state_dict() instead (names are unchanged under "
            "actcfg), or call remove() on the handle actcfg.apply returned first (on a "
            "copy.deepcopy of an applied model, actcfg.strip_policy(copy))"
        )


class Marker(NotPicklable):
    """What `APPLIED`/`WRAPPED` hold: a description, shared (not copied) by deepcopy."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __deepcopy__(self, memo: dict[int, Any]) -> Marker:
        return self

    def __str__(self) -> str:
        return self.text


# --- selection -----------------------------------------------------------------------------

# Classes no pattern should match: every module is one, or they are a wrapper's own classes.
_GENERIC = (nn.Module, object)


def _own_classes(module: nn.Module) -> list[type]:
    """The module's classes a pattern may name: its MRO without nn.Module/object and without the
    wrapper classes torch.distributed adds (FSDP2's `FSDPModule` and `FSDP<Name>`)."""
    return [c for c in type(module).__mro__
            if c not in _GENERIC and not c.__module__.startswith("torch.distributed")]


def class_name(module: nn.Module) -> str:
    """The class name the user knows: `Block` for FSDP2's `FSDPBlock`."""
    own = _own_classes(module)
    return own[0].__name__ if own else type(module).__name__


def label(name: str, module: nn.Module) -> str:
    """`blocks.0` (Block), or `the model (BlockStack)` for the root."""
    return f"`{name}` ({class_name(module)})" if name else f"the model ({class_name(module)})"


def pattern_matches(pattern: str, name: str, module: nn.Module) -> bool:
    """fnmatch on each class name of the module's MRO (a subclass of `Block` is a `Block`); on
    the qualified name segment by segment, so that `*` never crosses a dot (`layers.*` is
    `layers.0`, not `layers.0.mlp.fc1`)."""
    if any(fnmatch.fnmatchcase(c.__name__, pattern) for c in _own_classes(module)):
        return True
    if not name:
        return False
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def select_modules(model: nn.Module, patterns: tuple[str, ...], every: int) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs `checkpoint.modules`/`every` select, in module order.

    PolicyApplyError for a pattern that matches nothing, a module matched together with one of
    its descendants (nested checkpointing), a container with no forward of its own, a TorchScript
    module, and a module inside torch's checkpoint_wrapper (it would recompute twice).
    """
    named = list(model.named_modules())
    _refuse_unmatched(model, named, patterns, "checkpoint.modules")
    matched = [(n, m) for n, m in named if any(pattern_matches(p, n, m) for p in patterns)]
    _refuse_nested(matched, "checkpoint.modules",
                   "nested checkpointing recomputes the inner module twice; narrow the patterns "
                   "so that only one of them matches")
    _refuse_unwrappable(named, matched, "checkpoint.modules")
    chosen = [nm for i, nm in enumerate(matched) if (i + 1) % every == 0]
    if not chosen:
        raise PolicyApplyError(
            f"checkpoint.every: {every}, but only {len(matched)} module(s) match "
            f"{', '.join(repr(p) for p in patterns)}: every n-th match is checkpointed, so none "
            f"would be; set `every` to at most {len(matched)}"
        )
    return chosen


def select_by_rules(model: nn.Module, rules: Sequence[tuple[str, ...]]) -> list[tuple[str, nn.Module, int]]:
    """(name, module, rule index) for every module a rule takes, in module order: each module
    takes the first rule whose patterns match it (`checkpoint.rules`).

    PolicyApplyError as `select_modules` gives, for every rule's patterns, and for a rule whose
    every match an earlier rule took (it would apply to nothing). Two modules taken where one
    contains the other are refused whatever their rules: an outer group would swallow the
    inner one's choice (and nested checkpointing recomputes the inner module twice).
    """
    named = list(model.named_modules())
    for i, patterns in enumerate(rules):
        _refuse_unmatched(model, named, patterns, f"checkpoint.rules.{i}.modules")
    taken: list[tuple[str, nn.Module, int]] = []
    for n, m in named:
        rule = next((i for i, patterns in enumerate(rules) if any(pattern_matches(p, n, m) for p in patterns)), None)
        if rule is not None:
            taken.append((n, m, rule))
    used = {i for _, _, i in taken}
    for i, patterns in enumerate(rules):
        if i not in used:
            earlier = sorted({j for n, m, j in taken if any(pattern_matches(p, n, m) for p in patterns)})
            raise PolicyApplyError(
                f"checkpoint.rules.{i}: every module its patterns match was taken by an earlier "
                f"rule ({', '.join(f'checkpoint.rules.{j}' for j in earlier)}; the first match "
                f"wins), so it "
                "applies to none; remove it, or narrow the earlier rule")
    pairs = [(n, m) for n, m, _ in taken]
    _refuse_nested(pairs, "checkpoint.rules",
                   "each module takes one rule, and a module's rule covers what its submodules "
                   "save; narrow the patterns so that only one of them is matched")
    _refuse_unwrappable(named, pairs, "checkpoint.rules")
    return taken


def _refuse_unmatched(model: nn.Module, named: list[tuple[str, nn.Module]], patterns: tuple[str, ...],
                      where: str) -> None:
    for pattern in patterns:
        if not any(pattern_matches(pattern, n, m) for n, m in named):
            classes = sorted({class_name(m) for _, m in named})
            names = [n for n, _ in named if n][:6]
            raise PolicyApplyError(
                f"{where}: pattern {pattern!r} matches no module of "
                f"{class_name(model)}; class names here: {', '.join(classes[:8])}"
                f"{', ...' if len(classes) > 8 else ''}; qualified names: {', '.join(names)}"
                f"{', ...' if len(named) - 1 > 6 else ''}"
            )


def _refuse_nested(matched: list[tuple[str, nn.Module]], where: str, why: str) -> None:
    for i, (outer, om) in enumerate(matched):
        for inner, im in matched[i + 1:]:
            if not outer or inner.startswith(outer + "."):
                raise PolicyApplyError(
                    f"{where}: {label(outer, om)} and its submodule {label(inner, im)} "
                    f"are both matched: {why}"
                )


def _refuse_unwrappable(named: list[tuple[str, nn.Module]], matched: list[tuple[str, nn.Module]],
                        where: str) -> None:
    wrappers = [n for n, m in named if type(m).__name__ == "CheckpointWrapper"]
    for n, m in matched:
        if isinstance(m, torch.jit.ScriptModule):
            raise PolicyApplyError(
                f"{where}: {label(n, m)} is a TorchScript module, whose forward actcfg "
                "cannot wrap; apply the policy before torch.jit.script, or narrow the patterns "
                "so that they match eager modules only"
            )
        if type(m).forward is nn.Module.forward:
            raise PolicyApplyError(
                f"{where}: {label(n, m)} has no forward of its own (a container); "
                f"checkpoint its children instead, such as `{n + '.*' if n else '*'}`"
            )
        inside = next((w for w in wrappers if n == w or n.startswith(w + ".")), None)
        if inside is not None:
            raise PolicyApplyError(
                f"{where}: {label(n, m)} is inside torch's checkpoint_wrapper "
                f"(`{inside or 'the model'}`), which already checkpoints it: actcfg would "
                "recompute it twice; remove the checkpoint_wrapper, or do not checkpoint it here"
            )


# --- forward overrides ---------------------------------------------------------------------------


class _BoundForward(NotPicklable):
    """`impl(module, previous, *args, **kwargs)` as the instance's forward, where `previous` is
    the instance forward it replaced (None: the class's; `call_inner` runs either).

    Holds its module; `copy.deepcopy` of the model maps that to the copy, so the copy computes
    with its own weights. `impl` holds only settings and counters, shared by copies.
    """

    def __init__(self, impl: Callable[..., Any], module: nn.Module, previous: Any) -> None:
        self.impl = impl
        self.module = module
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(self.module, self.previous, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _BoundForward:
        return _BoundForward(self.impl, copy.deepcopy(self.module, memo),
                             copy.deepcopy(self.previous, memo))


def call_inner(module: nn.Module, previous: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the forward an override replaced: `previous`, else the class's forward.

    The class's forward is called as a plain function, never bound and passed around: traced by
    torch.compile, a bound `module.forward` would be rebuilt as the instance attribute, which is
    the override itself.
    """
    if previous is not None:
        return previous(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def override_forward(undo: Undo, module: nn.Module, impl: Callable[..., Any], what: str) -> None:
    """Make `impl(module, previous, *args, **kwargs)` the instance's forward, undoably;
    overrides stack (the root can be checkpointed and scope the offload)."""
    d = module.__dict__
    previous, previous_marker = d.get("forward"), d.get(WRAPPED)
    d[WRAPPED] = Marker(what if previous_marker is None else f"{previous_marker}; {what}")
    d["forward"] = _BoundForward(impl, module, previous)

    def undo_it() -> None:
        for key, value in (("forward", previous), (WRAPPED, previous_marker)):
            if value is None:
                d.pop(key, None)
            else:
                d[key] = value

    undo.push(undo_it)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
# Where torch keeps a hook's options, by the hook's id (absent in older torch: skipped).
_HOOK_OPTIONS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called")


def _actcfg_hook(hook: Any) -> bool:
    """True for a hook actcfg registered: a method (or a partial of one) of a NotPicklable."""
    fn = getattr(hook, "func", hook)  # functools.partial
    return isinstance(getattr(fn, "__self__", None), NotPicklable)


def strip_overrides(model: nn.Module) -> int:
    """Take every actcfg edit off `model` and its submodules: forward overrides (each back to
    the forward it replaced), actcfg's forward hooks, and the markers. Returns how many edits it
    took off. For a deep copy of an applied model, which has no handle of its own; the caller
    refuses a model whose policy a live handle still holds (its `remove()` is the way there)."""
    removed = 0
    for module in model.modules():
        d = module.__dict__
        while isinstance(d.get("forward"), _BoundForward):
            previous = d["forward"].previous
            if previous is None:
                del d["forward"]
            else:
                d["forward"] = previous
            removed += 1
        for key in (WRAPPED, APPLIED):
            if isinstance(d.get(key), Marker):
                del d[key]
                removed += 1
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if not hooks:
                continue
            for hook_id in [i for i, hook in hooks.items() if _actcfg_hook(hook)]:
                del hooks[hook_id]
                removed += 1
                for option in _HOOK_OPTIONS:
                    getattr(module, option, {}).pop(hook_id, None)
    return removed


def call_with_flat_tensors(
    checkpoint_fn: Callable[..., Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    needs_grad_input: bool,
    flat_outputs: bool,
    owner: nn.Module | None = None,
    **options: Any,
) -> Any:
    """`checkpoint_fn(run, *tensors, **options)`, where `tensors` are every tensor in `args` and
    `kwargs` (inside lists, tuples and dicts too) and `run` rebuilds the call.

    A checkpoint function sees, saves and routes gradients through its positional tensors only:
    a tensor inside a container or passed by keyword would get no gradient from a reentrant or
    DeepSpeed checkpoint (silently wrong), and would stay on the GPU past actcfg's offload
    hooks. `needs_grad_input`: when no input requires grad, the first floating input is passed
    as an alias that does (no copy), or, for integer-only inputs such as token ids, a one-element
    tensor that does is added: reentrant and DeepSpeed checkpoints compute parameter gradients
    only for calls with such an input. `flat_outputs` returns the outputs
    as a flat tuple of tensors to the checkpoint function and rebuilds their structure after
    (reentrant and DeepSpeed checkpoints drop gradients of tensors inside a dict output);
    non-tensor leaves (None, numbers, strings) come back as they were, and a tensor that
    `owner` (the checkpointed module) holds goes around the checkpoint function unchanged.
    """
    tensors, rebuild = _split_tensors(args, kwargs)
    dummy = 0
    if needs_grad_input and torch.is_grad_enabled() and not any(t.requires_grad for t in tensors):
        floating = next((i for i, t in enumerate(tensors) if t.is_floating_point()), None)
        if floating is not None:  # an alias that requires grad: no copy, its gradient unused
            tensors[floating] = tensors[floating].detach().requires_grad_()
        else:  # integer-only inputs (token ids): a one-element tensor carries the gradient
            device = tensors[0].device if tensors else None
            tensors.append(torch.ones(1, device=device, requires_grad=True))
            dummy = 1
    out_spec: list[Any] = []
    around: list[set[int]] = []  # output slots that go around the Function, fixed by the forward

    def run(*given: torch.Tensor) -> Any:
        a, k = rebuild(given[: len(given) - dummy] if dummy else given)
        out = fn(*a, **k)
        if not flat_outputs:
            return out
        out_leaves, o_spec = tree_flatten(out)
        slots = [i for i, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
        if not around:  # the forward: which tensors pass through the Function is fixed here
            passed = set(map(id, given))
            own = _tensors_held_by(owner) if not torch.is_grad_enabled() else set()
            # A tensor the module holds (an attribute returned beside the result) is not computed
            # from the inputs: as an autograd Function's output, autograd would give the
            # module's own tensor a grad_fn in place and backward would re-enter itself forever.
            # It goes around the Function, as the same object plain returns.
            around.append({i for i in slots if id(out_leaves[i]) in own and id(out_leaves[i]) not in passed})
            out_spec[:] = [o_spec, [_TENSOR if i in slots and i not in around[0] else v
                                    for i, v in enumerate(out_leaves)]]
        through = [out_leaves[i] for i in slots if i not in around[0]]
        if not torch.is_grad_enabled():
            # The no-grad forward: a fresh tensor object per output, so that autograd marks that
            # one and never a tensor someone else holds (no copy: the storage is shared).
            passed = set(map(id, given))
            through = [t if id(t) in passed else t.detach() for t in through]
        return tuple(through)

    result = checkpoint_fn(run, *tensors, **options)
    if not flat_outputs:
        return result
    o_spec, o_template = out_spec
    flat = list(result) if isinstance(result, (tuple, list)) else [result]
    slots = [i for i, v in enumerate(o_template) if v is _TENSOR]
    if len(flat) != len(slots):
        raise ActcfgError(
            f"the checkpoint function returned {len(flat)} tensor(s) for a module output with "
            f"{len(slots)} tensor slot(s); please report this with the module's output structure")
    filled_out = list(o_template)
    for i, t in zip(slots, flat):
        filled_out[i] = t
    out_spec.clear()  # the module's own tensors are not held past the call
    return tree_unflatten(filled_out, o_spec)


# Argument values that are leaves for pytree whatever is registered: a call made only of these
# (a block's hidden states, mask, position ids and flags) is split without pytree.
_ATOMS = frozenset({type(None), bool, int, float, str})

_Rebuild = Callable[[Sequence[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]]
"""Given the split-out tensors (or their stand-ins), the call's (args, kwargs) with them in place."""


def _split_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], _Rebuild]:
    """Every tensor in `args` and `kwargs` (inside containers too), and `rebuild(tensors)`, which
    gives the call back with those tensors in their places.

    Only non-tensor values stay in `rebuild`'s closure: a tensor held there would outlive the
    offload. A call whose values are all tensors or atoms is split by position and name, without
    pytree: pytree's flatten and two unflattens (the forward's and the recompute's) cost about
    40 us of Python per checkpointed call, more than the rest of actcfg's wrapper, on every block
    of every step (`tests/runtime/test_checkpoint_overhead.py` pins the count).
    """
    tensors: list[torch.Tensor] = []
    arg_at: list[int] = []
    arg_template: list[Any] = []
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor):
            arg_at.append(i)
            tensors.append(v)
            arg_template.append(None)
        elif type(v) in _ATOMS:
            arg_template.append(v)
        else:
            return _split_by_pytree(args, kwargs)
    key_at: list[str] = []
    key_template: dict[str, Any] = {}
    for key, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            key_at.append(key)
            tensors.append(v)
            key_template[key] = None
        elif type(v) in _ATOMS:
            key_template[key] = v
        else:
            return _split_by_pytree(args, kwargs)
    n = len(arg_at)

    def rebuild(given: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        a = list(arg_template)
        for i, t in zip(arg_at, given):
            a[i] = t
        k = dict(key_template)
        for key, t in zip(key_at, given[n:]):
            k[key] = t
        return tuple(a), k

    return tensors, rebuild


def _split_by_pytree(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], _Rebuild]:
    """`_split_tensors` for a call with containers (lists, tuples, dicts, registered nodes)."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    template = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]

    def rebuild(given: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        filled = list(template)
        for i, t in zip(at, given):
            filled[i] = t
        return tree_unflatten(filled, spec)

    return [leaves[i] for i in at], rebuild


class _TensorSlot:
    """Marks where a tensor goes in a flattened structure: `None` is a real leaf for pytree
    (`(tensor, None)`, as T5Block returns), so it cannot be the mark."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def _tensors_held_by(module: nn.Module | None) -> set[int]:
    """ids of every tensor `module` and its submodules hold: parameters, buffers, and plain
    attributes (inside lists, tuples and dicts too)."""
    if module is None:
        return set()
    held: set[int] = set()
    for m in module.modules():
        held.update(id(t) for t in m._parameters.values() if t is not None)
        held.update(id(t) for t in m._buffers.values() if t is not None)
        for key, value in m.__dict__.items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, (torch.Tensor, list, tuple, dict)):
                held.update(id(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return held


# --- model-level guards --------------------------------------------------------------------------


def _hf_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def refuse_stacked_checkpointing(model: nn.Module) -> None:
    """PolicyApplyError when the model already checkpoints layers itself (Hugging Face's
    activation checkpointing is on): actcfg's checkpointing would recompute them twice."""
    for name, module in model.named_modules():
        if _hf_layer(module) and getattr(module, "gradient_checkpointing", False):
            raise PolicyApplyError(
                f"{label(name, module)} already has Hugging Face activation checkpointing on "
                "(gradient_checkpointing=True), and the policy checkpoints too: every layer would "
                "be recomputed twice. Turn Hugging Face's off (model.activation_checkpointing_disable(), "
                "or TrainingArguments(activation_checkpointing=False, gradient_checkpointing=False)), "
                "or write `checkpoint: {mode: external}` to keep Hugging Face's and let actcfg "
                "offload around it"
            )


def prepare_hf_model(model: nn.Module, undo: Undo) -> None:
    """Turn `use_cache` off on Hugging Face models, as transformers does when it checkpoints: a
    KV cache built in a training forward keeps two block inputs per layer on the GPU, and a
    recompute would update it a second time. The config's default goes off (one log line;
    remove() turns it back on), and a forward called with `use_cache=True` while training gets
    it forced off with one warning, as transformers' `merge_with_config_defaults` does."""
    seen: set[int] = set()
    for module in model.modules():
        if not _is_hf_pretrained(module):
            continue
        index = _use_cache_index(module)
        if index is not None:
            hook = _UseCacheOff(class_name(module), index)
            undo.push(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        undo.push(lambda config=config: setattr(config, "use_cache", True))
        log.info("actcfg: turned off use_cache on %s's config, as transformers does when it "
                 "checkpoints (a KV cache built in training keeps two block inputs per layer)",
                 class_name(module))


def _is_hf_pretrained(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _use_cache_index(module: nn.Module) -> int | None:
    """Where `use_cache` sits among the forward's positional parameters (after self), -1 when
    it is keyword-only or taken through **kwargs, None when the forward has none."""
    import inspect

    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return -1
    for i, p in enumerate(parameters):
        if p.name == "use_cache":
            return i if p.kind is p.POSITIONAL_OR_KEYWORD else -1
    return -1 if any(p.kind is p.VAR_KEYWORD for p in parameters) else None


class _UseCacheOff(NotPicklable):
    """A forward pre-hook: `use_cache=True` passed to a Hugging Face model in a training forward
    becomes False, with one warning per model. Under checkpointing the recompute would update
    the cache a second time (14 tokens for 7 inputs), and with reentrant checkpointing the
    gradients came out wrong; transformers forces it off itself when it checkpoints."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _UseCacheOff:
        return self  # settings only; a copy of the model warns through the same flag

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None  # generation and evaluation keep their cache
        if kwargs.get("use_cache") is True:
            kwargs = {**kwargs, "use_cache": False}
        elif 0 <= self.index < len(args) and args[self.index] is True:
            args = (*args[: self.index], False, *args[self.index + 1:])
        else:
            return None
        if not self.warned:
            self.warned = True
            log.warning("actcfg: %s was called with use_cache=True while training under an actcfg "
                        "policy; setting use_cache=False, as transformers does when it checkpoints "
                        "(the recompute would update the KV cache a second time)", self.name)
        return args, kwargs


_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")
"""The names a Hugging Face layer takes its KV cache under (they differ between models)."""


def drop_cache_for_recompute(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs for a checkpointed Hugging Face module in a training forward, without its KV
    cache: a cache the layer writes would be written again by the recompute in backward, as
    transformers' `GradientCheckpointingLayer` says when it drops it. Layers that only read it
    (`_can_checkpoint_with_cache`) keep it. One warning per class."""
    if not kwargs or not type(module).__module__.startswith("transformers."):
        return kwargs
    changed = []
    out = dict(kwargs)
    if out.get("use_cache") is True:
        out["use_cache"] = False
        changed.append("use_cache=False")
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for key in _CACHE_KWARGS:
            if out.get(key) is not None:
                out[key] = None
                changed.append(f"{key}=None")
    if not changed:
        return kwargs
    name = class_name(module)
    if name not in _WARNED_CACHE:
        _WARNED_CACHE.add(name)
        log.warning("actcfg: a KV cache is incompatible with recomputing %s (the recompute would "
                    "update it again): setting %s, as transformers does when it checkpoints",
                    name, ", ".join(changed))
    return out


_WARNED_CACHE: set[str] = set()
