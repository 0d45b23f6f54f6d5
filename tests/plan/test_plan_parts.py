"""Finer candidates (`checkpoint.submodules`, actcfg/plan/parts.py): a block planned as its parts,
each checkpointed on its own. On the CPU, with memory counted by `LiveBytes` (the same meter the
profile reads): a budget below the checkpoint-every-block peak is planned with parts, fits as
measured, and gives the plain gradients; the written plan names the parts exactly and loads back;
a budget below the floor says the smallest peak and the choices that reach it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from actcfg.api import apply
from actcfg.errors import PlanError
from actcfg.plan import Profile, plan_policy, policy_text, predict, smallest_peak, solve
from actcfg.plan.parts import find_parts
from actcfg.plan.profile import measure_steps, profile
from actcfg.policy.checker import load
from actcfg.policy.schema import Policy
from _helpers import assert_grads_close, grads_of, tiny_llama, watch_host_pools

LAYER = "LlamaDecoderLayer"
PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")  # module order


def llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Four layers whose MLP (intermediate 256) outweighs the rest, so that recomputing a whole
    layer peaks above recomputing its largest part."""
    model = tiny_llama(4, intermediate_size=256)
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def source(budget: int) -> Policy:
    return Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": [LAYER],
                                                               "submodules": "children"},
                                  "memory_budget": budget})


@pytest.fixture(scope="module")
def profiled():
    model, inputs = llama()
    return model, inputs, profile(model, (LAYER,), inputs, apply=apply, submodules="children", steps=1)


def test_children_are_the_parts_that_hold_parameters_and_patterns_match_relative_names():
    model, _ = llama()
    layers = [(f"model.layers.{i}", m) for i, m in enumerate(model.model.layers)]
    found = find_parts(layers, "children")
    assert [tuple(n for n, _ in ps) for ps in found] == [
        tuple(f"model.layers.{i}.{p}" for p in PARTS) for i in range(4)]
    by_pattern = find_parts(layers[:1], ("mlp", "LlamaAttention"))  # a relative name, a class name
    assert [n for n, _ in by_pattern[0]] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert find_parts(layers, "none") == [(), (), (), ()]


def test_a_part_pattern_that_finds_nothing_or_nests_is_refused_naming_the_block():
    model, _ = llama()
    layers = [("model.layers.0", model.model.layers[0])]
    with pytest.raises(PlanError, match=r"^checkpoint\.submodules: candidate model\.layers\.0 "
                       r"\(LlamaDecoderLayer\) has no submodule matching 'ffn' \(its children: "
                       r"self_attn, mlp, input_layernorm, post_attention_layernorm\); name parts "
                       r"every candidate has"):
        find_parts(layers, ("ffn",))
    with pytest.raises(PlanError, match=r"^checkpoint\.submodules: in candidate model\.layers\.0, "
                       r"mlp and mlp\.up_proj both match, one inside the other"):
        find_parts(layers, ("mlp", "mlp.up_proj"))


def test_the_profile_measures_the_split_choice_and_predicts_each_uniform_peak(profiled):
    model, inputs, prof = profiled
    assert prof.choices() == ("keep", "selective", "split", "full") and prof.device == "cpu"
    assert [b.parts for b in prof.blocks] == [
        tuple(f"model.layers.{i}.{p}" for p in PARTS) for i in range(4)]
    for b in prof.blocks:  # a split layer keeps its parts' inputs, more than a checkpoint, less than all
        assert b.options["full"].held < b.options["split"].held < b.options["keep"].held
        # and its backward recomputes one part at a time
        assert b.options["split"].backward_peak < b.options["full"].backward_peak
    n = len(prof.blocks)
    for c in prof.choices():
        rules = plan_policy(_uniform(prof, c), source(2**40))
        with apply(model, rules):
            _, peak = measure_steps(model, inputs, steps=1)
        assert predict(prof, (c,) * n)[1] == pytest.approx(peak, rel=0.05), c
    assert Profile.from_json(prof.to_json()) == prof


def _uniform(prof: Profile, choice: str):
    from actcfg.plan.solve import Plan

    n = len(prof.blocks)
    step, peak = predict(prof, (choice,) * n)
    return Plan(tuple(b.name for b in prof.blocks), (choice,) * n, 1, step, peak, 2**40,
                tuple(b.taken(choice) for b in prof.blocks))


