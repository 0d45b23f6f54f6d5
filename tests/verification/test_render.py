"""verification.render: the text and JSON reports and the memory plot, for one rank and several."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from actcfg.errors import VerifyError
from actcfg.verification import GradDiff, Measurements, VerifyReport, judge_ranks
from actcfg.verification.render import REPORTER_BY_NAME, plot_memory, render_json, render_text

from _verify_cases import (
    B,
    GROWING,
    OFFLOAD,
    PARTITION,
    PARTITIONED,
    PLAIN,
    UNPARTITIONED,
    measured,
    report,
)


def ranks_report(*ranks: Measurements) -> VerifyReport:
    return VerifyReport(PARTITION, "deepspeed", ranks[0], tuple(judge_ranks(PARTITION, ranks)), ranks)


def test_text_report_of_two_ranks_is_one_row_per_rank_and_one_verdict_per_promise():
    assert render_text(ranks_report(PARTITIONED, UNPARTITIONED)) == """\
actcfg verify: backend deepspeed, 2 ranks, 10 blocks, float16, 3 steps, model-parallel size 2

rank  plain MiB/block  policy MiB/block  plain peak MiB  policy peak MiB  plain ms  policy ms  offloaded MiB  gradient error
0               250.0             125.0          3000.0           1500.0     123.4      200.0            n/a               0
1               250.0             250.0          3000.0           3000.0     123.4      200.0            n/a         5.0e-01

MiB/block: growth of GPU memory held per block over the second half of the blocks
one block input 250.0 MiB; gradient error: max relative, float16 tolerance 1e-02

FAIL  peak       on rank 1 of 2: checkpointing is on but the peak was 3.15 GB, not below the plain run's 3.15 GB: the policy freed no activation memory
FAIL  partition  on rank 1 of 2: partition is on with model-parallel size 2 but held checkpoint memory grew by 0.26 GB per block, 1.00 of one block input instead of about 1/2: the activations were not partitioned
FAIL  gradients  on rank 1 of 2: gradients differ from the plain run: max relative error 0.5 in 0.weight, above the float16 tolerance 1e-02: a saved activation was lost or changed
"""


def test_json_report_of_two_ranks_keeps_rank_0_on_top_and_adds_every_rank():
    single = json.loads(render_json(report(PARTITION, PARTITIONED, "deepspeed")))
    data = json.loads(render_json(ranks_report(PARTITIONED, UNPARTITIONED)))
    assert list(data) == [*single, "world_size", "ranks"]
    assert data["ok"] is False and data["world_size"] == 2
    assert {k: data[k] for k in single if k not in ("ok", "verdicts")} == {
        k: single[k] for k in single if k not in ("ok", "verdicts")}
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert {k: v for k, v in data["ranks"][0].items() if k != "rank"} == {
        k: single[k] for k in data["ranks"][0] if k != "rank"}
    assert data["ranks"][1]["peak_bytes"] == {"plain": 12 * B, "policy": 12 * B}
    assert data["ranks"][1]["gradients"]["max_rel_error"] == 0.5


def test_plot_of_two_ranks_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot_memory(ranks_report(PARTITIONED, UNPARTITIONED), tmp_path / "ranks.png")
    assert (tmp_path / "ranks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- rendering ---------------------------------------------------------------------------------


def test_text_report_is_pinned():
    assert render_text(report()) == """\
actcfg verify: backend torch, 10 blocks, float16, 3 steps

block  plain MiB held  policy MiB held
0               250.0            250.0
1               500.0            500.0
2               750.0            500.0
3              1000.0            500.0
4              1250.0            500.0
5              1500.0            500.0
6              1750.0            500.0
7              2000.0            500.0
8              2250.0            500.0
9              2500.0            500.0

one block input  250.0 MiB
peak             plain 3000.0 MiB, policy 750.0 MiB (-75%)
step time        plain 123.4 ms, policy 200.0 ms (median of 3)
host memory      pinned 2250.0 MiB, pageable 0.0 MiB
gradient error   0 max relative, float16 tolerance 1e-02

