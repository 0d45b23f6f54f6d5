"""`actcfg plan` under torchrun on two GPUs: the ranks plan together, one file is written, and
`actcfg verify` under torchrun passes on every rank against it.

Run on a machine with two GPUs (as tests/runtime/test_distributed.py):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python -m pytest -m distributed -q tests/plan/test_plan_distributed.py

The same reduction runs on two and four gloo ranks on the CPU in tests/plan/test_consensus.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = float(os.environ.get("ACTCFG_MULTIRANK_TIMEOUT", "900"))
WORLD = 2


def torchrun(*argv: str) -> subprocess.CompletedProcess[str]:
    # tests/ on the path: the factory is test_plan_cuda:small_blocks (8 blocks, d_model 1024).
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)])}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
         "-m", "actcfg", *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=TIMEOUT)


def test_plan_under_torchrun_writes_one_plan_that_verify_passes_on_every_rank(tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text("version: 1\ncheckpoint: {mode: auto, modules: [Block]}\nmemory_budget: 1GiB\n"
                      "pin_budget_per_node: 8GiB\n")
    out = tmp_path / "plan.yaml"
    done = torchrun("plan", str(config), "--model", "test_plan_cuda:small_blocks", "-o", str(out),
                    "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    body = json.loads(done.stdout)  # one report: rank 0's (the others print nothing)
    assert body["ok"] and body["written"] == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto.yaml", "plan.yaml"]
    notes = body["profile"]["notes"]
    assert any(n.startswith(f"reduced over {WORLD} ranks: ") for n in notes), notes
    assert any(n.startswith(f"copy bandwidth with {WORLD} ranks copying at once: ") for n in notes), notes
    # the figures the plan priced copies at are the lower of alone and together
    assert 0 < body["profile"]["d2h_gbps"] < 100
    print("plan under torchrun:", json.dumps({k: body[k] for k in ("measured", "predicted", "plain")}),
          [n for n in notes if n.startswith("copy bandwidth")])
    verified = torchrun("verify", str(out), "--model", "test_plan_cuda:small_blocks")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count("actcfg verify:") == 1
    assert f"{WORLD} ranks" in verified.stdout.splitlines()[0], verified.stdout