def test_below_the_checkpoint_every_layer_peak_a_plan_splits_fits_and_gives_the_plain_gradients(profiled):
    model, inputs, prof = profiled
    n = len(prof.blocks)
    with apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": [LAYER]}}):
        _, checkpoint_peak = measure_steps(model, inputs, steps=1)
    budget = min(checkpoint_peak, predict(prof, ("full",) * n)[1]) - 1
    plan = solve(prof, budget)
    assert "split" in plan.choices and plan.peak <= budget
    plain = copy.deepcopy(model)
    measure_steps(plain, inputs, steps=1)
    with apply(model, plan_policy(plan, source(budget))) as handle:
        # each split layer's parts are checkpointed, the layer itself is not
        assert set(handle.checkpointed) == {n for n, c in zip(plan.blocks, plan.choices) if c == "full"} | {
            p for b, c in zip(prof.blocks, plan.choices) if c == "split" for p in b.parts}
        _, peak = measure_steps(model, inputs, steps=1)
        got = grads_of(model)
    assert peak <= budget < checkpoint_peak
    assert peak == pytest.approx(plan.peak, rel=0.05)
    assert_grads_close(got, grads_of(plain))


def test_the_written_plan_names_the_parts_exactly_and_loads_back(profiled, run_cli, tmp_path):
    model, inputs, prof = profiled
    budget = predict(prof, ("full",) * len(prof.blocks))[1] - 1
    plan = solve(prof, budget)
    text = policy_text(plan, prof, source(budget))
    split = [b for b, c in zip(prof.blocks, plan.choices) if c == "split"]
    assert split
    for b in split:  # the parts are named, the block is not
        assert all(p in text for p in b.parts) and f"{b.name}," not in text and f"{b.name}]" not in text
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    assert run_cli("validate", path).code == 0
    assert load(path) == plan_policy(plan, source(budget))
    with apply(model, path) as handle:
        assert sorted(n for r in handle.rules for n in r.modules) == sorted(plan.modules())


def test_apply_auto_with_submodules_plans_the_parts(profiled):
    model, inputs, prof = profiled
    budget = predict(prof, ("full",) * len(prof.blocks))[1] - 1
    cfg = {"version": 1, "checkpoint": {"mode": "auto", "modules": [LAYER], "submodules": list(PARTS[:2])},
           "memory_budget": budget}
    with apply(model, cfg, inputs=inputs) as handle:
        choices = dict(handle.plan.choices)
        assert "split" in choices.values()
        split = [b for b, c in choices.items() if c == "split"]
        assert {n for r in handle.rules for n in r.modules} >= {f"{b}.{p}" for b in split for p in PARTS[:2]}


def test_below_the_floor_the_error_says_the_smallest_peak_and_the_choices_that_reach_it(profiled):
    _, _, prof = profiled
    lowest = smallest_peak(prof)
    with pytest.raises(PlanError, match=r"^no plan fits memory_budget .*: the smallest peak any choice of "
                       r"keep, selective, split, full per module reaches is .* \(plain: .*\), with "
                       r"(split|full) on .*\. Raise memory_budget to at least .*, or plan over more or "
                       r"finer modules \(`checkpoint\.modules`\)$") as info:
        solve(prof, lowest - 1)
    assert info.value.smallest_peak == lowest
    assert solve(prof, lowest).peak == lowest


