"""`--help`'s examples and exit codes, the program's and each command's: one table, so the
examples can be run as a set (tests/cli/test_cli_help.py) and read without importing a command."""

from __future__ import annotations

__all__ = ["EPILOGS"]

EPILOGS: dict[str, str] = {
    "actcfg": """examples:
  actcfg validate configs/*.yaml
  actcfg translate configs/deepspeed-cpu-checkpointing.yaml --backend deepspeed
  actcfg import ds_config.json --modules Block -o policy.yaml
  actcfg verify configs/seed-linear-offload.yaml --plot memory.png      (GPU)

exit codes: 0 success; 1 invalid input, or a check that failed; 2 usage error or unreadable
file. `actcfg COMMAND --help` gives each command's.""",
    "validate": """examples:
  actcfg validate configs/*.yaml
  actcfg validate --backend deepspeed --strict policy.yaml
  actcfg validate --at training.memory train.yaml --format json

exit codes: 0 every file valid; 1 any error (or any warning with --strict); 2 usage error or
unreadable file.""",
    "schema": """examples:
  actcfg schema -o actcfg.schema.json

exit codes: 0; 2 when OUT cannot be written.""",
    "translate": """examples:
  actcfg translate configs/deepspeed-cpu-checkpointing.yaml --backend deepspeed
  actcfg translate configs/torch-selective.yaml --backend torch
  actcfg translate policy.yaml --merge ds_config.json -o ds_config.merged.json
  actcfg translate policy.yaml --merge ds_config.json --replace -o ds_config.merged.json

exit codes: 0 translated; 1 invalid policy, a field the backend cannot express, or a
ds_config section that disagrees (without --replace); 2 usage error or unreadable file.""",
    "import": """examples:
  actcfg import ds_config.json --modules Block -o policy.yaml
  actcfg import neox.yml --external
  actcfg import training_args.json --backend hf --modules LlamaDecoderLayer
  actcfg import strategy.yaml --backend lightning --modules Block

exit codes: 0 imported (warnings say what the file does not do as written); 1 the file cannot
become a policy; 2 usage error or unreadable file.""",
    "verify": """examples (on a CUDA GPU):
  actcfg verify configs/seed-linear-offload.yaml --plot memory.png
  actcfg verify configs/torch-checkpoint-offload.yaml --model actcfg.probes:blocks --format json
  torchrun --nproc-per-node 2 -m actcfg verify configs/deepspeed-partition-model-parallel.yaml --model actcfg.probes:blocks

exit codes: 0 every promise held; 1 invalid policy, or a promise that did not hold; 2 usage
error (no torch, no CUDA GPU, a --model that cannot be loaded) or unreadable file.""",
    "plan": """examples (on a CUDA GPU):
  actcfg plan configs/torch-memory-budget.yaml --model actcfg.probes:blocks -o plan.yaml
  actcfg plan configs/torch-memory-budget.yaml --model actcfg.probes:blocks --budget 4GiB --format json

exit codes: 0 the measured peak is within the budget; 1 above it, no plan fits, or an invalid
policy; 2 usage error (no torch, no CUDA GPU) or unreadable file.""",
}
"""`--help`'s examples and exit codes: the program's, then each command's."""
