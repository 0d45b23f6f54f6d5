"""actcfg: declarative, checked and proven activation-memory policies for PyTorch training.

`import actcfg` never imports torch or deepspeed: `apply` and `verify` load the runtime
on first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from actcfg._version import __version__
from actcfg.errors import (
    ActcfgError,
    ConfigLoadError,
    OffloadError,
    PolicyApplyError,
    TranslationError,
    VerifyError,
)
from actcfg.policy.schema import Backend, Policy

if TYPE_CHECKING:
    from actcfg.runtime.handle import AppliedPolicy

__all__ = [
    "ActcfgError",
    "AppliedPolicy",
    "Backend",
    "ConfigLoadError",
    "OffloadError",
    "Policy",
    "PolicyApplyError",
    "TranslationError",
    "VerifyError",
    "__version__",
    "apply",
    "load",
    "strip_policy",
    "translate",
    "verify",
]


def load(source: Any, *, at: str | None = None, backends: Iterable[Backend | str] = ()) -> Policy:
    """A validated `Policy` from a path, a YAML string, a dict or a `Policy`; `backends` adds
    the rules of those backends, as `actcfg validate --backend` does."""
    from actcfg.policy.checker import load as _load

    return _load(source, at=at, backends=backends)


def translate(policy: Policy, backend: Backend | str | None = None) -> dict[str, Any]:
    """The backend's names for `policy`, as JSON-able data (see `actcfg translate`)."""
    from actcfg.translators import translate as _translate

    return _translate(policy, backend)


def apply(model: Any, cfg: Any, *, backend: Backend | str | None = None, mpu: Any = None,
          inputs: Any = None, loss_fn: Any = None) -> AppliedPolicy:
    """Put the policy into effect on `model` (needs torch); returns a removable handle. With
    `checkpoint.mode: auto`, `inputs=` (an example batch) lets it plan first."""
    from actcfg.api import apply as _apply

    return _apply(model, cfg, backend=backend, mpu=mpu, inputs=inputs, loss_fn=loss_fn)


def strip_policy(model: Any) -> int:
    """Take actcfg's edits off a `copy.deepcopy` of an applied model (which has no handle of
    its own); returns how many were taken off (needs torch)."""
    from actcfg.runtime.applying import strip_policy as _strip_policy

    return _strip_policy(model)


def verify(model_factory: Any, cfg: Any, **kwargs: Any) -> Any:
    """Run the model plain and with the policy; report whether each promise held (needs torch)."""
    from actcfg.verification import verify as _verify

    return _verify(model_factory, cfg, **kwargs)


def __getattr__(name: str) -> Any:
    # AppliedPolicy lives with the runtime, which needs torch: import it only when asked for.
    if name == "AppliedPolicy":
        from actcfg.runtime.handle import AppliedPolicy

        return AppliedPolicy
    raise AttributeError(f"module 'actcfg' has no attribute {name!r}")
