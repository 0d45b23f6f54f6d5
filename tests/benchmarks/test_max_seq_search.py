"""benchmarks/max_seq_bench.py on the CPU: the search (doubling, then bisecting) and the report it writes.

The search is driven by a predicate that says whether a length fits (a threshold, as memory is);
the report by the results a length's process writes, so a run on the GPU cannot end in a crash
of its own reporting after hours of measuring.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("max_seq_bench", ROOT / "benchmarks" / "max_seq_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["max_seq_bench"] = module
    spec.loader.exec_module(module)
    return module


def _under(threshold: int, calls: list[int]):
    def fits(length: int) -> bool:
        calls.append(length)
        return length <= threshold
    return fits


def test_doubles_until_a_length_fails_then_bisects_to_the_granularity(bench):
    calls: list[int] = []
    found = bench.find_longest(_under(50_000, calls), 4096, 4096, 1 << 20)
    assert found.tried == [(4096, True), (8192, True), (16384, True), (32768, True), (65536, False),
                           (49152, True), (57344, False), (53248, False)]
    assert (found.longest, found.shortest_failing, found.limit_reached) == (49152, 53248, False)
    assert calls == [length for length, _ in found.tried]  # each length run once


def test_a_start_that_does_not_fit_is_bisected_below(bench):
    found = bench.find_longest(_under(10_000, []), 16384, 4096, 1 << 20)
    assert found.tried == [(16384, False), (8192, True), (12288, False)]
    assert (found.longest, found.shortest_failing) == (8192, 12288)


def test_nothing_fits(bench):
    found = bench.find_longest(_under(100, []), 4096, 4096, 1 << 20)
    assert found.tried == [(4096, False)] and found.longest is None and not found.limit_reached


def test_everything_fits_up_to_the_limit(bench):
    found = bench.find_longest(_under(1 << 30, []), 4096, 4096, 65536 + 100)
    assert [length for length, _ in found.tried] == [4096, 8192, 16384, 32768, 65536]
    assert found.longest == 65536 and found.shortest_failing is None and found.limit_reached


@pytest.mark.parametrize(("start", "granularity", "limit"), [(0, 4096, 1 << 20), (6000, 4096, 1 << 20),
                                                             (8192, 4096, 4096)])
def test_a_grid_that_is_not_one_is_refused(bench, start, granularity, limit):
    with pytest.raises(ValueError, match=r"^start \(\d+\) must be a positive multiple of granularity"):
        bench.find_longest(lambda n: True, start, granularity, limit)


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 1 << 21), start_steps=st.integers(1, 16), granularity=st.sampled_from([512, 1024, 4096]),
       limit_steps=st.integers(16, 400))
def test_the_longest_is_the_last_multiple_of_the_granularity_that_fits(bench, threshold, start_steps, granularity,
                                                                      limit_steps):
    start, limit = start_steps * granularity, limit_steps * granularity
    calls: list[int] = []
    found = bench.find_longest(_under(threshold, calls), start, granularity, limit)
    reachable = min(threshold, limit) // granularity * granularity
    assert found.longest == (reachable or None)
    assert len(calls) == len(set(calls))  # no length is run twice
    assert all(n % granularity == 0 and 0 < n <= limit for n in calls)
    if found.shortest_failing is not None:
        assert found.shortest_failing - (found.longest or 0) <= granularity
        assert found.shortest_failing > threshold
    else:
        assert found.longest == limit // granularity * granularity


# --- the report ---------------------------------------------------------------------------------


GiB = 2**30


def _run(length: int, *, steady: float, proof: str = "ok", engine: bool = False) -> dict:
    """A length's result as the child process writes it."""
    r = {"variant": "x", "length": length, "fits": True, "first_s": steady * 1.05, "steady_s": steady,
         "step_s": [steady, steady], "tokens_per_s": length / steady, "peak": 60 * GiB,
         "peak_reserved": 62 * GiB, "step_start": 20 * GiB, "states": 20 * GiB, "budget": None,
         "recomputes_per_step": 28, "actcfg_recomputes_per_step": None, "layers": 28,
         "held_growth_per_layer": 0.0, "pinned_host": None, "pinned_host_torch": None,
         "attention_mask_bytes": None, "logits_fp32_bytes": 32000 * length * 4,
         "layer_input_bytes": length * 3072 * 2, "proof": proof, "process_s": 30.0}
    if engine:
        pool = {"on_demand": 2, "ahead": 27, "wait_s": 0.1, "pinned_allocations": 3, "pinned_bytes": GiB}
        r.update(pinned_host=20 * GiB, pageable_host=0, offloaded_bytes=20 * GiB, kept_at_turn_bytes=GiB,
                 first_step_pool=pool, later_steps_pool=dict.fromkeys(pool, 0))
    return r