def test_validate_locates_a_bad_part_pattern(run_cli, tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("version: 1\ncheckpoint:\n  mode: auto\n  modules: [Block]\n"
                    "  submodules: [mlp, attn..qkv]\nmemory_budget: 1GiB\n")
    result = run_cli("validate", path)
    assert result.code == 1
    assert result.out == (
        f"{path}:5:21: error bad-value: `checkpoint.submodules.1`: 'attn..qkv' has an empty name "
        "segment: a submodule pattern is a dotted name relative to the block (`mlp`, `self_attn`, "
        "`attn.*`), with no leading, trailing or doubled dot, got 'attn..qkv' (fix the value)\n")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_below_the_checkpoint_every_layer_peak_a_plan_splits_and_fits():
    """On the GPU, where checkpointing every layer peaks in layer 0's backward (the parameter
    gradients piled up, and the whole layer recomputed): a Llama whose MLP outweighs the rest
    (hidden 512, intermediate 4096, 4 layers, batch 4 x 1024, bf16, a small vocabulary so the
    logits do not set the peak). The profile predicts each uniform choice within 5%, and a budget
    below the checkpoint-every-layer peak gets a plan that fits, with the plain gradients, by a
    choice finer than a whole layer's recompute: split layers, or (since the engine reloads at
    most two storages ahead) a layer offloaded without recompute, which the H200 chose for
    layer 0 on 2026-12-02."""
    from _helpers import assert_grads_within

    model = tiny_llama(4, hidden_size=512, intermediate_size=4096, num_attention_heads=8,
                       num_key_value_heads=8, max_position_embeddings=1024, vocab_size=512)
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    prof = profile(model, (LAYER,), inputs, apply=apply, submodules="children")
    assert "split" in prof.choices(), prof.notes
    n = len(prof.blocks)
    for c in prof.choices():
        assert predict(prof, (c,) * n)[1] == pytest.approx(prof.measured[c]["peak"], rel=0.05), c
    with apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": [LAYER]}}):
        _, checkpoint_peak = measure_steps(model, inputs, steps=2)
    budget = min(checkpoint_peak, predict(prof, ("full",) * n)[1]) - 1
    plan = solve(prof, budget)
    assert {"split", "split_offload", "offload"} & set(plan.choices), plan.choices
    plain = copy.deepcopy(model)
    measure_steps(plain, inputs, steps=1)
    with apply(model, plan_policy(plan, source(budget))):
        _, peak = measure_steps(model, inputs, steps=2)
        got = grads_of(model, as_float=True)
    assert peak <= budget < checkpoint_peak, (plan.choices, peak, budget, checkpoint_peak)
    assert peak == pytest.approx(plan.peak, rel=0.05)
    assert_grads_within(got, grads_of(plain, as_float=True), 2e-2)


def test_a_plan_file_naming_parts_is_this_models_and_not_another_ones(profiled, tmp_path):
    """A trainer's plan_file= check: a split layer is named by its parts, and still counts as
    the candidate it is; the same file is refused for a model without that layer."""
    from actcfg.errors import PolicyApplyError
    from actcfg.integrations._planning import check_plan_fits_model

    model, _, prof = profiled
    budget = predict(prof, ("full",) * len(prof.blocks))[1] - 1
    planned = plan_policy(solve(prof, budget), source(budget))
    assert any(c == "split" for c in solve(prof, budget).choices)
    path = tmp_path / "actcfg-plan.yaml"
    check_plan_fits_model(model, source(budget), planned, path)  # its own model: accepted
    smaller = tiny_llama(3, intermediate_size=256)
    with pytest.raises(PolicyApplyError, match=r"was planned for another model: it names "):
        check_plan_fits_model(smaller, source(budget), planned, path)


# --- split_offload: each part checkpointed with its input offloaded ----------------------------


class _Part(nn.Module):
    """LayerNorm, Linear up, GELU, Linear down: everything it saves is inside it."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(self.norm(x))))


class PartBlock(nn.Module):
    """Two residual parts, `attn` (width) and `mlp` (4x width): a block that saves nothing
    outside its parts, whose whole recompute peaks above its MLP's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = _Part(width, width)
        self.mlp = _Part(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class PartStack(nn.Module):
    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PartBlock(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# Activations much larger than the parameters (4096 rows of width 64: 1 MiB each, the engine's
# min_offload_bytes; a block's parameters ~160 KiB): without offload a split block's two part
# inputs pile up under every later block, with full_offload the backward peaks at one whole
# block's recompute; split_offload has neither.
SPLIT_CHOICES = ("keep", "split", "full", "full_offload")
WITH_SPLIT_OFFLOAD = (*SPLIT_CHOICES, "split_offload")


def _part_source(budget: int, block: str = "PartBlock") -> Policy:
    return Policy.model_validate({"version": 1, "checkpoint": {"mode": "auto", "modules": [block],
                                                               "submodules": "children"},
                                  "memory_budget": budget})


@pytest.fixture(scope="module")
def offloaded():
    from actcfg.runtime.offload import host_loopback

    torch.manual_seed(0)
    model, x = PartStack(4, 64), torch.randn(4096, 64)
    with host_loopback():
        with_it = profile(model, ("PartBlock",), x, apply=apply, submodules="children",
                          choices=WITH_SPLIT_OFFLOAD)
        without = profile(model, ("PartBlock",), x, apply=apply, submodules="children",
                          choices=SPLIT_CHOICES)
        yield model, x, with_it, without


def test_split_offload_moves_each_blocks_part_inputs_and_holds_less_than_split(offloaded):
    _, _, prof, _ = offloaded
    assert prof.choices() == ("keep", "split", "full", "full_offload", "split_offload"), prof.notes
    for b in prof.blocks:
        so, split = b.options["split_offload"], b.options["split"]
        # the engine's groups are the parts (blocks.i.attn, blocks.i.mlp), counted to the block
        assert so.moved > 0 and so.held < split.held and so.held + so.moved == split.held, b.name
        # recomputed as split is: one part at a time
        assert so.recompute_ms == split.recompute_ms
    # past the first block (whose attn input is the model's input, which stays) both part
    # inputs go to the host
    assert [b.options["split_offload"].moved for b in prof.blocks[1:]] == [2 * 2**20] * 3


def test_the_host_pool_makes_split_offloads_buffers_ahead_when_a_part_input_is_no_block_inputs_size(
        monkeypatch):
    """A part whose input is wider than the block's (here `mlp.down`, after the 4x-wide GELU; in
    a GPT-2 the GELU part itself) is copied in buffers of a size no block input has. Where the
    pool prepares only the block inputs (the offload-everything run left out), the split_offload
    run pinned those on demand inside its steps: 5 plain steps of a 24-step profile on an H200
    GPT-2. The keep count now reads each part's inputs, and the pool makes them ahead."""
    from actcfg.runtime.offload import host_loopback

    made, pools = watch_host_pools(monkeypatch)
    torch.manual_seed(0)
    model, x = PartStack(4, 64), torch.randn(4096, 64)
    with host_loopback():
        prof = profile(model, ("PartBlock",), x, apply=apply, submodules=["mlp.down"],
                       choices=WITH_SPLIT_OFFLOAD)
    wide = 4096 * 4 * 64 * 4  # the GELU's output, down's input: 4 MiB
    # every block's part moves its input, the last block's too
    assert [b.options["split_offload"].moved for b in prof.blocks] == [wide] * 4
    assert len(pools) == 1 and pools[0].stats.host_buffers_on_demand == 0
    assert [n for n, _ in made].count(wide) >= 4
    assert all(thread.startswith("actcfg-host-pool") for _, thread in made)


def test_split_offload_plans_below_the_smallest_plan_without_it_and_fits(offloaded):
    model, x, prof, without = offloaded
    lowest, lowest_without = smallest_peak(prof), smallest_peak(without)
    assert lowest < lowest_without
    budget = lowest_without - 1  # no plan without split_offload fits here
    with pytest.raises(PlanError, match=r"^no plan fits memory_budget"):
        solve(without, budget)
    plan = solve(prof, budget)
    assert "split_offload" in plan.choices and plan.peak <= budget
    plain = copy.deepcopy(model)
    measure_steps(plain, x, steps=1)
    with apply(model, plan_policy(plan, _part_source(budget))) as handle:
        # each split_offload block's parts are checkpointed and their inputs offloaded
        parts = {p for b, c in zip(prof.blocks, plan.choices) if c == "split_offload" for p in b.parts}
        assert parts <= set(handle.checkpointed)
        offloading = {n for r in handle.rules if r.offload for n in r.modules}
        assert offloading >= parts
        _, peak = measure_steps(model, x, steps=1)
        got = grads_of(model)
        moved = {g["module"]: g["offloaded_bytes"] for g in handle.offload_groups()}
    assert sum(moved.get(p, 0) for p in parts) > 0
    assert peak <= budget
    assert peak == pytest.approx(plan.peak, rel=0.05)
    assert_grads_close(got, grads_of(plain))


def test_the_written_split_offload_plan_names_the_parts_with_cpu_checkpointing(offloaded, run_cli, tmp_path):
    model, _, prof, _ = offloaded
    n = len(prof.blocks)
    plan = _uniform(prof, "split_offload")
    assert plan.choices == ("split_offload",) * n
    text = policy_text(plan, prof, _part_source(plan.peak))
    parts = ", ".join(p for b in prof.blocks for p in b.parts)
    assert f"    - {{modules: [{parts}], mode: full, cpu_checkpointing: true}}\n" in text
    assert "  keep_last: 0\n  max_inflight: 1\n" in text
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    assert run_cli("validate", path).code == 0
    assert load(path) == plan_policy(plan, _part_source(plan.peak))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_split_offload_plans_below_the_checkpoint_every_block_peak_and_fits():
    """On the GPU, 8 blocks of two parts (width 1024, 16384 rows, bf16: one activation 32 MiB
    against 20 MiB of parameters a block): checkpointing every block peaks at one whole block's
    recompute above the blocks' inputs; with each part's input offloaded, the smallest plan is
    below that peak, and the plan at a budget under it fits, as predicted, with the plain
    gradients. (The probe's `Block` of actcfg.probes:blocks, planned with `children`, is not
    such a block: its children are single Linears and LayerNorms, and its attention and GELU
    save outside them, so its split parts hold almost what keep does.)"""
    torch.manual_seed(0)
    model = PartStack(8, 1024).to("cuda", torch.bfloat16)
    x = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16)
    _plan_below_the_checkpoint_peak(model, x, "PartBlock", steps=2, tolerance=2e-2)


# --- the probe's PartedBlock: Block's arithmetic, its halves as parts ---------------------------


def test_parted_block_is_block_with_its_halves_as_submodules():
    """`actcfg.probes.blocks(parts=True)` computes what `Block` computes, weight for weight:
    the same output and the same gradients, so plans on it measure the probe stack's work."""
    from actcfg.probes import Block, PartedBlock

    torch.manual_seed(0)
    block, parted = Block(64, 4, 256), PartedBlock(64, 4, 256)
    names = {"attn.norm": "norm1", "attn.qkv": "qkv", "attn.proj": "proj",
             "mlp.norm": "norm2", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}
    with torch.no_grad():
        for mine, theirs in names.items():
            for kind in ("weight", "bias"):
                parted.get_parameter(f"{mine}.{kind}").copy_(block.get_parameter(f"{theirs}.{kind}"))
    x = torch.randn(2, 16, 64)
    out_block, out_parted = block(x), parted(x)
    torch.testing.assert_close(out_parted, out_block, rtol=0, atol=0)
    out_block.square().mean().backward()
    out_parted.square().mean().backward()
    for mine, theirs in names.items():
        torch.testing.assert_close(parted.get_parameter(f"{mine}.weight").grad,
                                   block.get_parameter(f"{theirs}.weight").grad, rtol=0, atol=0)


def test_a_parted_probe_stack_plans_below_its_checkpoint_every_block_peak():
    """On the probe stack with parts (attention and MLP halves), each half's input offloaded
    takes the smallest plan below checkpointing every block, which recomputes a whole block at
    once in backward; the plan at a budget between fits, as predicted, with plain gradients."""
    from actcfg.probes import blocks
    from actcfg.runtime.offload import host_loopback

    torch.manual_seed(0)
    model, x = blocks(n=4, d_model=64, heads=4, ffn=256, batch=4, seq=1024, dtype=torch.float32,
                      device="cpu", parts=True)
    with host_loopback():
        _plan_below_the_checkpoint_peak(model, x, "PartedBlock")


def _plan_below_the_checkpoint_peak(model: nn.Module, x: torch.Tensor, block: str, *, steps: int = 1,
                                    tolerance: float | None = None) -> None:
    """With each part's input offloaded, the smallest plan over `block`s is below the measured
    checkpoint-every-block peak, and the plan at a budget between fits, as predicted, with the
    plain gradients (exactly, or within `tolerance` relative: bf16). The CPU and GPU tests."""
    from _helpers import assert_grads_within

    prof = profile(model, (block,), x, apply=apply, submodules="children", choices=WITH_SPLIT_OFFLOAD)
    assert "split_offload" in prof.choices(), prof.notes
    assert all(b.options["split_offload"].moved > 0 for b in prof.blocks[1:])
    with apply(model, {"version": 1, "checkpoint": {"mode": "full", "modules": [block]}}):
        _, checkpoint_peak = measure_steps(model, x, steps=steps)
    lowest = smallest_peak(prof)
    assert lowest < checkpoint_peak, (lowest, checkpoint_peak)
    budget = (lowest + checkpoint_peak) // 2
    plan = solve(prof, budget)
    assert "split_offload" in plan.choices and plan.peak <= budget
    plain = copy.deepcopy(model)
    measure_steps(plain, x, steps=1)
    with apply(model, plan_policy(plan, _part_source(budget, block))):
        _, peak = measure_steps(model, x, steps=steps)
        got = grads_of(model, as_float=True)
    assert peak <= budget < checkpoint_peak, (plan.choices, peak, budget, checkpoint_peak)
    assert peak == pytest.approx(plan.peak, rel=0.05)
    want = grads_of(plain, as_float=True)
    if tolerance is None:
        assert_grads_close(got, want)
    else:
        assert_grads_within(got, want, tolerance)
