"""benchmarks/copy_timeline.py's reading of a profiler trace, on the CPU: the split of a step's
GPU time around its copies that docs/benchmarks.md quotes for the seed chain. Profiling itself
needs a GPU; the events here are written as torch's profiler writes them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("copy_timeline", ROOT / "benchmarks" / "copy_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel(ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": "nvjet_sm90_gemm", "ts": ts, "dur": dur}


def copy(ts: float, dur: float, out: bool) -> dict:
    name = "Memcpy DtoH (Device -> Pinned)" if out else "Memcpy HtoD (Pinned -> Device)"
    return {"cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur}


def test_the_step_splits_into_start_copy_chains_turn_and_tail(timeline):
    # Two layers' forward, two copies out with a 100 us gap, the loss, two copies back, the
    # backward after the last one; a memset and a short copy that are not the engine's.
    events = [
        kernel(1000, 700), kernel(1700, 700),
        copy(1700, 4700, out=True), copy(6500, 4700, out=True),
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 6450, "dur": 1},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 9000, "dur": 3},
        kernel(11200, 2000),  # the loss, after the last copy out
        copy(13200, 4800, out=False), copy(18000, 4800, out=False),
        kernel(22800, 1200),  # backward after the last reload
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 500, "dur": 30000},  # host, ignored
    ]
    got = timeline.breakdown(events)
    assert got["copies_out"] == 2 and got["copies_back"] == 2
    assert got["step_ms"] == pytest.approx(23.0)
    assert got["start_ms"] == pytest.approx(0.7)
    assert got["out_busy_ms"] == pytest.approx(9.4) and got["out_gaps_ms"] == pytest.approx(0.1)
    assert got["turn_ms"] == pytest.approx(2.0)
    assert got["back_busy_ms"] == pytest.approx(9.6) and got["back_gaps_ms"] == pytest.approx(0.0)
    assert got["tail_ms"] == pytest.approx(1.2)


def test_a_step_without_copies_has_no_start_turn_or_tail(timeline):
    got = timeline.breakdown([kernel(0, 500), kernel(600, 400)])
    assert got["copies_out"] == got["copies_back"] == 0
    assert got["start_ms"] is None and got["turn_ms"] is None and got["tail_ms"] is None
    assert got["step_ms"] == pytest.approx(1.0)


def test_a_trace_without_gpu_events_is_refused_with_the_reason(timeline):
    with pytest.raises(ValueError, match="no GPU events"):
        timeline.breakdown([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
