"""verify without a GPU: verdicts from synthetic measurements, rendering, JSON, the factory
contract, gradient comparison on CPU tensors, and the refusals. The measurement itself is in
test_verify_cuda.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from actcfg.errors import ActcfgError, VerifyError
from actcfg.policy.schema import Policy
from actcfg.verification import (
    GradDiff,
    Measurements,
    RunMeasurement,
    Verdict,
    VerifyReport,
    judge,
    judge_ranks,
    load_factory,
    verify,
)
from actcfg.verification.render import REPORTER_BY_NAME, plot_memory, render_json, render_text
from actcfg.verification.report import growth_per_block

ROOT = Path(__file__).resolve().parent.parent
B = 262_144_000  # one block input of the seed chain: 256 x 256 x 2000 fp16
MiB = 2**20
NAMES = tuple(str(i) for i in range(10))


def policy(**fields) -> Policy:
    return Policy.model_validate({"version": 1, **fields})


OFFLOAD = policy(checkpoint={"mode": "full", "modules": ["Linear"]}, cpu_checkpointing=True)
CKPT = policy(checkpoint={"mode": "full", "modules": ["Linear"]})
PLAIN = policy()
OFFLOAD_ALL = policy(cpu_checkpointing=True)
PARTITION = policy(backend="deepspeed", checkpoint={"mode": "full", "modules": ["Block"]},
                   partition=True)

GROWING = tuple(B * (i + 1) for i in range(10))
FLAT = (B, *(2 * B,) * 9)


def measured(policy_held=FLAT, *, plain_held=GROWING, plain_peak=12 * B, policy_peak=3 * B,
             grads=(GradDiff("0.weight", 0.0), GradDiff("0.bias", 0.0)), **kw) -> Measurements:
    return Measurements(
        blocks=kw.pop("blocks", NAMES[: len(policy_held)]),
        block_input_bytes=kw.pop("block_input_bytes", B),
        plain=RunMeasurement(tuple(plain_held), plain_peak, 0.1234),
        policy=RunMeasurement(tuple(policy_held), policy_peak, 0.2),
        grads=tuple(grads),
        dtype=kw.pop("dtype", "float16"),
        **kw,
    )


def verdict(promise: str, pol: Policy, m: Measurements) -> Verdict:
    (found,) = [v for v in judge(pol, m) if v.promise == promise]
    return found


# --- which promises a policy makes -------------------------------------------------------------


@pytest.mark.parametrize(("pol", "promises"), [
    (PLAIN, ["gradients"]),
    (CKPT, ["peak", "gradients"]),
    (OFFLOAD, ["cpu_checkpointing", "peak", "gradients"]),
    (OFFLOAD_ALL, ["cpu_checkpointing", "peak", "gradients"]),
    (PARTITION, ["peak", "partition", "gradients"]),
])
def test_promises_follow_from_the_policy(pol, promises):
    m = measured(plain_held=GROWING, mp_size=2)
    assert [v.promise for v in judge(pol, m)] == promises


def test_every_promise_holds_for_a_working_offload():
    assert judge(OFFLOAD, measured()) == [
        Verdict("cpu_checkpointing", True,
                "GPU memory stopped growing: 0 B per block over blocks 5 to 9 (limit 13.1 MB, "
                "5% of one block input); 2.0 block inputs stay on the GPU"),
        Verdict("peak", True, "the peak fell from 3.15 GB to 0.79 GB (75% lower)"),
        Verdict("gradients", True,
                "gradients match the plain run: max relative error 0, within the float16 "
                "tolerance 1e-02"),
    ]


# --- cpu_checkpointing -------------------------------------------------------------------------


def test_the_seed_bug_reads_as_one_block_input_per_block():
    v = verdict("cpu_checkpointing", OFFLOAD, measured(GROWING))
    assert v == Verdict("cpu_checkpointing", False,
                        "cpu_checkpointing is on but GPU memory grew by 0.26 GB per block, the "
                        "size of one block input: the offload did not take effect")


def test_partial_growth_is_named_as_a_fraction():
    held = tuple(B + i * B // 2 for i in range(10))
    v = verdict("cpu_checkpointing", OFFLOAD, measured(held))
    assert v == Verdict("cpu_checkpointing", False,
                        "cpu_checkpointing is on but GPU memory grew by 0.13 GB per block, "
                        "0.50x one block input: part of each block's activations stayed on the GPU")


def test_growth_in_the_first_half_does_not_count():
    # Offload engines keep the newest groups on the GPU: memory may rise over the first
    # blocks, then stay flat. Only the second half (blocks 5..9) is judged.
    held = (B, 2 * B, 3 * B, 4 * B, 5 * B, *(5 * B,) * 5)
    assert verdict("cpu_checkpointing", OFFLOAD, measured(held)).ok


@pytest.mark.parametrize(("per_block", "ok"), [(B // 20 - 1, True), (B // 20, False)])
def test_flat_means_under_five_percent_of_one_block_input(per_block, ok):
    held = tuple(B + i * per_block for i in range(10))
    assert verdict("cpu_checkpointing", OFFLOAD, measured(held)).ok is ok


def test_growth_is_the_mean_over_the_second_half_not_the_median_step():
    # every other block grows by a whole input: the median step is 0, the mean is B/2
    held = (B, B, 2 * B, 2 * B, 3 * B, 3 * B, 4 * B, 4 * B, 5 * B, 5 * B)
    v = verdict("cpu_checkpointing", OFFLOAD, measured(held))
    assert not v.ok
    assert "0.13 GB per block" in v.message


def test_too_few_blocks_cannot_show_that_memory_stops_growing():
    m = measured(FLAT[:3], plain_held=GROWING[:3])
    assert verdict("cpu_checkpointing", OFFLOAD, m) == Verdict(
        "cpu_checkpointing", False,
        "cpu_checkpointing cannot be checked on 3 blocks: it takes at least 4 to see whether "
        "GPU memory stops growing")


# --- peak --------------------------------------------------------------------------------------


def test_peak_not_below_plain_fails_with_both_numbers():
    m = measured(GROWING, policy_peak=12 * B)
    assert verdict("peak", CKPT, m) == Verdict(
        "peak", False,
        "checkpointing is on but the peak was 3.15 GB, not below the plain run's 3.15 GB: the "
        "policy freed no activation memory")


def test_peak_lower_only_by_noise_fails():
    m = measured(policy_peak=12 * B - B // 25)
    assert verdict("peak", CKPT, m) == Verdict(
        "peak", False,
        "checkpointing is on but the peak was 3.14 GB, only 10.5 MB below the plain run's "
        "3.15 GB (less than 5% of one block input): the policy freed almost no activation memory")


def test_peak_of_offload_without_checkpointing_names_cpu_checkpointing():
    m = measured(policy_peak=13 * B)
    assert verdict("peak", OFFLOAD_ALL, m).message.startswith("cpu_checkpointing is on but the peak")


# --- partition ---------------------------------------------------------------------------------


def test_partition_holds_about_one_nth():
    held = tuple(B + i * B // 2 for i in range(10))
    assert verdict("partition", PARTITION, measured(held, mp_size=2)) == Verdict(
        "partition", True,
        "held checkpoint memory grew by 0.13 GB per block, 0.50 of one block input (about 1/2 "
        "or less)")


def test_unpartitioned_checkpoints_fail_partition():
    assert verdict("partition", PARTITION, measured(GROWING, mp_size=4)) == Verdict(
        "partition", False,
        "partition is on with model-parallel size 4 but held checkpoint memory grew by 0.26 GB "
        "per block, 1.00 of one block input instead of about 1/4: the activations were not "
        "partitioned")


def test_partition_without_model_parallelism_fails():
    assert verdict("partition", PARTITION, measured(mp_size=1)) == Verdict(
        "partition", False,
        "partition is on but the model-parallel size is 1: it shards nothing, and DeepSpeed's "
        "partition path corrupts gradients there")


# --- several ranks (torchrun): one verdict per promise over every rank ---------------------------

HALF = tuple(B + i * B // 2 for i in range(10))  # checkpoint memory grows by 1/2 input per block
PARTITIONED = measured(HALF, mp_size=2, policy_peak=6 * B)
UNPARTITIONED = measured(GROWING, mp_size=2, policy_peak=12 * B, grads=[GradDiff("0.weight", 0.5)])


def test_a_promise_held_on_every_rank_passes_with_rank_0s_numbers():
    assert judge_ranks(PARTITION, [PARTITIONED, PARTITIONED]) == [
        Verdict("peak", True, "on all 2 ranks; rank 0: the peak fell from 3.15 GB to 1.57 GB "
                              "(50% lower)"),
        Verdict("partition", True, "on all 2 ranks; rank 0: held checkpoint memory grew by "
                                   "0.13 GB per block, 0.50 of one block input (about 1/2 or less)"),
        Verdict("gradients", True, "on all 2 ranks; rank 0: gradients match the plain run: max "
                                   "relative error 0, within the float16 tolerance 1e-02"),
    ]


def test_a_promise_that_failed_on_one_rank_fails_and_names_the_rank():
    assert judge_ranks(PARTITION, [PARTITIONED, UNPARTITIONED]) == [
        Verdict("peak", False, "on rank 1 of 2: checkpointing is on but the peak was 3.15 GB, not "
                               "below the plain run's 3.15 GB: the policy freed no activation "
                               "memory"),
        Verdict("partition", False, "on rank 1 of 2: partition is on with model-parallel size 2 "
                                    "but held checkpoint memory grew by 0.26 GB per block, 1.00 of "
                                    "one block input instead of about 1/2: the activations were "
                                    "not partitioned"),
        Verdict("gradients", False, "on rank 1 of 2: gradients differ from the plain run: max "
                                    "relative error 0.5 in 0.weight, above the float16 tolerance "
                                    "1e-02: a saved activation was lost or changed"),
    ]


def test_a_promise_that_failed_on_several_ranks_lists_them_and_gives_the_first_reason():
    (v,) = [v for v in judge_ranks(PARTITION, [UNPARTITIONED, PARTITIONED, UNPARTITIONED])
            if v.promise == "partition"]
    assert v == Verdict("partition", False,
                        "on ranks 0 and 2 of 3; rank 0: partition is on with model-parallel size 2 "
                        "but held checkpoint memory grew by 0.26 GB per block, 1.00 of one block "
                        "input instead of about 1/2: the activations were not partitioned")


def test_one_rank_is_judged_as_one_process():
    assert judge_ranks(PARTITION, [PARTITIONED]) == judge(PARTITION, PARTITIONED)


def test_ranks_judged_on_different_promises_are_refused():
    no_recompute, counted = measured(HALF, mp_size=2), measured(HALF, mp_size=2, recomputes=10)
    with pytest.raises(VerifyError, match=r"^measurements disagree: rank 1 is judged on peak, "
                                          r"partition, recompute, gradients but rank 0 on peak, "
                                          r"partition, gradients$"):
        judge_ranks(PARTITION, [no_recompute, counted])
    with pytest.raises(VerifyError, match=r"^no rank sent measurements to judge$"):
        judge_ranks(PARTITION, [])


def test_growth_per_block_is_the_mean_over_the_second_half():
    assert growth_per_block(HALF) == (B // 2, 5)
    assert growth_per_block((0, 4)) == (4.0, 0)
    with pytest.raises(ValueError, match=r"^growth per block needs at least two readings, got 1$"):
        growth_per_block((5,))


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


# --- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "error", "ok"), [
    ("float32", 1e-5, True), ("float32", 2e-5, False),
    ("float16", 1e-2, True), ("float16", 1.1e-2, False),
    ("bfloat16", 2e-2, True), ("bfloat16", 2.1e-2, False),
])
def test_gradient_tolerance_by_dtype(dtype, error, ok):
    m = measured(grads=[GradDiff("0.weight", error)], dtype=dtype)
    assert verdict("gradients", PLAIN, m).ok is ok


def test_wrong_gradients_name_the_parameter_and_the_tolerance():
    grads = [GradDiff("0.weight", 1e-3), GradDiff("3.weight", 1.0), GradDiff("4.weight", 1.0)]
    m = measured(grads=grads, dtype="bfloat16")
    assert verdict("gradients", PLAIN, m) == Verdict(
        "gradients", False,
        "gradients differ from the plain run: max relative error 1 in 3.weight, above the "
        "bfloat16 tolerance 2e-02: a saved activation was lost or changed")


def test_small_nonzero_error_is_shown_with_its_parameter():
    m = measured(grads=[GradDiff("0.weight", 0.0), GradDiff("1.weight", 3.2e-4)])
    assert verdict("gradients", PLAIN, m).message == (
        "gradients match the plain run: max relative error 3.2e-04 (1.weight), within the "
        "float16 tolerance 1e-02")


def test_an_incomparable_gradient_fails_with_its_reason():
    grads = [GradDiff("0.weight", 0.5), GradDiff("2.bias", math.inf, "got no gradient under the policy")]
    assert verdict("gradients", PLAIN, measured(grads=grads)).message == (
        "gradients differ from the plain run: 2.bias got no gradient under the policy")


def test_no_gradients_at_all_fails():
    assert verdict("gradients", PLAIN, measured(grads=[])).message == (
        "gradients cannot be compared: no parameter got a gradient in either run")


def test_judge_refuses_inconsistent_measurements():
    with pytest.raises(VerifyError, match=r"^measurements disagree: 10 blocks but 10 plain and 9 "
                                          r"policy readings$"):
        judge(OFFLOAD, replace(measured(), policy=RunMeasurement(FLAT[:9], 1, 0.1)))
    with pytest.raises(VerifyError, match=r"^one block input has no bytes"):
        judge(OFFLOAD, measured(block_input_bytes=0))


# --- rendering ---------------------------------------------------------------------------------


def report(pol: Policy = OFFLOAD, m: Measurements | None = None, backend: str = "torch") -> VerifyReport:
    m = m or measured(host_pinned_bytes=9 * B, host_pageable_bytes=0)
    return VerifyReport(pol, backend, m, tuple(judge(pol, m)))


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

PASS  cpu_checkpointing  GPU memory stopped growing: 0 B per block over blocks 5 to 9 (limit 13.1 MB, 5% of one block input); 2.0 block inputs stay on the GPU
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
                          "host_bytes", "gradients", "verdicts"]
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


# --- the factory and inputs --------------------------------------------------------------------


def test_load_factory_finds_a_dotted_attribute():
    assert load_factory("actcfg.verification:VerifyReport.to_dict") is VerifyReport.to_dict


@pytest.mark.parametrize(("spec", "message"), [
    ("actcfg.probes", "--model 'actcfg.probes': write it as pkg.module:factory (for example "
                      "actcfg.probes:linear_chain)"),
    (":linear_chain", "--model ':linear_chain': write it as pkg.module:factory (for example "
                      "actcfg.probes:linear_chain)"),
    ("actcfg.nowhere:f", "--model 'actcfg.nowhere:f': cannot import actcfg.nowhere: No module "
                         "named 'actcfg.nowhere'"),
    ("actcfg.verification:nothing", "--model 'actcfg.verification:nothing': actcfg.verification has no attribute "
                              "'nothing'"),
    ("actcfg.verification:DEFAULT_MODEL", "--model 'actcfg.verification:DEFAULT_MODEL': DEFAULT_MODEL is a "
                                    "str, not a callable factory returning (model, "
                                    "example_inputs)"),
])
def test_load_factory_refusals(spec, message):
    with pytest.raises(VerifyError) as e:
        load_factory(spec)
    assert str(e.value) == message


def test_the_factory_contract():
    torch = pytest.importorskip("torch")
    from actcfg.runtime.step import split_inputs as _split_inputs
    from actcfg.verification.factory import build as _build

    x = torch.ones(2, 3)

    class WithAttribute(torch.nn.Linear):
        example_inputs = (x,)

    class WithMethod(torch.nn.Linear):
        def example_inputs(self):
            return {"input": x}

    model = torch.nn.Linear(3, 3)
    assert _build(lambda: (model, x)) == (model, x)
    assert _build(lambda: WithAttribute(3, 3))[1] == (x,)
    assert _build(lambda: WithMethod(3, 3))[1] == {"input": x}
    assert _split_inputs(x) == ((x,), {})
    assert _split_inputs([x, 1]) == ((x, 1), {})
    assert _split_inputs({"input": x}) == ((), {"input": x})
    with pytest.raises(VerifyError, match=r"^the model factory returned a Linear: return \(model, "
                                          r"example_inputs\), or a model with an `example_inputs` "
                                          r"attribute or method$"):
        _build(lambda: torch.nn.Linear(3, 3))
    with pytest.raises(VerifyError, match=r"^the model factory returned a str as the model, not a "
                                          r"torch.nn.Module$"):
        _build(lambda: ("model", x))
    with pytest.raises(ActcfgError, match=r"^example inputs are a int: give a tensor"):
        _split_inputs(3)


def _handle(torch, model, *, checkpointed=(), groups=None, engine=None, mp_size=None):
    """The runtime's own handle, with the reports `apply` would have recorded."""
    from actcfg.runtime.reports import CheckpointReport, DeepSpeedReport, OffloadReport
    from actcfg.runtime.handle import AppliedPolicy
    from actcfg.policy.schema import Backend

    handle = AppliedPolicy(model, OFFLOAD, Backend.TORCH)
    if checkpointed:
        handle.set_checkpoint(CheckpointReport("full", "torch.utils.checkpoint.checkpoint",
                                               tuple(checkpointed), 1, False, None))
    if groups is not None:
        handle.set_offload(OffloadReport("actcfg.runtime.offload.OffloadEngine", "all_saved", True, None,
                                         1, "cuda:0", tuple(groups), "top-level children of the model"))
    if mp_size is not None:
        handle.set_deepspeed(DeepSpeedReport({}, {}, mp_size, None, ""), dict)
    handle.engine = engine
    return handle