def _outcome(bench, key: str, runs: dict[int, dict], failing: int | None):
    o = bench.Outcome(key, bench.VARIANTS[key].label)
    fit = [n for n, r in runs.items() if r["fits"]]
    o.runs = runs
    o.search = bench.Search(longest=max(fit) if fit else None, shortest_failing=failing,
                            tried=[(n, r["fits"]) for n, r in runs.items()])
    return o


def test_the_report_credits_proven_lengths_and_states_the_targets(bench, tmp_path):
    k = 1024
    outcomes = {
        "plain": _outcome(bench, "plain", {16 * k: _run(16 * k, steady=1.0)}, 32 * k),
        "hf-checkpointing": _outcome(bench, "hf-checkpointing", {128 * k: _run(128 * k, steady=31.4)}, 192 * k),
        "torchtune-offload": bench.Outcome("torchtune-offload", "torchtune OffloadActivations",
                                           unavailable="torchtune is not importable here"),
        "actcfg-checkpoint": _outcome(bench, "actcfg-checkpoint",
                                      {128 * k: _run(128 * k, steady=31.0, proof="0 layers recomputed")}, 160 * k),
        "actcfg-checkpoint-cpu": _outcome(bench, "actcfg-checkpoint-cpu",
                                          {128 * k: _run(128 * k, steady=32.0, engine=True),
                                           256 * k: _run(256 * k, steady=70.0, engine=True)}, 320 * k),
        "actcfg-auto": _outcome(bench, "actcfg-auto", {64 * k: {**_run(64 * k, steady=9.0),
                                                              "plan": ["keep"] + ["full"] * 27}}, 96 * k),
        "torch-checkpoint-offload": _outcome(bench, "torch-checkpoint-offload", {256 * k: _run(256 * k, steady=71.0)},
                                             288 * k),
        "actcfg-checkpoint-cpu-keep0": _outcome(bench, "actcfg-checkpoint-cpu-keep0",
                                                {288 * k: _run(288 * k, steady=90.0, engine=True)}, 320 * k),
    }
    shape = bench.SHAPES["3b"]
    meta = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.24",
            "shape_name": "3b", "steps": 2, "jobs": 1, "alloc_conf": "expandable_segments:True"}
    text = bench.render(meta, outcomes, shape)
    assert "| actcfg checkpoint | effect missing (128k ran) |" in text  # no figure without its proof
    assert "| torchtune OffloadActivations | unavailable: torchtune is not importable here |" in text
    # actcfg's longest is its best offloading variant's, and longer than a peer means a length
    # actcfg fit and the peer did not (torch fit 256k, not 288k)
    best = "actcfg's longest (actcfg checkpoint + cpu_checkpointing, keep_last 0, final norm too)"
    assert f"| {best} / HF checkpointing's >= 2 | 288k / 128k = 2.25 | yes |" in text
    assert (f"| {best}: longer than every peer | 288k fit; plain 16k fit, 32k did not, HF gradient_checkpointing_enable() "
            "128k fit, 192k did not, torch offload_wrapper(checkpoint_wrapper) 256k fit, 288k did not | yes |") in text
    assert "actcfg's steady time per token / HF's <= 1.05 | 32.00 / 31.40 s = 1.019 | yes |" in text
    assert "actcfg's first step / its steady state <= 1.1 | 33.60 / 32.00 s = 1.050 | yes |" in text
    assert "the loss's fp32 logits: vocab 32000 x 256k x 4 bytes = 31.25 GiB per copy" in text
    assert "| ok (plan: 1 keep, 27 full) |" in text
    assert "no mask was materialised" in text and "keep_last: 0" in text
    assert "2 buffers made on demand, 27 ahead" in text
    bench.plot(outcomes, tmp_path / "max_seq.png", "3b")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "max_seq.png").stat().st_size > 0


