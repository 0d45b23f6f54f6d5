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
    'Rule.modules': "fnmatch patterns, each matched against a module's class name and its qualified name\n(`Block`, `layers.3`); a module takes the first rule that matches it.",
    'Rule.mode': "`full`: keep the module's inputs, recompute its insides in backward; `selective`: keep the\noutputs of `save_ops`, recompute the rest; `none`: no recomputation.",
    'Rule.cpu_checkpointing': "Keep in host memory until backward what the module keeps: with `mode: none` everything it\nsaves, with `mode: full` its inputs (actcfg's offload engine).",
    'Rule.save_ops': '`mode: selective` only: ops whose outputs are saved, as `namespace.op`; unset: matmuls and\nattention, as `checkpoint.save_ops`.',
    'Prediction.step_time_ms': 'Predicted time of one training step (forward and backward), in milliseconds.',
    'Prediction.peak': 'Predicted peak GPU memory of one step above what is allocated when it begins, in bytes\nor a human size (`5GiB`).',
    'RulesCheckpoint.mode': '`rules`: each module as its rule says (what `actcfg plan` writes).',
    'RulesCheckpoint.rules': 'The rules, first match wins: each `{modules: [...], mode: none|full|selective,\ncpu_checkpointing: bool, save_ops: [...]}`.',
    'RulesCheckpoint.keep_last': "Offload engine: how many of the newest modules whose rule offloads stay on the GPU at the\nforward/backward turn. Each costs its activations' memory at the turn and saves their copy\nboth ways (nothing hides those copies: backward needs the newest modules first).",
    'RulesCheckpoint.max_inflight': "Offload engine: most modules whose copies to the host run at once; each in flight keeps\nits GPU memory until its copy is done, and more than one saves time only when modules'\ncopies are uneven.",
    'RulesCheckpoint.predicted': 'What `actcfg plan` predicted for these rules (`step_time_ms`, `peak`); `actcfg verify`\nreports it beside what it measures.',
    'AutoCheckpoint.mode': '`auto`: plan from a profile of one training step on the GPU (`actcfg plan`, or\n`actcfg.apply(model, policy, inputs=...)`).',
    'AutoCheckpoint.modules': "The candidate modules the plan chooses for (the model's blocks, such as `[Block]`): fnmatch\npatterns on class names and qualified names; each keeps, checkpoints or offloads as planned.",
    'AutoCheckpoint.submodules': "Finer candidates: the parts of each candidate module the plan may checkpoint one by one\ninstead of the whole module (a block's recompute then peaks at its largest part, not the\nwhole block). `none`: whole modules only; `children`: each module's direct children that hold\nparameters (a Llama layer's `self_attn`, `mlp` and norms); or fnmatch patterns on names\nrelative to the module or class names (`[self_attn, mlp]`, `[LlamaMLP]`).",
    'Policy.version': 'Schema version of this file; this actcfg reads version 1.',
    'Policy.backend': 'Backend that `actcfg.apply` and `actcfg translate` use unless told otherwise.',
    'Policy.checkpoint': 'Activation checkpointing: which modules recompute their activations in backward.',
    'Policy.partition': 'DeepSpeed only: split checkpointed activations across model-parallel ranks\n(DeepSpeed `partition_activations`).',
    'Policy.cpu_checkpointing': 'Keep checkpointed inputs in host memory until backward (DeepSpeed `cpu_checkpointing`);\ntorch with `checkpoint.mode: none` offloads every saved activation.',
    'Policy.pin': 'torch only: offload into page-locked (pinned) host buffers, which copy about 4x faster.',
    'Policy.pin_budget': 'torch only: most pinned host memory the offload engine holds, in bytes or a human size\n(`16GiB`); past it, pageable memory. Unset: no bound (buffers are reused step after step).',
    'Policy.pin_budget_per_node': "torch only: most pinned host memory the offload engines of all the job's ranks on one node\nhold together, in bytes or a human size (`256GiB`); each rank pins what the others leave\n(first come, first served; `pin_budget` still bounds each one), past it pageable memory.\nUnset: no bound per node.",
    'Policy.contiguous': 'DeepSpeed only: pack partitioned activations into one preallocated buffer\n(DeepSpeed `contiguous_memory_optimization`); needs `partition`, and `num_checkpoints`\nunless `checkpoint.mode` is full (apply then passes the number of modules it routes).',
    'Policy.num_checkpoints': 'DeepSpeed only: checkpointed calls per step, sizing the contiguous buffers\n(DeepSpeed `number_checkpoints`); unset with `mode: full`: the number of routed modules.',
    'Policy.synchronize': 'DeepSpeed only: synchronize the device at every checkpoint boundary\n(DeepSpeed `synchronize_checkpoint_boundary`); for debugging and timing.',
    'Policy.profile': 'DeepSpeed only: time checkpoint forward and backward passes (DeepSpeed `profile`).',
    'Policy.memory_budget': "torch only, with `checkpoint.mode: auto`: the most GPU memory one training step may\nallocate above what is allocated when it begins (activations, their gradients and the\nstep's parameter gradients), in bytes or a human size (`40GiB`); the plan keeps its peak\nwithin it.",
}
