"""Pure translators from a validated policy to each backend's names.

`TRANSLATORS` is the only place a backend maps to code. No torch or deepspeed import.
"""

from __future__ import annotations

from typing import Any, Callable

from actcfg.errors import ActcfgError
from actcfg.schema import Backend, Policy
from actcfg.translate.deepspeed import to_deepspeed
from actcfg.translate.ds_config import ImportResult, import_ds_config, merge_ds_config
from actcfg.translate.torch_native import CheckpointPlan, OffloadPlan, WrapPlan, to_torch_native

__all__ = [
    "TRANSLATORS",
    "CheckpointPlan",
    "ImportResult",
    "OffloadPlan",
    "WrapPlan",
    "import_ds_config",
    "merge_ds_config",
    "to_deepspeed",
    "to_torch_native",
    "translate",
]

TRANSLATORS: dict[Backend, Callable[[Policy], Any]] = {
    Backend.DEEPSPEED: to_deepspeed,
    Backend.TORCH: to_torch_native,
}


def translate(policy: Policy, backend: Backend | str | None = None) -> dict[str, Any]:
    """The backend's names for `policy` as JSON-able data; `backend` defaults to `policy.backend`."""
    if backend is None:
        chosen = policy.backend
    else:
        try:
            chosen = Backend(backend)
        except ValueError as e:
            choices = ", ".join(b.value for b in Backend)
            raise ActcfgError(f"unknown backend {backend!r}: choose one of {choices}") from e
    out = TRANSLATORS[chosen](policy)
    return out.to_json() if hasattr(out, "to_json") else out
