"""verification.judge without a GPU: the promises a policy makes and the verdicts on synthetic
measurements (one rank and several), gradients and a rules policy's prediction."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from actcfg.errors import VerifyError
from actcfg.policy.schema import Policy
from actcfg.verification import GradDiff, RunMeasurement, Verdict, VerifyReport, judge, judge_ranks
from actcfg.verification.render import render_json, render_text
from actcfg.verification.report import growth_per_block

from _verify_cases import (
    B,
    CKPT,
    FLAT,
    GROWING,
    HALF,
    OFFLOAD,
    OFFLOAD_ALL,
    PARTITION,
    PARTITIONED,
    PLAIN,
    UNPARTITIONED,
    measured,
    policy,
    verdict,
)


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
                "GPU memory stopped growing: 0 B per block over blocks 4 to 8 (limit 13.1 MB, "
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


def test_a_compiled_checkpoint_is_judged_by_the_memory_it_freed():
    """Compiled, the recompute runs inside torch.compile's backward graph, where the runtime's
    counter never runs (0 on the H200); the memory held after the blocks is the evidence, and a
    compiled checkpoint that kept its activations still fails."""
    freed = verdict("recompute", CKPT, measured(FLAT, recomputes=0, compile_ms=2400.0))
    assert freed.ok and "where actcfg cannot count it; memory held after the last block was 500.0 MiB " \
                        "against the plain run's 2500.0 MiB: the checkpointed blocks kept no activations" in freed.message
    kept = verdict("recompute", CKPT, measured(GROWING, recomputes=0, compile_ms=2400.0))
    assert not kept.ok and "the checkpointed blocks kept their activations, so nothing was freed" in kept.message
    eager = verdict("recompute", CKPT, measured(FLAT, recomputes=0))
    assert not eager.ok  # eager, a zero count is the proof that nothing was recomputed
