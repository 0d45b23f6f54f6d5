"""The handle `apply` returns: what was applied (frozen reports), what it did since (counters),
and the `UndoStack` that `remove()` runs.

It sits below every applier, the offload engine and the planner, so each of them names its type.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from actcfg.errors import PolicyApplyError
from actcfg.policy.schema import Backend, Policy, format_size
from actcfg.runtime.reports import (
    CheckpointCounters,
    CheckpointReport,
    CompileReport,
    DeepSpeedReport,
    OffloadReport,
    PlanReport,
    RuleReport,
)

if TYPE_CHECKING:
    from torch import nn

    from actcfg.runtime.offload import OffloadEngine

__all__ = ["LIVE", "AppliedPolicy", "UndoStack"]


class UndoStack:
    """The steps that take back what `apply` did, run last-first by `run()`."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        """Register the step that undoes the edit just made."""
        self._steps.append(step)

    def __len__(self) -> int:
        return len(self._steps)

    def run(self) -> list[Exception]:
        """Run every step, newest first; keep going past failures and return them."""
        errors: list[Exception] = []
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except Exception as e:  # keep undoing; the caller reports the first failure
                errors.append(e)
        return errors


class AppliedPolicy:
    """What `apply` did to a model; `remove()` undoes all of it. Usable as a context manager."""

    def __init__(self, model: nn.Module, policy: Policy, backend: Backend) -> None:
        self.model = model
        self.policy = policy
        self.backend = backend
        self.undo = UndoStack()
        """What `remove()` runs; appliers push onto it."""
        self.counters = CheckpointCounters()
        """Checkpointed calls and recomputes since apply (eager mode)."""
        self.checkpoint: CheckpointReport | None = None
        self.offload: OffloadReport | None = None
        self.deepspeed: DeepSpeedReport | None = None
        self.engine: Any = None
        """The `actcfg.runtime.offload.OffloadEngine`, when actcfg offloads (torch backend)."""
        self.rules: tuple[RuleReport, ...] | None = None
        """With `checkpoint.mode: rules` (or a plan): each rule and the modules it took."""
        self.rule_counters: tuple[CheckpointCounters, ...] = ()
        """With rules: each rule's own checkpoint counters (`counters` sums them)."""
        self.plan: PlanReport | None = None
        """With `checkpoint.mode: auto`: what was planned and predicted."""
        self.compiled: CompileReport | None = None
        """With `compile:`: what actcfg compiled, and how."""
        self.offload_group_names: dict[int, str] = {}
        """Offload group index -> the module that opened it, in the last step."""
        self._read_deepspeed: Callable[[], dict[str, Any]] | None = None
        self._removed = False

    # Appliers record what they did once; a second record is a bug, not a policy.
    def set_checkpoint(self, report: CheckpointReport) -> None:
        """Record the checkpointing applied."""
        assert self.checkpoint is None
        self.checkpoint = report

    def set_offload(self, report: OffloadReport) -> None:
        """Record the offload applied."""
        assert self.offload is None
        self.offload = report

    def set_rules(self, rules: tuple[RuleReport, ...]) -> None:
        """Record the rules applied, each with the modules it took."""
        assert self.rules is None
        self.rules = rules

    def set_compile(self, report: CompileReport) -> None:
        """Record what `compile:` compiled."""
        assert self.compiled is None
        self.compiled = report

    def set_plan(self, plan: PlanReport) -> None:
        """Record what `checkpoint.mode: auto` planned."""
        assert self.plan is None
        self.plan = plan

    @property
    def ruled(self) -> tuple[str, ...]:
        """Qualified names of the modules a rule took, in module order (empty without rules)."""
        if not self.rules:
            return ()
        names = {n for r in self.rules for n in r.modules}
        return tuple(n for n, _ in self.model.named_modules() if n in names)

    def offload_groups(self) -> list[dict[str, Any]]:
        """The last step's offload groups opened at a module: its name, the bytes it moved to
        the host and kept on the device, and of those moved, the bytes backward reloads first
        (`OffloadStats.group_first_reload_bytes`) (empty without actcfg's engine)."""
        if self.engine is None or not self.engine.stats.group_offloaded_bytes:
            return []
        st = self.engine.stats
        return [{"module": name, "offloaded_bytes": st.group_offloaded_bytes[i],
                 "kept_bytes": st.group_kept_bytes[i],
                 "first_reload_bytes": st.group_first_reload_bytes[i]}
                for i, name in sorted(self.offload_group_names.items())
                if i < len(st.group_offloaded_bytes)]

    def set_deepspeed(self, report: DeepSpeedReport,
                      read_back: Callable[[], dict[str, Any]]) -> None:
        """Record DeepSpeed's configuration as read back, and how to read it again."""
        assert self.deepspeed is None
        self.deepspeed = report
        self._read_deepspeed = read_back

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Qualified names of the checkpointed (or DeepSpeed-routed) modules, in module order."""
        return () if self.checkpoint is None else self.checkpoint.modules

    @property
    def checkpoint_api(self) -> str | None:
        """The function that checkpoints them."""
        return None if self.checkpoint is None else self.checkpoint.api

    def deepspeed_state(self) -> dict[str, Any] | None:
        """DeepSpeed's activation-checkpointing settings read back now, by configure() keyword
        (None for the torch backend): equal to `deepspeed.configure_kwargs` unless something
        called deepspeed.checkpointing.configure after apply."""
        return None if self._read_deepspeed is None else self._read_deepspeed()

    @property
    def removed(self) -> bool:
        """True once `remove()` has run."""
        return self._removed

    def report(self) -> dict[str, Any]:
        """Everything applied and what it did since, as JSON-able data: `effect` holds the
        checkpoint counters and the offload engine's counters of the last step."""
        out: dict[str, Any] = {
            "backend": str(self.backend),
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
            "offload": None if self.offload is None else self.offload.to_json(),
            "deepspeed": None if self.deepspeed is None else self.deepspeed.to_json(),
            "effect": {
                "checkpoint": self.counters.to_json() if self.checkpointed else None,
                "offload": None if self.engine is None else self.engine.stats.as_dict(),
            },
        }
        if self.rules is not None:
            out["rules"] = [r.to_json() for r in self.rules]
            out["effect"]["rules"] = [c.to_json() for c in self.rule_counters]
            if self.engine is not None:
                out["effect"]["offload_groups"] = self.offload_groups()
        if self.plan is not None:
            out["plan"] = self.plan.to_json()
        if self.compiled is not None:
            out["compile"] = self.compiled.to_json()
        return out

    def summary(self) -> str:
        """One line: what is checkpointed, offloaded and configured."""
        ck = self.checkpoint
        parts = [f"actcfg: backend {self.backend}"]
        if self.rules is not None:
            counts: dict[str, int] = {}
            for r in self.rules:
                kind = r.checkpoint + (" + offload" if r.offload else "")
                counts[kind] = counts.get(kind, 0) + len(r.modules)
            mix = ", ".join(f"{n} {k}" for k, n in counts.items())
            parts.append(f"per-module rules over {len(self.ruled)} modules ({mix})"
                         + (f" via {ck.api}" if ck is not None and ck.api else ""))
        elif ck is None:
            parts.append("no checkpointing")
        elif ck.api is None:
            parts.append("checkpointing by the model itself")
        else:
            every = f", every {ck.every}" if ck.every and ck.every > 1 else ""
            parts.append(f"{ck.mode} checkpointing of {len(ck.modules)} modules "
                         f"({_short_list(ck.modules)}{every}) via {ck.api}")
        if self.offload is not None:
            budget = self.offload.pin_budget
            node = self.offload.pin_budget_per_node
            mem = ("pinned" + (f" up to {format_size(budget)}" if budget is not None else "")
                   + (f" ({format_size(node)} per node)" if node is not None else "")
                   if self.offload.pin else "pageable")
            parts.append(f"cpu offload of {self.offload.scope} into {mem} host memory, "
                         f"{len(self.offload.groups)} groups ({self.offload.grouping})")
        elif self.deepspeed is not None and self.policy.cpu_checkpointing:
            parts.append("DeepSpeed cpu_checkpointing")
        if self.deepspeed is not None:
            on = [k for k, v in self.deepspeed.configure_kwargs.items() if v not in (False, None)]
            parts.append("deepspeed.checkpointing.configure(" + (", ".join(on) or "defaults") + ")")
        if self.compiled is not None:
            what = ("the model" if self.compiled.scope == "model"
                    else f"{len(self.compiled.modules)} modules")
            parts.append(f"torch.compile of {what} (backend {self.compiled.backend})")
        return "; ".join(parts)

    def remove(self) -> None:
        """Undo everything `apply` did: forward overrides, hooks, offload engine, DeepSpeed state."""
        if self._removed:
            return
        self._removed = True
        LIVE.discard(self)
        errors = self.undo.run()
        if errors:
            raise PolicyApplyError(f"remove() could not undo everything: {errors[0]}") from errors[0]

    def __enter__(self) -> AppliedPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "live"
        return f"<AppliedPolicy {state}: {self.summary()}>"


def _short_list(names: tuple[str, ...], limit: int = 3) -> str:
    shown = ", ".join(n or "<root>" for n in names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


LIVE: weakref.WeakSet[AppliedPolicy] = weakref.WeakSet()
"""Handles applied and not yet removed: `strip_policy` leaves their models to their own
`remove()`."""
