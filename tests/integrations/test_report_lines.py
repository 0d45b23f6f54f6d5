"""What a user sees from the trainer callbacks, captured from real runs in a fresh process with no
logging set up (tests/data/trainer_runs/): one line when the policy takes effect and one after
the first step, in the stream where the trainer's own output goes at its default verbosity.

- Hugging Face: Trainer's logger stays at WARNING (its INFO lines do not show); it writes its
  metrics to stdout with `tqdm.write`, or `print` under `disable_tqdm`. The lines go there, and
  not under `log_level="error"`.
- Lightning: its `lightning.pytorch` logger shows INFO on stderr ("GPU available: ..."); the
  lines go through `rank_zero_info` beside them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "trainer_runs"
HF_APPLIED = ("actcfg: backend torch; full checkpointing of 3 modules (model.layers.0, "
              "model.layers.1, model.layers.2) via torch.utils.checkpoint.checkpoint")
PL_APPLIED = ("actcfg: backend torch; full checkpointing of 3 modules (model.blocks.0, "
              "model.blocks.1, model.blocks.2) via torch.utils.checkpoint.checkpoint")
MEASURED = "actcfg: after the first step: 3 checkpointed forwards, 3 recomputed in backward"


def run(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    # A run as a user starts it: not inside the process group another test left in this
    # environment (the DeepSpeed fixture's MASTER_PORT would make accelerate join it).
    dropped = ("TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS", "MASTER_ADDR", "MASTER_PORT", "RANK",
               "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(RUNS / script), str(out)], env=env, cwd=out.parent,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def sections(text: str) -> dict[str, list[str]]:
    """The actcfg lines of each `=== name` section."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("=== "):
            current = out.setdefault(line[4:], [])
        elif current is not None and line.startswith("actcfg:"):
            current.append(line)
    return out


def test_hf_trainer_prints_the_lines_where_it_prints_its_metrics(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    done = run("hf_lines.py", tmp_path / "out")
    assert sections(done.stdout) == {
        "default": [HF_APPLIED, MEASURED],
        "disable_tqdm": [HF_APPLIED, MEASURED],
        "log_level_error": [],
    }
    assert "{'train_runtime'" in done.stdout  # the Trainer's own metrics, in the same stream
    assert "actcfg:" not in done.stderr


def test_lightning_logs_the_lines_beside_its_own_info_lines(tmp_path):
    pytest.importorskip("lightning")
    done = run("lightning_lines.py", tmp_path / "out")
    lines = done.stderr.splitlines()
    assert any(line.startswith("GPU available: ") for line in lines)  # Lightning's own INFO
    assert [line for line in lines if line.startswith("actcfg:")] == [PL_APPLIED, MEASURED]
    assert "actcfg:" not in done.stdout
