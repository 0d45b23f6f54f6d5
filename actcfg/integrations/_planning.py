"""`checkpoint.mode: auto` inside a trainer: the plan file a run writes where it writes its
outputs, the plan file a later run reuses (checked against the model it is applied to), and
what a trainer's setup rules out of planning in the run itself.

Imports neither torch nor a trainer library at module level.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from actcfg.policy.checker import load
from actcfg.errors import ActcfgError, PolicyApplyError
from actcfg.policy.schema import Policy, format_size

__all__ = [
    "PLAN_FILE_NAME",
    "check_plan_fits_model",
    "load_plan_file",
    "write_plan",
]

PLAN_FILE_NAME = "actcfg-plan.yaml"
"""The plan's file name in the run's output folder (HF `output_dir`, Lightning `log_dir`)."""


def load_plan_file(policy: Policy,
                   plan_file: str | os.PathLike[str] | None) -> tuple[Path | None, Policy | None]:
    """A callback's `plan_file=` for `policy`: (None, None) without one, else its path and the
    file as a validated `checkpoint.mode: rules` policy. PolicyApplyError for a plan file beside
    a policy that plans nothing and for a file that is not a plan; ConfigLoadError for a file
    that does not load."""
    if plan_file is None:
        return None, None
    if policy.checkpoint.mode != "auto":
        raise PolicyApplyError(
            f"plan_file= reuses a plan of `checkpoint.mode: auto`, and this policy's mode is "
            f"{policy.checkpoint.mode}: remove plan_file=, or pass the `mode: auto` policy the "
            "plan was written for")
    path = Path(plan_file)
    if not path.is_file():
        raise PolicyApplyError(
            f"plan_file={str(path)!r} does not exist: pass the {PLAN_FILE_NAME} an earlier run "
            "wrote, or leave plan_file= out to plan on the first batch")
    plan = load(path)
    if plan.checkpoint.mode != "rules":
        raise PolicyApplyError(
            f"{path}: plan_file= takes a plan (`checkpoint.mode: rules`, as actcfg writes it), "
            f"and this file's checkpoint.mode is {plan.checkpoint.mode}: pass the "
            f"{PLAN_FILE_NAME} a run wrote, or `actcfg plan`'s output")
    return path, plan


def check_plan_fits_model(model: Any, policy: Policy, plan: Policy, path: Path) -> None:
    """PolicyApplyError when the plan at `path` was made for another model (its modules are not
    this model's candidates, `policy.checkpoint.modules`) or for a larger budget."""
    from actcfg.runtime.wrap import pattern_matches, select_modules

    try:
        candidates = [n for n, _ in select_modules(model, tuple(policy.checkpoint.modules), 1)]
    except ActcfgError as e:
        raise PolicyApplyError(f"checkpoint.modules of the `mode: auto` policy: {e}") from e
    patterns = [p for rule in plan.checkpoint.rules for p in rule.modules]
    # A plan names a candidate itself, or its parts where it split it (`checkpoint.submodules`).
    hits = {p: [n for n, m in model.named_modules() if pattern_matches(p, n, m)] for p in patterns}

    def within(name: str, candidate: str) -> bool:
        return name == candidate or name.startswith(candidate + ".")

    missing = [c for c in candidates if not any(within(n, c) for p in patterns for n in hits[p])]
    foreign = [p for p in patterns if not any(within(n, c) for n in hits[p] for c in candidates)]
    if missing or foreign:
        said = []
        if missing:
            said.append(f"candidates {_names(missing)} of this model are not in it")
        if foreign:
            said.append(f"it names {_names(foreign)}, which this model's candidates "
                        f"({_names(policy.checkpoint.modules)}) do not include")
        raise PolicyApplyError(
            f"{path} was planned for another model: {'; '.join(said)}; delete plan_file= to "
            "plan this model on its first batch, or pass the plan written for it")
    predicted = plan.checkpoint.predicted
    # The written peak is rounded up to the MiB: within one MiB of the budget, it is this budget's.
    if (predicted is not None and policy.memory_budget is not None
            and predicted.peak - policy.memory_budget >= 2**20):
        raise PolicyApplyError(
            f"{path} predicts a peak of {format_size(predicted.peak)}, above this policy's "
            f"memory_budget {format_size(policy.memory_budget)}: it was planned for a larger "
            "budget; delete plan_file= to plan for this one")


def write_plan(folder: str | os.PathLike[str], text: str) -> Path:
    """Write the plan as `folder/actcfg-plan.yaml`, through a temporary file renamed over it:
    an interrupted write never leaves half a plan, nor loses the one before."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    target = out / PLAN_FILE_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{PLAN_FILE_NAME}.", dir=out)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _names(names: Any, limit: int = 4) -> str:
    names = list(names)
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