def test_blocks_are_checkpointed_modules_else_offload_groups_else_top_level_children():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _blocks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert _blocks(_handle(torch, model, checkpointed=("0",), groups=("1",)), model) == ("0",)
    assert _blocks(_handle(torch, model, groups=("1",)), model) == ("1",)
    assert _blocks(_handle(torch, model), model) == ("0", "1")


def test_blocks_of_a_rules_policy_are_every_module_a_rule_took():
    torch = pytest.importorskip("torch")
    from actcfg.api import apply
    from actcfg.verification.measure import _blocks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with apply(model, {"version": 1, "checkpoint": {"mode": "rules", "rules": [
            {"modules": ["2"], "mode": "full"}, {"modules": ["0"], "mode": "none"}]}}) as handle:
        assert handle.checkpointed == ("2",)
        assert _blocks(handle, model) == ("0", "2")


def test_host_bytes_are_the_engines_account_read_from_handle_engine():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from actcfg.runtime.offload import OffloadStats
    from actcfg.verification.measure import _host_bytes

    model = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(stats=OffloadStats(pinned_bytes=3, pageable_bytes=4))
    assert _host_bytes(_handle(torch, model, engine=engine, groups=("0",)), None) == (3, 4)
    assert _host_bytes(_handle(torch, model, groups=("0",)), None) == (None, None)


