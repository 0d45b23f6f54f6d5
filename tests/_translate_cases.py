"""Policies the translator tests run through both backends (beside every file in configs/).

Each gets golden files `tests/golden/case-<name>.<backend>.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actcfg.policy.schema import Policy

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"

_BLOCK = {"mode": "full", "modules": ["Block"]}

CASES: dict[str, dict[str, Any]] = {
    "empty-torch": {"version": 1},
    "empty-deepspeed": {"version": 1, "backend": "deepspeed"},
    "ds-full": {"version": 1, "backend": "deepspeed", "checkpoint": _BLOCK},
    "ds-cpu": {"version": 1, "backend": "deepspeed", "checkpoint": _BLOCK,
               "cpu_checkpointing": True},
    "ds-every2-sync-profile": {
        "version": 1, "backend": "deepspeed",
        "checkpoint": {"mode": "full", "modules": ["Block", "layers.*"], "every": 2},
        "synchronize": True, "profile": True,
    },
    "ds-partition-cpu": {"version": 1, "backend": "deepspeed", "checkpoint": _BLOCK,
                         "partition": True, "cpu_checkpointing": True},
    "ds-everything": {
        "version": 1, "backend": "deepspeed", "checkpoint": _BLOCK, "partition": True,
        "contiguous": True, "num_checkpoints": 12, "cpu_checkpointing": True,
        "synchronize": True, "profile": True,
    },
    "torch-full": {"version": 1, "checkpoint": _BLOCK},
    "torch-full-offload": {"version": 1, "checkpoint": _BLOCK, "cpu_checkpointing": True,
                           "pin_budget": "16GiB"},
    "torch-reentrant": {"version": 1,
                        "checkpoint": {"mode": "full", "modules": ["Block"], "reentrant": True}},
    "torch-reentrant-false": {"version": 1,
                              "checkpoint": {"mode": "full", "modules": ["Block"],
                                             "reentrant": False}},
    "torch-selective": {"version": 1, "checkpoint": {"mode": "selective", "modules": ["Block"]}},
    "torch-selective-mm": {"version": 1,
                           "checkpoint": {"mode": "selective", "modules": ["*"], "every": 3,
                                          "save_ops": ["aten.mm", "aten.addmm"]}},
    "torch-offload-all": {"version": 1, "cpu_checkpointing": True, "pin": False},
    "torch-pin-budget-unused": {"version": 1, "checkpoint": _BLOCK, "pin_budget": 1024},
    "torch-rules-offload": {
        "version": 1, "pin": False,
        "checkpoint": {
            "mode": "rules", "keep_last": 0, "max_inflight": 2,
            "rules": [
                {"modules": ["blocks.0"], "mode": "none"},
                {"modules": ["blocks.1", "blocks.2"], "mode": "none", "cpu_checkpointing": True},
                {"modules": ["blocks.3"], "cpu_checkpointing": True},
                {"modules": ["Block"], "mode": "selective", "save_ops": ["aten.mm"]},
            ],
            "predicted": {"step_time_ms": 91.5, "peak": "5632MiB"},
        },
    },
    "torch-rules-no-offload": {
        "version": 1,
        "checkpoint": {"mode": "rules", "rules": [{"modules": ["layers.*"]}]},
    },
    "torch-auto": {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]},
                   "memory_budget": "6GiB", "pin_budget": "8GiB"},
}


def case_policies() -> dict[str, Policy]:
    """Every named case policy, validated against its own backend."""
    return {name: Policy.model_validate(data) for name, data in CASES.items()}


def config_policies() -> dict[str, Policy]:
    """Every file in configs/ (whatever is there now), by file stem."""
    import actcfg

    return {path.stem: actcfg.load(path) for path in sorted((ROOT / "configs").glob("*.y*ml"))}


def golden_names() -> dict[str, Policy]:
    """Every policy that has golden files: configs/ by stem, cases as `case-<name>`."""
    return {**config_policies(), **{f"case-{n}": p for n, p in case_policies().items()}}


def translated(policy: Policy, backend: str) -> dict[str, Any]:
    """What a golden file pins: the translation, or the TranslationError it raises."""
    from actcfg.errors import TranslationError
    from actcfg.translators import translate

    try:
        return translate(policy, backend)
    except TranslationError as e:
        return {"error": {"field": e.field, "backend": e.backend, "message": str(e)}}


def check_golden(name: str, policy: Policy, backend: str) -> None:
    """Compare with `tests/golden/<name>.<backend>.json` exactly (regenerate with
    ACTCFG_UPDATE_GOLDEN=1; a missing golden fails)."""
    import json
    import os

    import pytest

    path = GOLDEN / f"{name}.{backend}.json"
    text = json.dumps(translated(policy, backend), indent=2) + "\n"
    if os.environ.get("ACTCFG_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    if not path.exists():
        pytest.fail(f"missing golden {path.name}: run ACTCFG_UPDATE_GOLDEN=1 pytest and review it")
    assert path.read_text(encoding="utf-8") == text


def orphan_goldens(backend: str) -> list[str]:
    """Golden files for `backend` that no config or case produces any more."""
    wanted = {f"{name}.{backend}.json" for name in golden_names()}
    return sorted(p.name for p in GOLDEN.glob(f"*.{backend}.json") if p.name not in wanted)