def test_without_a_gpu_the_benchmark_says_so_and_writes_nothing(bench, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench.main(["--shape", "small", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("max_seq_bench needs a CUDA GPU (on another machine, it re-renders")
    assert not (tmp_path / "out").exists()


def test_a_report_of_runs_already_measured_renders_anywhere_and_says_which_versions_ran_each(bench, tmp_path, capsys):
    """--resume with --at naming only measured lengths re-renders the report (no GPU needed, none
    run); runs of two calls with different transformers are said per row, the report is dated by
    its newest run, and a peer that ran out of memory at the only length it ran says so."""
    k = 1024
    shape = bench.SHAPES["3b"]
    hf = _run(192 * k, steady=65.7)
    hf.pop("date", None)
    earlier = {"meta": {"shape": dataclasses.asdict(shape), "date": "2026-12-01T00:00:00+00:00",
                        "transformers": "5.17.0"}, "variants": {
        "hf-checkpointing": {"runs": {str(192 * k): hf, str(224 * k): {"fits": False, "why": "out of GPU memory"}}},
        "actcfg-checkpoint-cpu": {"runs": {str(192 * k): _run(192 * k, steady=66.0, engine=True),
                                           str(320 * k): _run(320 * k, steady=172.0, engine=True)}},
        "torchtune-offload": {"runs": {str(320 * k): {"fits": False, "why": "out of GPU memory",
                                                      "date": "2026-12-02T05:37:39+00:00",
                                                      "transformers": "5.24.0"}}}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    at = ["--at", "hf-checkpointing=192k,224k", "--at", "actcfg-checkpoint-cpu=192k,320k",
          "--at", "torchtune-offload=320k"]
    out = tmp_path / "out"
    assert bench.main(["--steps", "0", "--resume", str(path), *at, "--out", str(out)]) == 0
    report = (out / "max_seq.md").read_text()
    assert report.startswith("Measured 2026-12-02T05:37:39+00:00 on ")
    assert ("Rows by the transformers they ran with: 5.17.0: 'HF gradient_checkpointing_enable()', 'actcfg "
            "checkpoint + cpu_checkpointing'; 5.24.0: 'torchtune OffloadActivations'.") in report
    assert "torchtune OffloadActivations 320k did not (nothing shorter run)" in report
    assert "| yes |" in report.split("longer than every peer")[1].splitlines()[0]
    saved = json.loads((out / "max_seq.json").read_text())
    assert saved["variants"]["hf-checkpointing"]["runs"][str(192 * k)]["transformers"] == "5.17.0"
    import torch

    if not torch.cuda.is_available():  # a length not yet measured still needs the GPU
        assert bench.main(["--steps", "0", "--resume", str(path), "--at", "torchtune-offload=288k",
                           "--out", str(tmp_path / "more")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_unknown_variants_and_a_broken_grid_are_usage_errors(bench, tmp_path, capsys):
    assert bench.main(["--variants", "plain,nope", "--out", str(tmp_path)]) == 2
    assert "unknown variant(s) nope; choose from plain," in capsys.readouterr().err
    assert bench.main(["--shape", "small", "--start", "3000", "--out", str(tmp_path)]) == 2
    assert "must be a positive multiple of granularity (2048)" in capsys.readouterr().err


def test_a_child_result_is_json_written_whole(bench, tmp_path):
    """A length's process that cannot run its variant still writes its one result file."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the child would measure")
    result = tmp_path / "r.json"
    shape = json.dumps(dataclasses.asdict(bench.SHAPES["small"]))
    assert bench.main(["--child", "plain", "--length", "4096", "--steps", "1", "--shape-json", shape,
                       "--result", str(result)]) == 0
    out = json.loads(result.read_text())
    assert out["fits"] is False and "error" in out  # no CUDA here: an error, never "does not fit"
    assert not result.with_suffix(".json.tmp").exists()


def test_a_length_runs_in_its_own_process_and_an_error_stops_the_search(bench):
    """The parent's half on the CPU: the child process starts, cannot measure without CUDA, and
    says so in its result; an error is never taken for "does not fit", so the search stops."""
    import argparse

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the child would measure")
    args = argparse.Namespace(steps=1, child_timeout=300, no_expandable_segments=False, deadline=float("inf"))
    lines: list[str] = []
    outcome = bench.search_variant("plain", bench.SHAPES["small"], args, lines.append)
    run = outcome.runs[4096]
    assert run["fits"] is False and run["process_s"] > 0
    assert "Traceback" in outcome.error and outcome.search.longest is None
    assert list(outcome.runs) == [4096]  # nothing more was tried
    assert lines[-1].startswith("plain") and "error: " in lines[-1]


def test_given_lengths_run_in_order_and_bound_the_longest(bench):
    """--at runs only the lengths given (a run on a big model cannot afford the search): the
    longest that fit is a lower bound, the shortest failing above it an upper bound."""
    k = 1024
    calls: list[int] = []
    found = bench.try_lengths(_under(200 * k, calls), [256 * k, 128 * k, 160 * k, 128 * k])
    assert calls == [128 * k, 160 * k, 256 * k]
    assert (found.longest, found.shortest_failing) == (160 * k, 256 * k)
    assert not found.limit_reached
    assert bench.try_lengths(_under(1 << 30, []), [64 * k]).limit_reached  # nothing failed: longer not tried


def test_lengths_are_given_per_variant_in_tokens_or_k(bench, tmp_path, capsys):
    assert bench.parse_at(["hf-checkpointing=128k,160k", "actcfg-checkpoint-cpu=196608"]) == {
        "hf-checkpointing": [131072, 163840], "actcfg-checkpoint-cpu": [196608]}
    for bad in ("hf-checkpointing", "nope=128k", "plain=12q", "plain=0"):
        with pytest.raises(ValueError, match=r"^--at "):
            bench.parse_at([bad])
    assert bench.main(["--at", "plain=12q", "--out", str(tmp_path)]) == 2
    assert "'12q' is not a length (tokens, or 128k)" in capsys.readouterr().err


def test_past_the_deadline_no_length_is_launched_and_the_report_says_so(bench):
    """A run under a device's time limit must end with its report written, not killed mid-child."""
    import argparse
    import time

    args = argparse.Namespace(steps=1, child_timeout=300, no_expandable_segments=False, deadline=time.monotonic())
    lines: list[str] = []
    outcome = bench.search_variant("plain", bench.SHAPES["3b"], args, lines.append, [131072, 163840])
    assert outcome.runs == {} and outcome.skipped == [131072] and outcome.search.longest is None
    assert lines == ["plain                            131072  not run: the run's --deadline-s has passed"]
    meta = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.24",
            "shape_name": "3b", "steps": 1, "jobs": 1, "alloc_conf": "", "searched": False}
    text = bench.render(meta, {"plain": outcome}, bench.SHAPES["3b"])
    assert "| plain | none of those tried | none tried (128k not measured: out of time) |" in text
    assert "Only the lengths listed under each variant were run (no search)" in text


def test_a_resumed_run_reuses_measured_lengths_and_compares_where_both_ran(bench, tmp_path, monkeypatch):
    """--resume: the lengths an earlier call measured are not run again (a device call's limit
    splits a big model's lengths over calls); one that timed out is run again. The same-run
    comparison falls back to the longest length both HF and actcfg ran."""
    import argparse

    k = 1024
    shape = bench.SHAPES["3b"]
    earlier = {"meta": {"shape": dataclasses.asdict(shape)}, "variants": {
        "hf-checkpointing": {"runs": {str(128 * k): _run(128 * k, steady=30.8), str(160 * k): _run(160 * k, steady=46.6)}},
        "actcfg-checkpoint-cpu": {"runs": {str(128 * k): _run(128 * k, steady=31.0, engine=True),
                                           str(256 * k): {"fits": False, "timed_out": True, "why": "timed out"}}}}}
    path = tmp_path / "max_seq.json"
    path.write_text(json.dumps(earlier))
    runs = bench.earlier_runs(path, shape)
    assert sorted(runs["actcfg-checkpoint-cpu"]) == [128 * k]  # the timed-out length runs again
    ran: list[tuple[str, int]] = []

    def fake_run(key, shape, length, *_):
        ran.append((key, length))
        return _run(length, steady=120.0, engine=True)

    monkeypatch.setattr(bench, "run_length", fake_run)
    args = argparse.Namespace(steps=1, child_timeout=300, no_expandable_segments=False, deadline=float("inf"),
                              earlier=runs)
    act = bench.search_variant("actcfg-checkpoint-cpu", shape, args, lambda _: None, [256 * k])
    hf = bench.search_variant("hf-checkpointing", shape, args, lambda _: None, [])
    assert ran == [("actcfg-checkpoint-cpu", 256 * k)]
    assert (act.search.longest, hf.search.longest) == (256 * k, 160 * k)
    lines = "\n".join(bench.targets({"hf-checkpointing": hf, "actcfg-checkpoint-cpu": act}))
    assert ("| at 128k, the longest both ran (HF's longest here: 160k): actcfg's steady time per token / "
            "HF's <= 1.05 | 31.00 / 30.80 s = 1.006 | yes |") in lines
    with pytest.raises(ValueError, match="measured another shape"):
        bench.earlier_runs(path, bench.SHAPES["small"])


def test_a_first_step_only_length_counts_for_the_longest_but_not_for_the_speed_targets(bench):
    """--steps 0 asks only whether a length fits: it extends the longest, its speed is not a
    steady state, and the speed targets stay at the longest length both ran with one."""
    k = 1024
    first_only = {**_run(288 * k, steady=140.0, engine=True), "step_s": [], "steady_measured": False,
                  "kept_at_turn_bytes": 4 * 288 * k * 3072 * 2}  # the last layer's input and the head's
    outcomes = {
        "hf-checkpointing": _outcome(bench, "hf-checkpointing", {192 * k: _run(192 * k, steady=65.7)}, None),
        "actcfg-checkpoint-cpu": _outcome(bench, "actcfg-checkpoint-cpu",
                                          {192 * k: _run(192 * k, steady=66.0, engine=True),
                                           288 * k: first_only}, None),
    }
    meta = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.24",
            "shape_name": "3b", "steps": 0, "jobs": 1, "alloc_conf": "expandable_segments:True"}
    text = bench.render(meta, outcomes, bench.SHAPES["3b"])
    # HF never ran out of memory here: not shown shorter than actcfg, whatever it fit
    assert ("longer than every peer | 288k fit; HF gradient_checkpointing_enable() 192k fit, longer not tried "
            "(288k actcfg's longest tried: longer not tried) | NO |") in text
    assert "| 2107 (first step) | 147.00 | not measured | – |" in text
    assert "HF's longest (192k): actcfg's steady time per token / HF's <= 1.05 | 66.00 / 65.70 s" in text
    assert ("kept 6.75 GiB on the GPU at the forward/backward turn, the last group (`keep_last`, default 1): "
            "the last layer's input (1.69 GiB) and 5.06 GiB the model saves after its last layer") in text
    assert "this call ran the first step only (--steps 0" in text


def test_keep0_leaves_nothing_from_the_first_layer_to_the_head_on_the_device(bench):
    """The keep0 variant's rules offload the newest layer's input and checkpoint the final norm:
    at the turn the device holds less than the headline variant by that input and what the norm
    saves (its input and its normalised output, each a layer input in this float32 model), with
    the same gradients. On the host loopback, with a tiny Llama."""
    import torch

    from _helpers import grads_of, tiny_llama
    from actcfg.plan.probe import LiveBytes
    from actcfg.runtime.offload import host_loopback

    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(1))
    held, grads, moved = {}, {}, {}
    for key in ("actcfg-checkpoint-cpu", "actcfg-checkpoint-cpu-keep0"):
        model = tiny_llama(4, vocab_size=512, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
        with host_loopback():
            handle, _ = bench.setup_variant(key, model, {"input_ids": ids, "labels": ids}, 0)
            handle.engine.min_offload_bytes = 1 << 10
            try:
                for _ in range(2):  # the engine learns which groups are the last in its first step
                    model.zero_grad(set_to_none=True)
                    meter = LiveBytes()
                    meter.start()
                    loss = model(input_ids=ids, labels=ids).loss
                    held[key] = meter.now
                    loss.backward()
                    meter.stop()
                grads[key] = grads_of(model)
                moved[key] = {g["module"]: g["offloaded_bytes"] for g in handle.offload_groups()}
                assert bench.checkpointed_modules(key, model) == handle.counters.recomputes // 2
            finally:
                handle.remove()
    layer_input = 256 * 64 * 4
    assert held["actcfg-checkpoint-cpu"] - held["actcfg-checkpoint-cpu-keep0"] >= 3 * layer_input
    assert moved["actcfg-checkpoint-cpu-keep0"]["model.norm"] == layer_input
    assert moved["actcfg-checkpoint-cpu-keep0"]["model.layers.3"] == layer_input
    for name, g in grads["actcfg-checkpoint-cpu"].items():
        torch.testing.assert_close(grads["actcfg-checkpoint-cpu-keep0"][name], g, rtol=0, atol=0)
