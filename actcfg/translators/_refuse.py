"""What every translator does first: refuse a policy its backend cannot express, from the table."""

from __future__ import annotations

from actcfg.backends import Backend
from actcfg.backends.table import Finding, field_value, findings
from actcfg.errors import TranslationError
from actcfg.policy.schema import Policy

__all__ = ["refuse_inexpressible"]


def refuse_inexpressible(policy: Policy, backend: Backend) -> list[Finding]:
    """The backend's warnings for `policy`; TranslationError for the first field (in table
    order) that the backend cannot express."""
    spec = backend.spec
    out = findings(spec.table, policy, backend.value, spec.checkpoint_function)
    for finding in out:
        if finding.severity == "error":
            path = ".".join(finding.path)
            value = field_value(policy, path)[0]
            raise TranslationError(path, backend.value,
                                   f"{finding.reason} (got {value!r}); {finding.hint}")
    return out
