"""Judge measurements against a policy's promises: one verdict, in one sentence, per promise.

Pure: plain numbers in, verdicts out, no torch, so the rules are tested with synthetic numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from actcfg.errors import VerifyError
from actcfg.policy.schema import Policy
from actcfg.units import decimal_size
from actcfg.verification.report import (
    Measurements,
    Verdict,
    growth_per_block,
    tolerance,
    worst_grad,
)

__all__ = ["FLAT_FRACTION", "MIN_BLOCKS", "PARTITION_SLACK", "PREDICTION_SLACK", "judge", "judge_ranks",
           "prediction_errors"]

FLAT_FRACTION = 0.05
"""cpu_checkpointing: memory stops growing when it grows by less than this share of one block
input per block over the second half of the stack."""

PARTITION_SLACK = 1.25
"""partition: held checkpoint memory per block may be this many times 1/n of one block input
(plus FLAT_FRACTION of one block input for the odd small tensor)."""

MIN_BLOCKS = 4
"""Fewest measured blocks for a growth rate over the second half of the stack."""

PREDICTION_SLACK = 0.10
"""A plan's prediction (`checkpoint.predicted`) is reported beside the measurement; it becomes a
failed verdict only when the step time or the peak is off by more than this share."""

def _judge_offload(m: Measurements) -> Verdict:
    n = len(m.blocks)
    if n < MIN_BLOCKS:
        return Verdict("cpu_checkpointing", False,
                       f"cpu_checkpointing cannot be checked on {n} block{'s' * (n != 1)}: "
                       f"it takes at least {MIN_BLOCKS} to see whether GPU memory stops growing")
    one = m.block_input_bytes
    # Read before the last block: its activations stay on the GPU for backward, which needs
    # them first (the engine's open group), while the blocks before it leave storage by storage,
    # so memory after it is higher by design, not by growth.
    growth, start = growth_per_block(m.policy.held[:-1])
    span = f"blocks {m.blocks[start]} to {m.blocks[-2]}"
    if m.offloaded_bytes == 0:
        return Verdict("cpu_checkpointing", False,
                       "cpu_checkpointing is on but actcfg's offload engine copied 0 bytes to the "
                       "host in the last step: the offload did not take effect")
    if growth < FLAT_FRACTION * one:
        resident = m.policy.held[-1] / one
        moved = ("" if m.offloaded_bytes is None
                 else f"; {decimal_size(m.offloaded_bytes)} offloaded per step")
        return Verdict("cpu_checkpointing", True,
                       f"GPU memory stopped growing: {decimal_size(growth)} per block over {span} "
                       f"(limit {decimal_size(FLAT_FRACTION * one)}, 5% of one block input); "
                       f"{resident:.1f} block inputs stay on the GPU{moved}")
    ratio = growth / one
    size = ("the size of one block input" if 0.9 <= ratio <= 1.1
            else f"{ratio:.2f}x one block input")
    effect = ("the offload did not take effect" if ratio >= 0.9
              else "part of each block's activations stayed on the GPU")
    return Verdict("cpu_checkpointing", False,
                   f"cpu_checkpointing is on but GPU memory grew by {decimal_size(growth)} per "
                   f"block, {size}: {effect}")


def _judge_held(m: Measurements) -> Verdict | None:
    """Checkpointed blocks whose inputs are offloaded: backward may hold the group in use and
    the one being prefetched, and at the turn the last `keep_last` groups (the group still open
    at the end of forward, the last block's input, stays whatever keep_last says).

    Through a recompute's peak the engine holds one group fewer: the block below comes back
    once the block's backward is past that peak (its gradients say so). That count is reported,
    not judged: where the gradients cannot say it in time (a compiled block, frozen weights,
    torch.autograd.grad) the engine reloads at the recompute's start, by design, and holds the
    one more that the backward allowance already covers."""
    if m.backward_held_bytes is None or m.keep_last is None:
        return None
    one = m.block_input_bytes
    allowed = max(m.keep_last, 1) + 1
    held = m.backward_held_bytes / one
    forward = "" if m.forward_held_bytes is None else (
        f"; forward held {m.forward_held_bytes / one:.1f} at most")
    recompute = ""
    if m.recompute_held_bytes is not None:
        through = m.recompute_held_bytes / one
        recompute = (f"; through a recompute {through:.1f}, against {allowed - 1} where the block "
                     "below waits for the block's gradients")
        if through > allowed - 1 + FLAT_FRACTION:
            # Not a failure (the backward allowance covers it), but say why, or "2.0 against 1"
            # reads as one.
            recompute += (" (here it came back as the recompute began: the block's gradients "
                          "could not say its peak was past in time, as for a compiled block, "
                          "frozen or FSDP2-sharded weights, or one layer whose gradient comes "
                          "as its backward ends)")
    text = (f"backward held {held:.1f} block inputs on the GPU at most, against the "
            f"{allowed} the schedule allows (keep_last {m.keep_last}: the block in use and the "
            f"one being prefetched){forward}{recompute}")
    if held > allowed + FLAT_FRACTION:
        return Verdict("held inputs", False, f"cpu_checkpointing is on but {text}: groups are "
                                             "released late")
    return Verdict("held inputs", True, text)


def _judge_peak(policy: Policy, m: Measurements) -> Verdict:
    plain, ours = m.plain.peak, m.policy.peak
    # "Below" by more than noise: 5% of one block input, as for flat memory.
    margin = FLAT_FRACTION * m.block_input_bytes
    if ours < plain - margin:
        return Verdict("peak", True,
                       f"the peak fell from {decimal_size(plain)} to {decimal_size(ours)} "
                       f"({(plain - ours) / plain:.0%} lower)")
    what = "checkpointing" if policy.checkpoint.mode != "none" else "cpu_checkpointing"
    if ours < plain:
        return Verdict("peak", False,
                       f"{what} is on but the peak was {decimal_size(ours)}, only "
                       f"{decimal_size(plain - ours)} below the plain run's {decimal_size(plain)} "
                       "(less than 5% of one block input): the policy freed almost no "
                       "activation memory")
    return Verdict("peak", False,
                   f"{what} is on but the peak was {decimal_size(ours)}, not below the plain "
                   f"run's {decimal_size(plain)}: the policy freed no activation memory")


def _judge_partition(m: Measurements) -> Verdict:
    n = m.mp_size
    if n <= 1:
        return Verdict("partition", False,
                       f"partition is on but the model-parallel size is {n}: it shards nothing, "
                       "and DeepSpeed's partition path corrupts gradients there")
    if len(m.blocks) < MIN_BLOCKS:
        return Verdict("partition", False,
                       f"partition cannot be checked on {len(m.blocks)} blocks: it takes at "
                       f"least {MIN_BLOCKS}")
    one = m.block_input_bytes
    growth, _ = growth_per_block(m.policy.held)
    limit = PARTITION_SLACK * one / n + FLAT_FRACTION * one
    if growth <= limit:
        return Verdict("partition", True,
                       f"held checkpoint memory grew by {decimal_size(growth)} per block, "
                       f"{growth / one:.2f} of one block input (about 1/{n} or less)")
    return Verdict("partition", False,
                   f"partition is on with model-parallel size {n} but held checkpoint memory grew "
                   f"by {decimal_size(growth)} per block, {growth / one:.2f} of one block input "
                   f"instead of about 1/{n}: the activations were not partitioned")


def _judge_gradients(m: Measurements) -> Verdict:
    tol = tolerance(m.dtype)
    worst = worst_grad(m.grads)
    if worst is None:
        return Verdict("gradients", False,
                       "gradients cannot be compared: no parameter got a gradient in either run")
    if worst.note is not None:
        return Verdict("gradients", False,
                       f"gradients differ from the plain run: {worst.name} {worst.note}")
    if worst.error <= tol:
        shown = "0" if worst.error == 0 else f"{worst.error:.1e} ({worst.name})"
        return Verdict("gradients", True,
                       f"gradients match the plain run: max relative error {shown}, within the "
                       f"{m.dtype} tolerance {tol:.0e}")
    return Verdict("gradients", False,
                   f"gradients differ from the plain run: max relative error {worst.error:.2g} in "
                   f"{worst.name}, above the {m.dtype} tolerance {tol:.0e}: a saved activation "
                   "was lost or changed")


def _judge_recompute(m: Measurements) -> Verdict:
    if m.recomputes:
        return Verdict("recompute", True,
                       f"{m.recomputes} checkpointed module calls ran again in each backward")
    if m.compile_ms is not None and m.plain.held and m.policy.held:
        # Compiled, the checkpoint is an op of the graph and its recompute runs inside backward's
        # graph, where the runtime's counter (a Python call) never runs. What shows it is the
        # memory: checkpointed blocks keep no activations, so the memory held after the blocks
        # falls well below the plain run's.
        plain, ours = m.plain.held[-1], m.policy.held[-1]
        said = (f"memory held after the last block was {ours / 2**20:.1f} MiB against the plain "
                f"run's {plain / 2**20:.1f} MiB")
        if ours * 2 <= plain:
            return Verdict("recompute", True,
                           "compiled, the recompute runs inside torch.compile's backward graph, "
                           f"where actcfg cannot count it; {said}: the checkpointed blocks kept "
                           "no activations")
        return Verdict("recompute", False,
                       "compiled, the recompute runs inside torch.compile's backward graph, where "
                       f"actcfg cannot count it, and {said}: the checkpointed blocks kept their "
                       "activations, so nothing was freed")
    return Verdict("recompute", False,
                   "checkpointing is on but no checkpointed module ran again in backward: "
                   "nothing was recomputed, so nothing was freed")


def _checkpoints(policy: Policy) -> bool:
    ckpt = policy.checkpoint
    return ckpt.mode in ("full", "selective") or (
        ckpt.mode == "rules" and any(r.mode != "none" for r in ckpt.rules))


def _rules_offload(policy: Policy) -> bool:
    ckpt = policy.checkpoint
    return ckpt.mode == "rules" and any(r.cpu_checkpointing for r in ckpt.rules)


def prediction_errors(policy: Policy, m: Measurements) -> tuple[float, float] | None:
    """(step time, peak) relative errors of the plan's prediction, (predicted - measured) /
    measured; None when the policy carries no prediction."""
    predicted = getattr(policy.checkpoint, "predicted", None)
    if predicted is None or m.policy.step_time_s <= 0 or m.policy.peak <= 0:
        return None
    measured_ms = m.policy.step_time_s * 1000
    return ((predicted.step_time_ms - measured_ms) / measured_ms,
            (predicted.peak - m.policy.peak) / m.policy.peak)


def _judge_prediction(policy: Policy, m: Measurements) -> Verdict | None:
    errors = prediction_errors(policy, m)
    if errors is None or max(abs(e) for e in errors) <= PREDICTION_SLACK:
        return None
    predicted = policy.checkpoint.predicted
    return Verdict("prediction", False,
                   f"the plan predicted {predicted.step_time_ms:.1f} ms and a peak of "
                   f"{decimal_size(predicted.peak)}, and this run measured "
                   f"{m.policy.step_time_s * 1000:.1f} ms ({errors[0]:+.0%}) and "
                   f"{decimal_size(m.policy.peak)} ({errors[1]:+.0%}): more than "
                   f"{PREDICTION_SLACK:.0%} off; plan again on this machine (`actcfg plan`)")


def _judge_rules_offload(m: Measurements) -> Verdict:
    if m.offloaded_bytes:
        return Verdict("offload", True, f"the rules that offload moved {decimal_size(m.offloaded_bytes)} "
                                        "to the host in the last step")
    return Verdict("offload", False, "a rule sets cpu_checkpointing, but actcfg's offload engine "
                                     "copied 0 bytes to the host in the last step: the offload "
                                     "did not take effect")


def judge(policy: Policy, measurements: Measurements) -> list[Verdict]:
    """One verdict per promise the policy makes, from plain numbers (imports no torch).

    cpu_checkpointing: GPU memory stops growing per block; checkpointing or cpu_checkpointing:
    the peak is below the plain run's; partition: held checkpoint memory is about 1/n of one
    block input per block; a rule that offloads: bytes went to the host; checkpointing by
    actcfg, where the runtime counted it: modules ran again in backward; always: gradients
    equal the plain run's within the dtype tolerance; a plan's prediction (rules with
    `predicted`): only when it is more than 10% off.
    """
    m = measurements
    if not (len(m.blocks) == len(m.plain.held) == len(m.policy.held)):
        raise VerifyError(
            f"measurements disagree: {len(m.blocks)} blocks but {len(m.plain.held)} plain and "
            f"{len(m.policy.held)} policy readings")
    if m.block_input_bytes <= 0:
        raise VerifyError("one block input has no bytes: the blocks take no tensor input, so "
                          "memory per block cannot be judged")
    out: list[Verdict] = []
    if policy.cpu_checkpointing:
        out.append(_judge_offload(m))
        if policy.checkpoint.mode in ("full", "selective") and (held := _judge_held(m)) is not None:
            out.append(held)
    if policy.checkpoint.mode != "none" or policy.cpu_checkpointing:
        out.append(_judge_peak(policy, m))
    if policy.partition:
        out.append(_judge_partition(m))
    if _rules_offload(policy):
        out.append(_judge_rules_offload(m))
    if m.recomputes is not None and _checkpoints(policy):
        out.append(_judge_recompute(m))
    out.append(_judge_gradients(m))
    prediction = _judge_prediction(policy, m)
    if prediction is not None:
        out.append(prediction)
    return out


def judge_ranks(policy: Policy, ranks: Sequence[Measurements]) -> list[Verdict]:
    """One verdict per promise over every rank's measurements (imports no torch).

    Each rank is judged as `judge` judges one process (partition: each rank's held checkpoint
    memory per block is about 1/n of one block input). A promise holds when it held on every
    rank; the sentence says which ranks it failed on and gives the first one's reason.
    """
    if not ranks:
        raise VerifyError("no rank sent measurements to judge")
    per_rank = [judge(policy, m) for m in ranks]
    if len(per_rank) == 1:
        return per_rank[0]
    n = len(per_rank)
    promises = [v.promise for v in per_rank[0]]
    for rank, verdicts in enumerate(per_rank):
        if [v.promise for v in verdicts] != promises:
            raise VerifyError(
                f"measurements disagree: rank {rank} is judged on "
                f"{', '.join(v.promise for v in verdicts)} but rank 0 on {', '.join(promises)}")
    out: list[Verdict] = []
    for i, promise in enumerate(promises):
        verdicts = [vs[i] for vs in per_rank]
        failed = [rank for rank, v in enumerate(verdicts) if not v.ok]
        if not failed:
            out.append(Verdict(promise, True, f"on all {n} ranks; rank 0: {verdicts[0].message}"))
        elif len(failed) == 1:
            out.append(Verdict(promise, False,
                               f"on rank {failed[0]} of {n}: {verdicts[failed[0]].message}"))
        else:
            which = ", ".join(str(r) for r in failed[:-1]) + f" and {failed[-1]}"
            out.append(Verdict(promise, False, f"on ranks {which} of {n}; rank {failed[0]}: "
                                               f"{verdicts[failed[0]].message}"))
    return out
