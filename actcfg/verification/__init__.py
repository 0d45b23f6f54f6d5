"""Prove that a policy did what it says: run a model plain and with the policy, and judge.

`report` holds the plain-data results, `judge` turns measurements into verdicts (no torch),
`render` prints them (text, JSON, a PNG), `factory` loads `--model pkg.module:factory`,
`measure` runs both models on the GPU (on each rank under torchrun, gathering the ranks'
measurements), and `models` holds the bundled probe models. Importing
this package imports no torch: `verify()` loads it on first use.
"""

from __future__ import annotations

from typing import Any

from actcfg.verification.factory import DEFAULT_MODEL, load_factory
from actcfg.verification.judge import FLAT_FRACTION, MIN_BLOCKS, PARTITION_SLACK, judge, judge_ranks
from actcfg.verification.report import (
    GRAD_TOLERANCE,
    GradDiff,
    Measurements,
    RunMeasurement,
    Verdict,
    VerifyReport,
    worst_grad,
)

__all__ = [
    "DEFAULT_MODEL",
    "FLAT_FRACTION",
    "GRAD_TOLERANCE",
    "MIN_BLOCKS",
    "PARTITION_SLACK",
    "GradDiff",
    "Measurements",
    "RunMeasurement",
    "Verdict",
    "VerifyReport",
    "judge",
    "judge_ranks",
    "load_factory",
    "require_cuda",
    "verify",
    "worst_grad",
]


def verify(model_factory: Any, cfg: Any, **kwargs: Any) -> VerifyReport:
    """Run the model plain and with the policy; judge each promise (see `measure.verify`)."""
    from actcfg.verification.measure import verify as run

    return run(model_factory, cfg, **kwargs)


def require_cuda() -> None:
    """Raise VerifyError unless torch is installed and sees a CUDA GPU."""
    from actcfg.verification.measure import require_cuda as check

    check()
