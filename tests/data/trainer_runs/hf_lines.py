"""A Hugging Face Trainer run as a user runs it (no logging set up), three times: default
arguments, `disable_tqdm=True`, and `log_level="error"` (last: it sets transformers' verbosity
for the process). Each run's output follows a `=== name` line on stdout."""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from actcfg.integrations.hf import ActivationPolicyCallback

POLICY = "version: 1\ncheckpoint: {mode: full, modules: [LlamaDecoderLayer]}\n"
out = sys.argv[1]
ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
rows = [{"input_ids": r, "labels": r} for r in ids]
for name, extra in (("default", {}), ("disable_tqdm", {"disable_tqdm": True}),
                    ("log_level_error", {"log_level": "error"})):
    print(f"=== {name}", flush=True)
    print(f"=== {name}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=2,
                             report_to=[], save_strategy="no", use_cpu=True, **extra)
    Trainer(model=model, args=args, train_dataset=rows,
            callbacks=[ActivationPolicyCallback(POLICY)]).train()
