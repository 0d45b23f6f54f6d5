"""Render a `VerifyReport`: an aligned text table, JSON for CI, a PNG of memory per block.

No torch; matplotlib is imported only by `plot_memory` (the `plot` extra).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable

from actcfg.errors import VerifyError, install_command
from actcfg.verification.report import (
    Measurements,
    VerifyReport,
    growth_per_block,
    tolerance,
    worst_grad,
)

__all__ = ["REPORTER_BY_NAME", "plot_memory", "render_json", "render_text", "require_plotting"]

_MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _table(rows: list[tuple[str, ...]], *, numbers: bool = True) -> list[str]:
    """First column left-aligned, the others right-aligned (numbers) or left-aligned (text),
    two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    cell = str.rjust if numbers else str.ljust
    return [
        "  ".join([row[0].ljust(widths[0]), *(cell(c, w) for c, w in zip(row[1:], widths[1:]))])
        .rstrip()
        for row in rows
    ]


def render_text(report: VerifyReport) -> str:
    """Memory held per block (plain vs policy), then peak, time, host memory, gradient error,
    then one PASS/FAIL line per promise. With several ranks, one row per rank instead."""
    if report.ranks:
        return _render_ranks(report)
    m = report.measurements
    lines = [
        f"actcfg verify: backend {report.backend}, {len(m.blocks)} blocks, {m.dtype}, "
        f"{m.steps} step{'s' * (m.steps != 1)}",
        "",
        *_table([("block", "plain MiB held", "policy MiB held"),
                 *((name, _mib(p), _mib(q))
                   for name, p, q in zip(m.blocks, m.plain.held, m.policy.held))]),
        "",
    ]
    pinned = "n/a" if m.host_pinned_bytes is None else f"{_mib(m.host_pinned_bytes)} MiB"
    pageable = "n/a" if m.host_pageable_bytes is None else f"{_mib(m.host_pageable_bytes)} MiB"
    worst = worst_grad(m.grads)
    if worst is None:
        grad = "no gradients"
    elif worst.note is not None:
        grad = f"{worst.name} {worst.note}"
    else:
        shown = "0" if worst.error == 0 else f"{worst.error:.1e} ({worst.name})"
        grad = f"{shown} max relative, {m.dtype} tolerance {tolerance(m.dtype):.0e}"
    change = (m.policy.peak - m.plain.peak) / m.plain.peak if m.plain.peak else math.nan
    lines += _table([
        ("one block input", f"{_mib(m.block_input_bytes)} MiB"),
        ("peak", f"plain {_mib(m.plain.peak)} MiB, policy {_mib(m.policy.peak)} MiB"
                 + ("" if math.isnan(change) else f" ({change:+.0%})")),
        ("step time", f"plain {_ms(m.plain.step_time_s)}, policy {_ms(m.policy.step_time_s)}"
                      f" (median of {m.steps}"
                      + ("" if m.compile_ms is None else
                         f", after compiling: {m.compile_ms / 1000:.1f} s of warm-up excluded")
                      + ")"),
        *_predicted_row(report),
        ("host memory", f"pinned {pinned}, pageable {pageable}"),
        ("gradient error", grad),
    ], numbers=False)
    lines.append("")
    lines += _verdict_lines(report)
    return "\n".join(lines) + "\n"


def _predicted_row(report: VerifyReport) -> list[tuple[str, str]]:
    """The plan's prediction beside the measurement, for a rules policy `actcfg plan` wrote."""
    predicted = getattr(report.policy.checkpoint, "predicted", None)
    if predicted is None:
        return []
    m = report.measurements
    ms = m.policy.step_time_s * 1000
    step = f"{(predicted.step_time_ms - ms) / ms:+.0%}" if ms else "n/a"
    peak = f"{(predicted.peak - m.policy.peak) / m.policy.peak:+.0%}" if m.policy.peak else "n/a"
    return [("predicted", f"step {predicted.step_time_ms:.1f} ms ({step} of measured), peak "
                          f"{_mib(predicted.peak)} MiB ({peak} of measured)")]


def _verdict_lines(report: VerifyReport) -> list[str]:
    width = max((len(v.promise) for v in report.verdicts), default=0)
    return [f"{'PASS' if v.ok else 'FAIL'}  {v.promise.ljust(width)}  {v.message}"
            for v in report.verdicts]


def _per_block(held: tuple[int, ...]) -> str:
    return _mib(growth_per_block(held)[0]) if len(held) >= 2 else "n/a"


