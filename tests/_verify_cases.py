"""What the verify tests share: synthetic measurements and the policies they are judged against
(no torch: judging and rendering run without it)."""

from __future__ import annotations

from pathlib import Path

from actcfg.policy.schema import Policy
from actcfg.verification import GradDiff, Measurements, RunMeasurement, Verdict, VerifyReport, judge

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


HALF = tuple(B + i * B // 2 for i in range(10))  # checkpoint memory grows by 1/2 input per block
PARTITIONED = measured(HALF, mp_size=2, policy_peak=6 * B)
UNPARTITIONED = measured(GROWING, mp_size=2, policy_peak=12 * B, grads=[GradDiff("0.weight", 0.5)])


def report(pol: Policy = OFFLOAD, m: Measurements | None = None, backend: str = "torch") -> VerifyReport:
    m = m or measured(host_pinned_bytes=9 * B, host_pageable_bytes=0)
    return VerifyReport(pol, backend, m, tuple(judge(pol, m)))
