"""The DeepSpeed-only fields, refused alike by every backend that is not DeepSpeed underneath."""

from __future__ import annotations

from actcfg.backends.table import Unsupported

__all__ = ["deepspeed_only"]

_WHAT = {
    "partition": "DeepSpeed's partition_activations; torch's analogue is tensor-parallel input_reshard",
    "contiguous": "DeepSpeed's contiguous_memory_optimization",
    "num_checkpoints": "DeepSpeed's number_checkpoints",
    "synchronize": "DeepSpeed's synchronize_checkpoint_boundary",
    "profile": "DeepSpeed's checkpoint profiling",
}


def deepspeed_only() -> dict[str, Unsupported]:
    """An `Unsupported` entry for each DeepSpeed-only field."""
    return {
        key: Unsupported("deepspeed-only", f"`{key}` is DeepSpeed-only ({what})",
                         f"set `backend: deepspeed`, or remove `{key}`")
        for key, what in _WHAT.items()
    }