def _grad_cell(m: Measurements) -> str:
    worst = worst_grad(m.grads)
    if worst is None:
        return "none"
    if worst.note is not None:
        return "not comparable"
    return "0" if worst.error == 0 else f"{worst.error:.1e}"


def _render_ranks(report: VerifyReport) -> str:
    """One row per rank: memory held per block (growth over the second half of the blocks, as
    judged), peaks, step times, bytes offloaded and the worst gradient error."""
    ranks = report.ranks
    first = ranks[0]
    sizes = [m.mp_size for m in ranks]
    if len(set(sizes)) > 1:
        mp_text = ", model-parallel sizes " + "/".join(str(n) for n in sizes)
    else:
        mp_text = f", model-parallel size {sizes[0]}" if sizes[0] > 1 else ""
    lines = [
        f"actcfg verify: backend {report.backend}, {len(ranks)} ranks, {len(first.blocks)} blocks, "
        f"{first.dtype}, {first.steps} step{'s' * (first.steps != 1)}{mp_text}",
        "",
        *_table([("rank", "plain MiB/block", "policy MiB/block", "plain peak MiB",
                  "policy peak MiB", "plain ms", "policy ms", "offloaded MiB", "gradient error"),
                 *((str(rank), _per_block(m.plain.held), _per_block(m.policy.held),
                    _mib(m.plain.peak), _mib(m.policy.peak), f"{m.plain.step_time_s * 1000:.1f}",
                    f"{m.policy.step_time_s * 1000:.1f}",
                    "n/a" if m.offloaded_bytes is None else _mib(m.offloaded_bytes),
                    _grad_cell(m))
                   for rank, m in enumerate(ranks))]),
        "",
        "MiB/block: growth of GPU memory held per block over the second half of the blocks",
        f"one block input {_mib(first.block_input_bytes)} MiB; gradient error: max relative, "
        f"{first.dtype} tolerance {tolerance(first.dtype):.0e}",
        "",
        *_verdict_lines(report),
    ]
    return "\n".join(lines) + "\n"


def render_json(report: VerifyReport) -> str:
    """The report as indented JSON, keys in a stable order (see `VerifyReport.to_dict`)."""
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


REPORTER_BY_NAME: dict[str, Callable[[VerifyReport], str]] = {
    "json": render_json,
    "text": render_text,
}
"""`--format` name -> renderer."""


_NO_MATPLOTLIB = f"--plot needs matplotlib, which is not installed: {install_command('plot')}"


def require_plotting() -> None:
    """Raise VerifyError unless matplotlib can be imported (checked before a GPU run, not after)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise VerifyError(_NO_MATPLOTLIB) from e


def plot_memory(report: VerifyReport, path: str | os.PathLike[str]) -> None:
    """Write a PNG of GPU memory held after each block, plain vs policy (rank 0's plain run and
    each rank's policy run when several ranks measured)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise VerifyError(_NO_MATPLOTLIB) from e
    m = report.measurements
    # Figure() without pyplot: no global backend state, no display needed.
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = range(len(m.blocks))
    ax.plot(x, [b / _MIB for b in m.plain.held], marker="o", label="plain")
    if report.ranks:
        for rank, r in enumerate(report.ranks):
            ax.plot(x, [b / _MIB for b in r.policy.held], marker="o", label=f"policy, rank {rank}")
    else:
        ax.plot(x, [b / _MIB for b in m.policy.held], marker="o", label="policy")
    ax.set_xticks(list(x), list(m.blocks), rotation=45 if len(m.blocks) > 12 else 0)
    ax.set_xlabel("block (forward order)")
    ax.set_ylabel("GPU memory held after the block (MiB)")
    failed = [v.promise for v in report.verdicts if not v.ok]
    verdict = "all promises hold" if not failed else "FAILED: " + ", ".join(failed)
    ax.set_title(f"actcfg verify ({report.backend}, {m.dtype}): {verdict}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    # Into a temporary file beside the target, then one rename: a failed write (disk full)
    # never leaves a half-written PNG where an earlier one was.
    target = os.fspath(path)
    try:
        fd, partial = tempfile.mkstemp(prefix=".actcfg-", suffix=".png",
                                       dir=os.path.dirname(os.path.abspath(target)))
    except OSError as e:
        raise VerifyError(f"--plot: cannot write {target}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, format="png", dpi=120)
        os.replace(partial, target)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise VerifyError(f"--plot: cannot write {target}: {e.strerror or e}") from e