def test_a_handle_without_the_runtimes_attributes_is_not_guessed_at():
    # verify read `handle.groups` and an engine under `handle.offload`, which the runtime never
    # sets: such a handle silently measured the wrong blocks instead of failing.
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from actcfg.runtime.offload import OffloadStats
    from actcfg.verification.measure import _blocks, _host_bytes

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(AttributeError, match=r"'checkpointed'"):
        _blocks(SimpleNamespace(groups=("1",)), model)
    with pytest.raises(AttributeError, match=r"'engine'"):
        _host_bytes(SimpleNamespace(offload=SimpleNamespace(stats=OffloadStats())), None)


def test_a_process_group_counts_with_its_size():
    # apply() takes a ProcessGroup as mpu=; verify once counted it as size 1 and failed `partition`.
    # A fresh process: torch's fake two-rank world needs no default group to exist already, and
    # the DeepSpeed tests keep one for the whole session.
    pytest.importorskip("torch")
    code = (
        "import torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from actcfg.runtime.deepspeed_applier import as_mpu, model_parallel_size\n"
        "dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())\n"
        "print(model_parallel_size(as_mpu(dist.group.WORLD)), model_parallel_size(as_mpu(None)))\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stdout) == (0, "2 1\n"), done.stderr


def test_mp_size_is_what_deepspeed_read_back_after_configure():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _mp_size

    assert _mp_size(_handle(torch, torch.nn.Linear(2, 2), mp_size=4)) == 4
    assert _mp_size(_handle(torch, torch.nn.Linear(2, 2))) == 1


def test_an_mpu_deepspeed_cannot_read_is_refused():
    from actcfg.runtime.deepspeed_applier import model_parallel_size
    from actcfg.errors import PolicyApplyError

    with pytest.raises(PolicyApplyError, match=r"^mpu='object' has neither get_tensor_model_par"):
        model_parallel_size(object())


# --- RNG: both runs draw the same dropout masks; the caller's state is put back ----------------


def _dropout_steps(torch, steps: int) -> list:
    """What a train-mode Dropout draws in each step of one run, seeded as _measure seeds it."""
    from actcfg.verification.measure import _seed_step

    drop = torch.nn.Dropout(0.5).train()
    masks = []
    for step in range(steps):
        _seed_step(step)
        masks.append(drop(torch.ones(256)) != 0)
    return masks


def test_the_plain_and_policy_runs_draw_the_same_dropout_masks_step_by_step():
    # Unseeded, the policy run continued the plain run's RNG stream: other dropout masks, other
    # gradients, and a false `gradients` failure for any model with dropout in train mode.
    torch = pytest.importorskip("torch")
    plain = _dropout_steps(torch, 3)
    torch.rand(7)  # whatever the plain run drew outside the seeded steps
    policy = _dropout_steps(torch, 3)
    assert all(torch.equal(p, q) for p, q in zip(plain, policy))
    assert not torch.equal(plain[0], plain[1])  # each step its own seed, not one mask for all


def test_the_seeded_runs_put_the_callers_rng_state_back():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _caller_rng_kept, _seed_step

    torch.manual_seed(99)
    before = torch.get_rng_state()
    with _caller_rng_kept():
        _seed_step(0)
        torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)


