"""How fast is `actcfg validate`? Cold CLI time against DeepSpeed's own config path, and
files per second in-process.

    python benchmarks/validate_speed.py [--runs 7] [--files 1000]

1. Cold wall time of `python -m actcfg validate configs/deepspeed-cpu-checkpointing.yaml`
   (a fresh interpreter each run; median of --runs).
2. Cold wall time of parsing the same policy through DeepSpeed: a fresh interpreter that
   imports deepspeed, builds the `activation_checkpointing` JSON and constructs
   `DeepSpeedActivationCheckpointingConfig(param_dict)` (median of --runs), and the ratio.
3. Files per second: `check_file` in-process on --files generated policies.

Targets (issue 2): under 150 ms cold for one file; at least 10x faster than DeepSpeed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
CONFIG = ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"

DEEPSPEED_PARSE = """
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
section = {"partition_activations": False, "contiguous_memory_optimization": False,
           "number_checkpoints": None, "cpu_checkpointing": True,
           "synchronize_checkpoint_boundary": False, "profile": False}
config = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
assert config.cpu_checkpointing is True
"""


def _cold(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return times


def _generated(directory: Path, n: int) -> list[Path]:
    modes = [
        "checkpoint: {mode: full, modules: [Block]}\ncpu_checkpointing: true\n",
        "checkpoint: {mode: selective, modules: ['layers.*'], every: 2}\n",
        "checkpoint: {mode: none}\ncpu_checkpointing: true\npin_budget: 8GiB\n",
        "backend: deepspeed\ncheckpoint: {mode: full, modules: [Block]}\npartition: true\n"
        "contiguous: true\nnum_checkpoints: 12\n",
    ]
    paths = []
    for i in range(n):
        path = directory / f"p{i:04d}.yaml"
        path.write_text(f"# generated policy {i}\nversion: 1\n{modes[i % len(modes)]}")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--files", type=int, default=1000)
    args = parser.parse_args()

    python = sys.executable
    _cold([python, "-m", "actcfg", "validate", str(CONFIG)], 1)  # warm the OS file cache
    ours = statistics.median(_cold([python, "-m", "actcfg", "validate", str(CONFIG)], args.runs))
    bare = statistics.median(_cold([python, "-c", "pass"], args.runs))
    print(f"actcfg validate, cold:        {ours * 1000:7.1f} ms  (median of {args.runs}; "
          f"bare interpreter {bare * 1000:.1f} ms)")
    try:
        theirs = statistics.median(_cold([python, "-c", DEEPSPEED_PARSE], args.runs))
    except SystemExit as e:
        print(f"DeepSpeed config path: not measured ({str(e).splitlines()[0]})")
        theirs = None
    if theirs is not None:
        print(f"DeepSpeed config parse, cold: {theirs * 1000:7.1f} ms  (median of {args.runs})")
        print(f"ratio: actcfg is {theirs / ours:.1f}x faster than DeepSpeed's own config path")

    from actcfg.checker import check_file

    with tempfile.TemporaryDirectory() as tmp:
        paths = _generated(Path(tmp), args.files)
        started = time.perf_counter()
        invalid = sum(check_file(p)[0] is None for p in paths)
        elapsed = time.perf_counter() - started
    print(f"in-process: {args.files / elapsed:,.0f} files/s ({args.files} files in {elapsed:.2f} s, "
          f"{invalid} invalid)")
    print(f"targets: cold < 150 ms: {'met' if ours < 0.150 else 'MISSED'}; "
          f">= 10x DeepSpeed: {'met' if theirs and theirs / ours >= 10 else 'MISSED'}")


if __name__ == "__main__":
    main()
