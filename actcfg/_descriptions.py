"""Field descriptions for `actcfg schema`: the docstring under each field in schema.py.

Generated; do not edit. After changing a field docstring in schema.py, run
`python tests/test_descriptions.py` (tests/test_descriptions.py fails until then).
"""

DESCRIPTIONS: dict[str, str] = {
    'NoCheckpoint.mode': '`none`: no recomputation.',
    '_Checkpointed.modules': "Which submodules are checkpointed: fnmatch patterns, each matched against a\nmodule's class name and its qualified name (`GPT2Block`, `layers.*`).",
    '_Checkpointed.every': 'Checkpoint every n-th matched module in module order (the n-th, 2n-th, ...); 1 = all.',
    '_Checkpointed.reentrant': "torch only: use torch's reentrant checkpoint (default: non-reentrant, as torch advises).",
    'FullCheckpoint.mode': '`full`: whole-module recomputation.',
    'SelectiveCheckpoint.mode': '`selective`: op-level recomputation (torch `create_selective_checkpoint_contexts`).',
    'SelectiveCheckpoint.save_ops': 'Ops whose outputs are saved, as `namespace.op` (`aten.mm`); every other op is recomputed.',
    'ExternalCheckpoint.mode': "`external`: the model's own code routes its checkpointed calls (Megatron and gpt-neox\ncall deepspeed.checkpointing.checkpoint; Hugging Face models with activation checkpointing\non call torch.utils.checkpoint): actcfg configures the backend (and offloads, with\n`cpu_checkpointing`) around them.",
    'Policy.version': 'Schema version of this file; this actcfg reads version 1.',
    'Policy.backend': 'Backend that `actcfg.apply` and `actcfg translate` use unless told otherwise.',
    'Policy.checkpoint': 'Activation checkpointing: which modules recompute their activations in backward.',
    'Policy.partition': 'DeepSpeed only: split checkpointed activations across model-parallel ranks\n(DeepSpeed `partition_activations`).',
    'Policy.cpu_checkpointing': 'Keep checkpointed inputs in host memory until backward (DeepSpeed `cpu_checkpointing`);\ntorch with `checkpoint.mode: none` offloads every saved activation.',
    'Policy.pin': 'torch only: offload into page-locked (pinned) host buffers, which copy about 4x faster.',
    'Policy.pin_budget': 'torch only: most pinned host memory the offload engine holds, in bytes or a human size\n(`16GiB`); past it, pageable memory. Unset: no bound (buffers are reused step after step).',
    'Policy.contiguous': 'DeepSpeed only: pack partitioned activations into one preallocated buffer\n(DeepSpeed `contiguous_memory_optimization`); needs `partition`, and `num_checkpoints`\nunless `checkpoint.mode` is full (apply then passes the number of modules it routes).',
    'Policy.num_checkpoints': 'DeepSpeed only: checkpointed calls per step, sizing the contiguous buffers\n(DeepSpeed `number_checkpoints`); unset with `mode: full`: the number of routed modules.',
    'Policy.synchronize': 'DeepSpeed only: synchronize the device at every checkpoint boundary\n(DeepSpeed `synchronize_checkpoint_boundary`); for debugging and timing.',
    'Policy.profile': 'DeepSpeed only: time checkpoint forward and backward passes (DeepSpeed `profile`).',
}