PASS  cpu_checkpointing  GPU memory stopped growing: 0 B per block over blocks 4 to 8 (limit 13.1 MB, 5% of one block input); 2.0 block inputs stay on the GPU
PASS  peak               the peak fell from 3.15 GB to 0.79 GB (75% lower)
PASS  gradients          gradients match the plain run: max relative error 0, within the float16 tolerance 1e-02
"""


def test_text_report_of_a_failure_says_na_for_unknown_host_memory():
    m = measured(GROWING, policy_peak=12 * B, grads=[GradDiff("3.weight", 0.7)], dtype="bfloat16",
                 blocks=tuple(f"layers.{i}" for i in range(10)))
    text = render_text(report(OFFLOAD, m, "deepspeed"))
    assert "host memory      pinned n/a, pageable n/a\n" in text
    assert "gradient error   7.0e-01 (3.weight) max relative, bfloat16 tolerance 2e-02\n" in text
    assert "layers.9          2500.0           2500.0\n" in text
    assert text.endswith(
        "FAIL  cpu_checkpointing  cpu_checkpointing is on but GPU memory grew by 0.26 GB per "
        "block, the size of one block input: the offload did not take effect\n"
        "FAIL  peak               checkpointing is on but the peak was 3.15 GB, not below the "
        "plain run's 3.15 GB: the policy freed no activation memory\n"
        "FAIL  gradients          gradients differ from the plain run: max relative error 0.7 in "
        "3.weight, above the bfloat16 tolerance 2e-02: a saved activation was lost or changed\n")


def test_json_report_shape():
    data = json.loads(render_json(report()))
    assert list(data) == ["ok", "backend", "policy", "dtype", "steps", "mp_size",
                          "block_input_bytes", "blocks", "peak_bytes", "step_time_s",
                          "compile_ms", "host_bytes", "gradients", "verdicts"]
    assert data["compile_ms"] is None  # nothing compiled
    assert data["ok"] is True
    assert data["policy"] == OFFLOAD.model_dump(mode="json")
    assert data["blocks"][:2] == [
        {"name": "0", "plain_held_bytes": B, "policy_held_bytes": B},
        {"name": "1", "plain_held_bytes": 2 * B, "policy_held_bytes": 2 * B},
    ]
    assert {k: data[k] for k in ("backend", "dtype", "steps", "mp_size", "block_input_bytes",
                                 "peak_bytes", "step_time_s", "host_bytes")} == {
        "backend": "torch", "dtype": "float16", "steps": 3, "mp_size": 1,
        "block_input_bytes": B,
        "peak_bytes": {"plain": 12 * B, "policy": 3 * B},
        "step_time_s": {"plain": 0.1234, "policy": 0.2},
        "host_bytes": {"pinned": 9 * B, "pageable": 0},
    }
    assert data["gradients"] == {
        "max_rel_error": 0.0, "parameter": "0.weight", "tolerance": 0.01,
        "parameters": [{"name": "0.weight", "error": 0.0, "note": None},
                       {"name": "0.bias", "error": 0.0, "note": None}],
    }
    assert [v["promise"] for v in data["verdicts"]] == ["cpu_checkpointing", "peak", "gradients"]
    assert set(data["verdicts"][0]) == {"promise", "ok", "message"}


def test_json_writes_null_for_a_non_finite_error():
    m = measured(grads=[GradDiff("w", math.inf, "has a non-finite gradient under the policy")])
    data = json.loads(render_json(report(PLAIN, m)))
    assert data["ok"] is False
    assert data["gradients"]["max_rel_error"] is None
    assert data["gradients"]["parameters"] == [
        {"name": "w", "error": None, "note": "has a non-finite gradient under the policy"}]


def test_reporters_by_name():
    assert REPORTER_BY_NAME == {"json": render_json, "text": render_text}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    plot_memory(report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_replaces_an_earlier_png_whole_and_leaves_no_temporary_file(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "memory.png"
    target.write_bytes(b"an earlier plot")
    plot_memory(report(), target)
    assert target.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["memory.png"]


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(VerifyError, match=r"^--plot needs matplotlib, which is not installed: "
                                          r"python -m pip install -e '\.\[plot\]' in the actcfg checkout$"):
        plot_memory(report(), tmp_path / "memory.png")


def test_a_compiled_policy_says_its_warm_up_was_left_out_of_the_step_time():
    """verify warms a `compile:` policy up before timing it; the report says how long compiling
    took, so a reader knows the step time is the compiled steady state."""
    m = dataclasses.replace(measured(), compile_ms=4321.0)
    text = render_text(report(OFFLOAD, m))
    assert "(median of 3, after compiling: 4.3 s of warm-up excluded)" in text
    assert json.loads(render_json(report(OFFLOAD, m)))["compile_ms"] == 4321.0
    assert "after compiling" not in render_text(report(OFFLOAD, measured()))
