"""The peak model on a real GPU (the CPU twin: tests/plan/test_cost.py): on the blocks stack, a
Hugging Face Llama decoder stack and a stack of uneven blocks, every uniform choice and the
solver's plans between the checkpoint-every-block peak and plain are predicted within 5% of what
a training step measures (`torch.cuda.max_memory_allocated` above the step's start), and each
plan fits its budget.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -m cuda -q tests/plan/test_cost_cuda.py
Sizes are moderate (about a minute per stack); benchmarks/plan_bench.py measures the issue's.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from actcfg.api import apply  # noqa: E402
from actcfg.plan import plan_policy, predict, solve  # noqa: E402
from actcfg.plan.profile import measure_steps, profile  # noqa: E402
from actcfg.plan.solve import Plan  # noqa: E402
from actcfg.policy.schema import Policy  # noqa: E402
from actcfg.probes import blocks  # noqa: E402
from actcfg.verification.models import Block, BlockStack  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def llama() -> tuple[Any, Any, tuple[str, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 32000, (2, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, ("LlamaDecoderLayer",)


def block_stack() -> tuple[Any, Any, tuple[str, ...]]:
    torch.manual_seed(0)
    model, x = blocks(n=8, d_model=1024, heads=8, ffn=4096, batch=4, seq=1024)
    return model, x, ("Block",)


def uneven() -> tuple[Any, Any, tuple[str, ...]]:
    torch.manual_seed(0)
    widths = (1024, 8192, 2048, 16384, 4096, 1024)
    model = BlockStack(len(widths), 1024, 8, 1024)
    for i, ffn in enumerate(widths):
        model.blocks[i] = Block(1024, 8, ffn)
    model = model.to("cuda", torch.bfloat16)
    return model, torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16), ("Block",)


STACKS = {"blocks": block_stack, "llama": llama, "uneven": uneven}


@pytest.fixture(scope="module", params=sorted(STACKS))
def profiled(request):
    model, inputs, modules = STACKS[request.param]()
    prof = profile(model, modules, inputs, apply=apply, submodules="children")
    yield model, inputs, modules, prof
    del model, inputs
    torch.cuda.empty_cache()


def _measured(model, inputs, modules, prof, choices, max_inflight: int = 1) -> int:
    step, peak = predict(prof, choices, max_inflight)
    plan = Plan(tuple(b.name for b in prof.blocks), tuple(choices), max_inflight, step, peak, 2**50,
                tuple(b.taken(c) for b, c in zip(prof.blocks, choices)))
    source = Policy.model_validate({"version": 1, "checkpoint": {
        "mode": "auto", "modules": list(modules), "submodules": "children"}, "memory_budget": 2**50})
    with apply(model, plan_policy(plan, source)):
        return measure_steps(model, inputs, steps=3)[1]


def test_every_uniform_choice_is_predicted_within_5_percent(profiled):
    model, inputs, modules, prof = profiled
    assert prof.device == "cuda" and prof.window_storages == 2 and prof.largest_storage > 0
    n = len(prof.blocks)
    for c in prof.choices():
        predicted = predict(prof, (c,) * n)[1]
        assert predicted == pytest.approx(prof.measured[c]["peak"], rel=0.05), c
        assert predicted == pytest.approx(_measured(model, inputs, modules, prof, (c,) * n), rel=0.05), c


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75])
def test_the_solvers_plans_are_predicted_within_5_percent_and_fit(profiled, fraction):
    model, inputs, modules, prof = profiled
    n = len(prof.blocks)
    full = _measured(model, inputs, modules, prof, ("full",) * n)
    budget = int(full + fraction * (prof.plain_peak - full))  # 0: the checkpoint-every-block peak
    plan = solve(prof, budget)
    measured = _measured(model, inputs, modules, prof, plan.choices, plan.max_inflight)
    # (H200, 2026-12-02: a plan of offload blocks under full ones measured 436998144 bytes in a
    # 436603392 budget, 0.09% over, until the model read the rest of a block's backward from
    # where the engine reloads the block below, `Option.reload_level`)
    assert measured <= budget, (plan.choices, measured, budget)
    assert plan.peak == pytest.approx(measured, rel=0.05), plan.choices


def test_full_offload_blocks_above_kept_ones_are_never_under_predicted(profiled):
    """The engine reloads the block below a recomputed one past its recompute's peak where it
    can (`BlockProfile.reload_waits`, read from the full_offload run), and the model counts that
    reload only where it could not. Counting it everywhere, kept blocks under full_offload ones
    came out a block input under what they measured (the CPU blocks stack: 94.78 against 95.78
    block inputs), a plan that could pass its budget. Within MIXED_HEADROOM above: a mix's few
    KiB the terms do not see."""
    from actcfg.plan.solve import MIXED_HEADROOM

    model, inputs, modules, prof = profiled
    n = len(prof.blocks)
    if [b.name for b in prof.blocks][0].startswith("blocks.") and n == 8:  # the blocks stack
        assert all(b.reload_waits for b in prof.blocks)  # every block's MLP signals in time
    choices = ("keep",) * (n // 2) + ("full_offload",) * (n - n // 2)
    predicted = predict(prof, choices)[1]
    measured = _measured(model, inputs, modules, prof, choices)
    assert measured <= predicted * (1 + MIXED_HEADROOM), ([b.reload_waits for b in prof.blocks], predicted,
                                                           measured)
    assert predicted == pytest.approx(measured, rel=0.05)
