"""Byte counts as people read them, in two styles: `memory_size` in binary units, as GPU memory
and budgets are read (`1.50 GiB`), and `decimal_size` in decimal units, for sentences about
bytes moved (`2.10 GB`). Every layer formats through these two; nothing else does."""

from __future__ import annotations

__all__ = ["decimal_size", "memory_size"]


def memory_size(n: float) -> str:
    """A byte count as GPU memory is read: `1.50 GiB`, `12.0 MiB`, `1.0 KiB`, `512 B`. Each unit
    from one of it up, so that no size that is not 0 prints as 0 (a 1 KiB budget was `0.0 MiB`)."""
    a = abs(n)
    if a >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if a >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if a >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def decimal_size(n: float) -> str:
    """Decimal units for sentences: `0.26 GB`, `67.1 MB`, `12.0 kB`, `512 B`."""
    a = abs(n)
    if a >= 1e8:
        return f"{n / 1e9:.2f} GB"
    if a >= 1e5:
        return f"{n / 1e6:.1f} MB"
    if a >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n:.0f} B"
