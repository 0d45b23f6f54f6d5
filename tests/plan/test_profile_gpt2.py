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


def _gpt2_under_autocast() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # use_cache stays at GPT-2's default (True), as a Trainer leaves it
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64,
                                       vocab_size=256, bos_token_id=0, eos_token_id=0))
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


def test_gpt2_under_autocast_plans_predict_the_peak_their_step_measures():
    """Uniform and mixed plans within 5% of the measured step. The profile's keep run once ran
    bare, building the KV cache (`use_cache`) that any applied policy turns off: keep and every
    plan whose last block kept its activations were over-predicted by the cache's bytes."""
    model = _gpt2_under_autocast()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def loss(outputs):
        return outputs["loss"]

    profiled = profile(model, ["GPT2Block"], batch, apply=_apply_trial, loss_fn=loss,
                       choices=("keep", "full"))
    names = [b.name for b in profiled.blocks]
    errors = {}
    for choices in [("keep",) * 4, ("full",) * 4, ("full", "full", "keep", "keep"),
                    ("keep", "keep", "full", "full"), ("full", "keep", "full", "keep")]:
        predicted = predict(profiled, choices)[1]
        with _apply_trial(model, _rules(names, choices)):
            _, measured = measure_steps(model, batch, loss_fn=loss)
        errors[choices] = round((predicted - measured) / measured, 3)
    assert all(abs(e) <= 0.05 for e in errors.values()), errors
