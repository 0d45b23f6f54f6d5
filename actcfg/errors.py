"""The one exception tree of actcfg. Imports nothing from actcfg."""

from __future__ import annotations

__all__ = [
    "ActcfgError",
    "ConfigLoadError",
    "OffloadError",
    "PlanError",
    "PolicyApplyError",
    "TranslationError",
    "VerifyError",
]


class ActcfgError(ValueError):
    """Base of every error actcfg raises on purpose."""


class ConfigLoadError(ActcfgError):
    """A policy file or document could not be read, parsed or validated.

    `diagnostics` holds every finding (file, line, column, code, message, hint),
    so callers can render all of them, not only the first.
    """

    def __init__(self, message: str, diagnostics: tuple = ()) -> None:
        super().__init__(message)
        self.diagnostics = tuple(diagnostics)


class TranslationError(ActcfgError):
    """A backend cannot express a field of the policy."""

    def __init__(self, field: str, backend: str, reason: str) -> None:
        super().__init__(f"{field}: the {backend} backend cannot express this: {reason}")
        self.field = field
        self.backend = backend


class PolicyApplyError(ActcfgError):
    """`apply` could not put the policy into effect on this model."""


class VerifyError(ActcfgError):
    """`verify` could not measure (bad factory, no GPU where one is needed)."""


class OffloadError(PolicyApplyError):
    """The offload engine cannot do what the policy asks (no CUDA, out of GPU memory on reload)."""


class PlanError(PolicyApplyError):
    """No plan fits `memory_budget` (`smallest_peak`: the smallest budget the solver accepts, in
    bytes: the lowest peak any plan reaches, plus its 0.01% headroom where only a mix of
    choices reaches it), or the model could not be profiled."""

    def __init__(self, message: str, smallest_peak: int | None = None) -> None:
        super().__init__(message)
        self.smallest_peak = smallest_peak


def install_command(extra: str) -> str:
    """How to install one of actcfg's extras, for the messages that need one. actcfg installs
    from its checkout (no package index has it), where installing `actcfg[extra]` by name finds
    nothing."""
    return f"python -m pip install -e '.[{extra}]' in the actcfg checkout"
