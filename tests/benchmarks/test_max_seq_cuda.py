"""benchmarks/max_seq_bench.py's small shape on the GPU, structurally: each variant's longest length
is found (in fresh processes), with proof that its policy took effect, and the order is
plain < checkpoint <= checkpoint + offload. No timing is asserted.

Run on the GPU machine (about two minutes on an H200):
    PYTHONPATH=. python3 -m pytest -m cuda -q tests/benchmarks/test_max_seq_cuda.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("plain", "actcfg-checkpoint", "actcfg-checkpoint-cpu")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("max_seq_bench", ROOT / "benchmarks" / "max_seq_bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["max_seq_bench"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path_factory.mktemp("max_seq")
    # each process capped at the small shape's 6 GiB, so the three searches share the GPU
    code = bench.main(["--shape", "small", "--variants", ",".join(ORDER), "--jobs", "3", "--steps", "1",
                       "--child-timeout", "300", "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "max_seq.json").read_text())


def test_every_variant_finds_its_longest_length_with_its_proof(result):
    _, data = result
    for key in ORDER:
        v = data["variants"][key]
        assert not v["error"] and not v["unavailable"], (key, v["error"] or v["unavailable"])
        assert v["longest"] is not None and not v["limit_reached"], (key, v["tried"])
        assert v["shortest_failing"] - v["longest"] <= 2048  # bisected to the granularity
        best = v["runs"][str(v["longest"])]
        assert best["fits"] and best["proof"] == "ok", (key, best["proof"])
        assert v["credited_longest"] == v["longest"]
        failing = v["runs"][str(v["shortest_failing"])]
        assert not failing["fits"] and failing["why"].startswith("out of GPU memory"), (key, failing)


def test_plain_is_shorter_than_checkpoint_which_is_at_most_checkpoint_with_offload(result):
    _, data = result
    plain, ckpt, offload = (data["variants"][k]["longest"] for k in ORDER)
    assert plain < ckpt <= offload, (plain, ckpt, offload)


def test_the_offload_pool_grew_ahead_of_need_in_the_first_step_and_not_after(result):
    _, data = result
    v = data["variants"]["actcfg-checkpoint-cpu"]
    best = v["runs"][str(v["longest"])]
    first, later = best["first_step_pool"], best["later_steps_pool"]
    # the layer inputs repeat their size: two made on demand per size, the rest on the pool's thread
    assert first["ahead"] > first["on_demand"] > 0
    assert later["pinned_allocations"] == 0 and later["on_demand"] == 0 and later["ahead"] == 0
    assert best["offloaded_bytes"] > 0 and best["pinned_host"] > 0


def test_the_report_and_picture_are_written(result):
    out, data = result
    text = (out / "max_seq.md").read_text()
    for key in ORDER:
        assert f"| {data['variants'][key]['label']} |" in text
    assert "What else bounds the length:" in text and "fp32 logits" in text
    assert (out / "max_seq.png").stat().st_size > 0
