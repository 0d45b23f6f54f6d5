"""A policy's first step peaks where its later steps do: cuBLAS's workspaces are allocated when
the policy is applied, not inside the first step (actcfg.runtime.workspaces).

Each case runs in a fresh Python process, so that nothing before `apply` has run a matmul.
Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/runtime/test_workspaces_cuda.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

MiB = 1 << 20

FIRST_STEPS = r"""
import json, sys
import torch
import actcfg
from actcfg.probes import blocks

torch.manual_seed(0)
model, x = blocks(n=4, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)
policy = json.loads(sys.argv[1])
handle = actcfg.apply(model, policy) if policy else None
peaks = []
for _ in range(3):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(x)
    out.float().pow(2).mean().backward()
    del out
    torch.cuda.synchronize()
    peaks.append(torch.cuda.max_memory_allocated() - start)
print(json.dumps(peaks))
"""


def first_steps(policy: dict | None) -> list[int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", FIRST_STEPS, json.dumps(policy)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("policy", [
    {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}},
    {"version": 1, "checkpoint": {"mode": "full", "modules": ["Block"]}, "cpu_checkpointing": True},
    {"version": 1, "checkpoint": {"mode": "rules", "rules": [
        {"modules": ["blocks.0"], "mode": "none", "cpu_checkpointing": True},
        {"modules": ["blocks.1", "blocks.2"], "mode": "full"}]}},
], ids=["full", "full_offload", "rules"])
def test_a_fresh_process_first_step_peaks_no_higher_than_its_later_steps(policy):
    """No higher, not equal: an offload plan's first step sends its groups before it knows which
    stay for backward (actcfg.runtime.offload): on the H200 a rules plan of that kind on the
    full-size blocks stack peaked 53 MiB below its later steps in its first step, and this
    test's `rules` case failed an equality. Without the workspaces allocated at `apply`, a fresh
    process's first step peaked 64 MiB above its later ones (2 x 32 MiB, torch 2.11)."""
    peaks = first_steps(policy)
    assert peaks[0] <= max(peaks[1:]) + MiB, (
        f"first step {peaks[0] / MiB:.1f} MiB above its start, later steps {[p / MiB for p in peaks[1:]]} MiB")


def test_without_a_policy_the_first_step_carries_the_workspaces():
    """The control: what the cases above would measure if `apply` allocated nothing (a plain
    first step in a fresh process holds the workspaces above its start)."""
    peaks = first_steps(None)
    assert peaks[0] - peaks[2] >= 8 * MiB, [p / MiB for p in peaks]
