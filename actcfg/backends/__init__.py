"""Each backend, known in one place: its name, what it can express and under which names.

One table per backend (`deepspeed.py`, `torch.py`, `hf.py`, `lightning.py`), each mapping every
policy field to an entry of `table.py`. The schema derives its backend rules from these tables
(`findings`), the translators build each backend's output from them, and the runtime's
`APPLIERS` are keyed by `Backend`. Pure data: no I/O, no torch, nothing from the rest of actcfg
but `errors`, so the light path (`actcfg validate`) can import it.
"""

from __future__ import annotations

import enum
import importlib
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
    module: str
    """The module of its table (`actcfg.backends.deepspeed`), imported on first use of `table`:
    `actcfg validate` reads only the tables of the backends it checks."""
    runs: bool
    """True when `actcfg.apply` puts a policy into effect with this backend; the others are
    translation targets (their trainers run a policy through actcfg's integrations)."""
    label: str
    """How sentences name the backend (`DeepSpeed`, `Hugging Face Transformers`)."""
    checkpoint_function: str
    """What must call the checkpointed modules for the backend's checkpoint settings to act."""

    @property
    def table(self) -> dict:
        """Policy field path -> entry (see `actcfg.backends.table`)."""
        return importlib.import_module(self.module).TABLE


def _specs() -> dict[Backend, BackendSpec]:
    return {
        Backend.DEEPSPEED: BackendSpec(Backend.DEEPSPEED, "actcfg.backends.deepspeed", True,
                                       "DeepSpeed", "deepspeed.checkpointing.checkpoint"),
        Backend.HF: BackendSpec(Backend.HF, "actcfg.backends.hf", False, "Hugging Face Transformers",
                                "the model's GradientCheckpointingLayer"),
        Backend.LIGHTNING: BackendSpec(Backend.LIGHTNING, "actcfg.backends.lightning", False,
                                       "Lightning's DeepSpeedStrategy",
                                       "deepspeed.checkpointing.checkpoint"),
        Backend.TORCH: BackendSpec(Backend.TORCH, "actcfg.backends.torch", True, "torch",
                                   "torch.utils.checkpoint.checkpoint"),
    }


BACKENDS: dict[Backend, BackendSpec] = _specs()
"""Every backend's spec: the one registry of what actcfg knows about each."""

RUNTIME_BACKENDS: tuple[Backend, ...] = tuple(b for b, s in BACKENDS.items() if s.runs)
"""The backends `actcfg.apply` runs (a policy's `backend` is one of these)."""
