"""Each backend, known in one place: its name, what it can express and under which names.

One table per backend (`deepspeed.py`, `torch.py`, `hf.py`, `lightning.py`), each mapping every
policy field to an entry of `table.py`. The schema derives its backend rules from these tables
(`findings`), the translators build each backend's output from them, and the runtime's
`APPLIERS` are keyed by `Backend`. Pure data: no I/O, no torch, nothing from the rest of actcfg
but `errors`, so the light path (`actcfg validate`) can import it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from actcfg.errors import ActcfgError

__all__ = ["BACKENDS", "Backend", "BackendSpec", "RUNTIME_BACKENDS"]


class Backend(enum.StrEnum):
    """The training stacks a policy can be translated to; `torch` and `deepspeed` also apply it."""

    DEEPSPEED = "deepspeed"
    HF = "hf"
    LIGHTNING = "lightning"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        """The backend named `value`; the one error for an unknown name, wherever it is given."""
        if isinstance(value, Backend):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(b.value for b in cls)
            raise ActcfgError(f"unknown backend {value!r}: choose one of {choices}") from None

    @property
    def spec(self) -> BackendSpec:
        """What actcfg knows of this backend."""
        return BACKENDS[self]


class BackendSpec(NamedTuple):
    """A backend: its table of fields and whether `actcfg.apply` can run it (a NamedTuple, as
    the table's entries, for the light path: see `actcfg.backends.table`)."""

    backend: Backend
    table: dict
    """Policy field path -> entry (see `actcfg.backends.table`)."""
    runs: bool
    """True when `actcfg.apply` puts a policy into effect with this backend; the others are
    translation targets (their trainers run a policy through actcfg's integrations)."""
    label: str
    """How sentences name the backend (`DeepSpeed`, `Hugging Face Transformers`)."""
    checkpoint_function: str
    """What must call the checkpointed modules for the backend's checkpoint settings to act."""


def _specs() -> dict[Backend, BackendSpec]:
    from actcfg.backends import deepspeed, hf, lightning, torch

    return {
        Backend.DEEPSPEED: BackendSpec(Backend.DEEPSPEED, deepspeed.TABLE, True, "DeepSpeed",
                                       "deepspeed.checkpointing.checkpoint"),
        Backend.HF: BackendSpec(Backend.HF, hf.TABLE, False, "Hugging Face Transformers",
                                "the model's GradientCheckpointingLayer"),
        Backend.LIGHTNING: BackendSpec(Backend.LIGHTNING, lightning.TABLE, False,
                                       "Lightning's DeepSpeedStrategy",
                                       "deepspeed.checkpointing.checkpoint"),
        Backend.TORCH: BackendSpec(Backend.TORCH, torch.TABLE, True, "torch",
                                   "torch.utils.checkpoint.checkpoint"),
    }


BACKENDS: dict[Backend, BackendSpec] = _specs()
"""Every backend's spec: the one registry of what actcfg knows about each."""

RUNTIME_BACKENDS: tuple[Backend, ...] = tuple(b for b, s in BACKENDS.items() if s.runs)
"""The backends `actcfg.apply` runs (a policy's `backend` is one of these)."""
