"""Pure translators from a validated policy to each backend's names.

`TRANSLATORS` is the only place a backend maps to a translator. No torch or deepspeed import.
"""

from __future__ import annotations

from typing import Any, Callable

from actcfg.backends import Backend
from actcfg.policy.schema import Policy
from actcfg.translators.deepspeed import to_deepspeed
from actcfg.translators.ds_config import ImportResult, import_ds_config, merge_ds_config
from actcfg.translators.hf import to_hf
from actcfg.translators.lightning import to_lightning
from actcfg.translators.torch_native import (
    CheckpointPlan,
    ExternalCheckpointPlan,
    OffloadPlan,
    PlanRequest,
    RulePlan,
    RulesPlan,
    WrapPlan,
    to_torch_native,
)

__all__ = [
    "TRANSLATORS",
    "CheckpointPlan",
    "ExternalCheckpointPlan",
    "ImportResult",
    "OffloadPlan",
    "PlanRequest",
    "RulePlan",
    "RulesPlan",
    "WrapPlan",
    "import_ds_config",
    "merge_ds_config",
    "to_deepspeed",
    "to_hf",
    "to_lightning",
    "to_torch_native",
    "translate",
]

TRANSLATORS: dict[Backend, Callable[[Policy], Any]] = {
    Backend.DEEPSPEED: to_deepspeed,
    Backend.HF: to_hf,
    Backend.LIGHTNING: to_lightning,
    Backend.TORCH: to_torch_native,
}


def translate(policy: Policy, backend: Backend | str | None = None) -> dict[str, Any]:
    """The backend's names for `policy` as JSON-able data; `backend` defaults to `policy.backend`."""
    chosen = policy.backend if backend is None else Backend.parse(backend)
    out = TRANSLATORS[chosen](policy)
    return out.to_json() if hasattr(out, "to_json") else out