# --- gradient comparison and dtype, on CPU tensors ---------------------------------------------


def _pair(torch):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    b = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1
        q.grad = p.grad.clone()
    return a, b


def test_grad_diffs_are_max_abs_error_over_max_abs_plain():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _grad_diffs

    a, b = _pair(torch)
    b[0].weight.grad[0, 0] += 8.0  # plain max |g| of 0.weight is 16
    b[0].bias.grad = None
    b[1].weight.grad[1, 1] = float("nan")
    assert _grad_diffs(a, b) == (
        GradDiff("0.weight", 0.5),
        GradDiff("0.bias", math.inf, "got no gradient under the policy"),
        GradDiff("1.weight", math.inf, "has a non-finite gradient under the policy"),
    )


def test_equal_gradients_have_zero_error():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _grad_diffs

    a, b = _pair(torch)
    assert [g.error for g in _grad_diffs(a, b)] == [0.0, 0.0, 0.0]


def test_dtype_is_the_loosest_of_parameters_and_inputs():
    torch = pytest.importorskip("torch")
    from actcfg.verification.measure import _loosest_dtype

    model = torch.nn.Linear(2, 2)
    assert _loosest_dtype(model, ((torch.ones(2),), {})) == "float32"
    assert _loosest_dtype(model, ((torch.ones(2, dtype=torch.bfloat16),), {})) == "bfloat16"
    assert _loosest_dtype(model.half(), ((torch.ones(2, dtype=torch.long),), {})) == "float16"


