"""The profile of a Hugging Face GPT-2 under CPU autocast (as `TrainingArguments(bf16=True)`
runs its forward): each plan's predicted peak against what its step measures with the plan
applied, on the same meter (`LiveBytes`)."""

from __future__ import annotations

import pytest
import torch

from actcfg.api import _apply_trial
from actcfg.plan import predict
from actcfg.plan.profile import measure_steps, profile
from actcfg.plan.write import exact_pattern

pytestmark = pytest.mark.slow


def _gpt2(autocast: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # use_cache stays at GPT-2's default (True), as a Trainer leaves it
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=128,
                                       vocab_size=128, bos_token_id=0, eos_token_id=0))
    if not autocast:
        return model
    forward = model.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast_forward  # as accelerate wraps it for bf16 mixed precision
    return model


def _rules(names: list[str], choices: tuple[str, ...]) -> str:
    rules = [f"  - {{modules: [{exact_pattern(n)!r}], mode: {'none' if c == 'keep' else c}}}\n"
             for n, c in zip(names, choices)]
    return "version: 1\ncheckpoint:\n  mode: rules\n  rules:\n" + "".join(rules)


def _errors(model: torch.nn.Module) -> dict[tuple[str, ...], float]:
    """(predicted - measured) / measured peak per plan, each measured with the plan applied."""
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def loss(outputs):
        return outputs["loss"]

    profiled = profile(model, ["GPT2Block"], batch, apply=_apply_trial, loss_fn=loss,
                       choices=("keep", "full"))
    names = [b.name for b in profiled.blocks]
    errors = {}
    for choices in [("keep",) * 4, ("full",) * 4, ("full", "full", "full", "keep"),
                    ("keep", "keep", "full", "full"), ("full", "keep", "full", "keep")]:
        predicted = predict(profiled, choices)[1]
        with _apply_trial(model, _rules(names, choices)):
            _, measured = measure_steps(model, batch, loss_fn=loss)
        errors[choices] = round((predicted - measured) / measured, 4)
    return errors


def test_gpt2_plans_predict_the_peak_their_step_measures():
    """Uniform and mixed plans exact (within 0.5%; they are to the byte) on a GPT-2 that keeps
    `use_cache` on. The profile's keep run once ran bare and built the KV cache that any applied
    policy turns off: keep was over-predicted by 2.2%, plans ending in kept blocks after
    checkpointed ones by 3.5-4.7%."""
    errors = _errors(_gpt2(autocast=False))
    assert all(abs(e) <= 0.005 for e in errors.values()), errors


def test_gpt2_under_autocast_plans_predict_the_peak_their_step_measures():
    """As above, under CPU autocast (bf16), within 1% (they are within 0.01%). A checkpointed
    block's bf16 weight casts live in autocast's cache until the region ends with the forward
    (past the loss, inside HF's forward), saved by no one: without a term for what a block
    leaves until then, checkpointed blocks then a kept last one were under-predicted by 2.4%,
    and with it but a turn measured as one piece (a kept last block's run peaks after the
    casts are gone, a checkpointed one's before), over-predicted by 1.6%."""
    errors = _errors(_gpt2(autocast=True))
    assert all(abs(e) <= 0.01 for e in errors.values()), errors
