"""The seam between the planner and the runtime: how the profile applies each uniform policy it
measures. The runtime sits above the planner (`plan <- runtime`), so it passes its applier in
(`actcfg.api` passes `apply_policy` on torch) and the planner names only what it calls here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from actcfg.policy.schema import Policy

__all__ = ["Apply", "Trial"]


class Trial(Protocol):
    """A policy applied for one profiling run (the runtime's `AppliedPolicy`)."""

    @property
    def engine(self) -> Any:
        """The offload engine, or None when nothing offloads."""

    def offload_groups(self) -> list[dict[str, Any]]:
        """Per offload group: its `module` and the `offloaded_bytes` it copied to the host."""

    def remove(self) -> None:
        """Undo the policy: the model as it was before."""


class Apply(Protocol):
    """Applies a concrete policy (never `checkpoint.mode: auto`) to a model and returns it as
    applied (`actcfg.apply` qualifies)."""

    def __call__(self, model: Any, policy: Policy, /) -> Trial: ...