def test_default_loss_is_nonlinear_in_the_output():
    torch = pytest.importorskip("torch")
    from actcfg.runtime.step import default_loss

    out = torch.tensor([1.0, -2.0], dtype=torch.float16)
    loss = default_loss((out, "aux"))
    assert loss.dtype == torch.float32 and loss.item() == 5.0


# --- refusals ------------------------------------------------------------------------------------


def test_verify_refuses_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(VerifyError, match=r"^actcfg verify measures GPU memory and needs a CUDA "
                                          r"GPU, but torch.cuda.is_available\(\) is False here: "
                                          r"run it on a GPU machine$"):
        verify(lambda: None, OFFLOAD)


def test_verify_refuses_zero_steps():
    with pytest.raises(VerifyError, match=r"^steps must be at least 1, got 0$"):
        verify(lambda: None, OFFLOAD, steps=0)


def test_verify_refuses_an_unknown_backend_with_the_choices():
    with pytest.raises(ActcfgError, match=r"^unknown backend 'deepsped': choose one of "
                                          r"deepspeed, hf, lightning, torch$"):
        verify(lambda: None, OFFLOAD, backend="deepsped")


def test_judging_and_rendering_import_no_torch():
    code = ("import sys, actcfg.verification, actcfg.verification.render, actcfg.verification.judge, actcfg.verification.report; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "False\n"


# --- the CLI: exit codes and output --------------------------------------------------------------

SEED_CONFIG = str(ROOT / "configs" / "seed-linear-offload.yaml")
BAD_MODE = str(ROOT / "tests" / "data" / "invalid" / "bad-mode.yaml")


@pytest.fixture
def measured_as(monkeypatch):
    """Replace the GPU measurement (only it) with a synthetic report, to pin the CLI's mapping."""
    import actcfg.verification as module

    def use(rep: VerifyReport) -> list[dict]:
        calls: list[dict] = []

        def fake_verify(factory, cfg, **kwargs):
            calls.append({"factory": factory, "cfg": cfg, **kwargs})
            return rep

        monkeypatch.setattr(module, "require_cuda", lambda: None)
        monkeypatch.setattr(module, "verify", fake_verify)
        return calls

    return use


def test_cli_exit_0_when_every_promise_holds(run_cli, measured_as):
    calls = measured_as(report())
    done = run_cli("verify", SEED_CONFIG, "--steps", "5")
    assert (done.code, done.out, done.err) == (0, render_text(report()), "")
    (call,) = calls
    from actcfg.probes import linear_chain

    assert call["factory"] is linear_chain
    assert call["cfg"] == OFFLOAD
    assert (call["steps"], call["backend"]) == (5, None)


def test_cli_exit_1_when_a_promise_fails_and_json_says_why(run_cli, measured_as):
    failing = report(OFFLOAD, measured(GROWING))
    measured_as(failing)
    done = run_cli("verify", SEED_CONFIG, "--format", "json", "--model", "actcfg.probes:blocks")
    assert done.code == 1
    assert json.loads(done.out)["verdicts"][0] == {
        "promise": "cpu_checkpointing", "ok": False,
        "message": "cpu_checkpointing is on but GPU memory grew by 0.26 GB per block, the size of "
                   "one block input: the offload did not take effect"}


def test_cli_writes_the_plot(run_cli, measured_as, tmp_path):
    pytest.importorskip("matplotlib")
    measured_as(report())
    done = run_cli("verify", SEED_CONFIG, "--plot", tmp_path / "memory.png")
    assert done.code == 0
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plot_without_matplotlib_is_refused_before_measuring(run_cli, measured_as, monkeypatch):
    calls = measured_as(report())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    done = run_cli("verify", SEED_CONFIG, "--plot", "memory.png")
    assert (done.code, done.err) == (2, "actcfg: error: --plot needs matplotlib, which is not installed: "
                                        "python -m pip install -e '.[plot]' in the actcfg checkout\n")
    assert calls == []


@pytest.mark.parametrize(("argv", "err"), [
    (["--model", "actcfg.probes"], "actcfg: error: --model 'actcfg.probes': write it as "
                                   "pkg.module:factory (for example actcfg.probes:linear_chain)\n"),
    (["--steps", "0"], "actcfg: error: --steps must be at least 1, got 0\n"),
])
def test_cli_usage_errors_exit_2(run_cli, measured_as, argv, err):
    calls = measured_as(report())
    done = run_cli("verify", SEED_CONFIG, *argv)
    assert (done.code, done.out, done.err) == (2, "", err)
    assert calls == []


def test_cli_invalid_config_prints_the_validate_diagnostics_and_exits_1(run_cli, measured_as):
    # STYLE rule 8: an invalid policy is 1, as `validate` and `translate` say; it was 2.
    calls = measured_as(report())
    done = run_cli("verify", BAD_MODE)
    assert (done.code, done.out) == (1, "")
    assert done.err.startswith(f"{BAD_MODE}:3:9: error bad-choice: ")
    assert calls == []


def test_cli_unreadable_config_exits_2(run_cli, measured_as, tmp_path):
    calls = measured_as(report())
    done = run_cli("verify", tmp_path / "missing.yaml")
    assert (done.code, done.out) == (2, "")
    assert done.err.startswith(f"{tmp_path / 'missing.yaml'}:") and " error file-not-found: " in done.err
    assert calls == []


@pytest.mark.parametrize(("m", "code"), [(None, 2), (measured(GROWING), 1)])
def test_cli_plot_write_error_does_not_hide_a_failed_verify(run_cli, measured_as, tmp_path, m, code):
    # The plot is written after the verdicts: a failed promise still exits 1, only a passing
    # run exits 2 for the write error.
    pytest.importorskip("matplotlib")
    rep = report(OFFLOAD, m)
    measured_as(rep)
    where = tmp_path / "no-such-dir" / "memory.png"
    done = run_cli("verify", SEED_CONFIG, "--plot", where)
    assert (done.code, done.out) == (code, render_text(rep))
    assert done.err == (f"actcfg: error: --plot: cannot write {where}: No such file or "
                        "directory\n")


@pytest.mark.parametrize(("argv", "started"), [
    ([SEED_CONFIG], False),
    ([SEED_CONFIG, "--backend", "deepspeed"], True),
    ([str(ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml")], True),
    ([str(ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"), "--backend", "torch"], False),
])
def test_cli_starts_a_process_group_only_for_the_deepspeed_backend(
        run_cli, measured_as, monkeypatch, argv, started):
    """The CLI scopes the measurement in `_process_group(backend)`, which starts a one-process
    group for the deepspeed backend only (here it records instead of starting NCCL)."""
    import contextlib

    import actcfg.cli as cli

    measured_as(report())
    backends: list[str] = []

    @contextlib.contextmanager
    def recorded(backend):
        backends.append(backend)
        yield

    real = cli._process_group
    monkeypatch.setattr(cli, "_process_group", recorded)
    done = run_cli("verify", *argv)
    assert done.code == 0
    assert backends == ["deepspeed" if started else "torch"]
    import torch.distributed as dist

    before = dist.is_initialized()
    with real(cli.Backend.TORCH):  # the torch backend starts nothing
        assert dist.is_initialized() == before


def test_cli_without_a_gpu_exits_2_with_the_reason():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "actcfg", "verify", SEED_CONFIG],
                          capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("actcfg: error: actcfg verify measures GPU memory and needs a CUDA "
                           "GPU, but torch.cuda.is_available() is False here: run it on a GPU "
                           "machine\n")


# --- rules and a plan's prediction --------------------------------------------------------------


def _rules(predicted=None, offload=True) -> Policy:
    section = {"mode": "rules", "rules": [
        {"modules": ["0", "1"], "mode": "none", "cpu_checkpointing": offload},
        {"modules": ["Linear"], "mode": "full"}]}
    if predicted is not None:
        section["predicted"] = predicted
    return policy(checkpoint=section)


def test_rules_promise_the_peak_their_offload_and_recompute():
    m = measured(recomputes=8, offloaded_bytes=2 * B)
    assert [v.promise for v in judge(_rules(), m)] == ["peak", "offload", "recompute", "gradients"]
    assert [v.promise for v in judge(_rules(offload=False), m)] == ["peak", "recompute", "gradients"]
    assert verdict("offload", _rules(), m).message == (
        "the rules that offload moved 0.52 GB to the host in the last step")
    nothing = verdict("offload", _rules(), measured(recomputes=8, offloaded_bytes=0))
    assert not nothing.ok and nothing.message.endswith("copied 0 bytes to the host in the last step: "
                                                       "the offload did not take effect")


@pytest.mark.parametrize(("step_ms", "peak", "fails"), [
    (200.0, 3 * B, False),  # exactly as measured (200 ms, 3 block inputs)
    (219.0, int(2.75 * B), False),  # +9.5% and -8.3%: reported, not judged
    (230.0, 3 * B, True),  # +15% step time
    (200.0, int(3.5 * B), True),  # +17% peak
])
def test_a_prediction_is_reported_and_fails_only_more_than_ten_percent_off(step_ms, peak, fails):
    pol = _rules({"step_time_ms": step_ms, "peak": peak})
    m = measured(recomputes=8, offloaded_bytes=2 * B)
    verdicts = judge(pol, m)
    assert ("prediction" in [v.promise for v in verdicts]) is fails
    text = render_text(VerifyReport(pol, "torch", m, tuple(verdicts)))
    step_err = f"{(step_ms - 200) / 200:+.0%}"
    assert f"predicted        step {step_ms:.1f} ms ({step_err} of measured), peak " in text
    data = json.loads(render_json(VerifyReport(pol, "torch", m, tuple(verdicts))))
    assert data["predicted"]["step_time_ms"] == step_ms and data["predicted"]["peak_bytes"] == peak
    assert data["predicted"]["step_time_error"] == pytest.approx((step_ms - 200) / 200)
    assert data["predicted"]["measured_peak_bytes"] == 3 * B
    if fails:
        (v,) = [v for v in verdicts if v.promise == "prediction"]
        assert not v.ok and v.message.startswith(f"the plan predicted {step_ms:.1f} ms and a peak of ")
        assert v.message.endswith("more than 10% off; plan again on this machine (`actcfg plan`)")


def test_no_prediction_no_line():
    m = measured(recomputes=8, offloaded_bytes=2 * B)
    assert "predicted" not in render_text(VerifyReport(_rules(), "torch", m, tuple(judge(_rules(), m))))
    assert "predicted" not in json.loads(render_json(VerifyReport(_rules(), "torch", m, ())))
