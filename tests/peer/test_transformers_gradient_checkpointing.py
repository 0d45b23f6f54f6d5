"""Hugging Face transformers' check_training_gradient_checkpointing, ported to actcfg.apply and
run on tiny random Llama, GPT-2 and T5 models over every route.

Source: huggingface/transformers, tests/test_modeling_common.py,
ModelTesterMixin.check_training_gradient_checkpointing (with test_training_gradient_checkpointing
and its use_reentrant false/true scenarios), at commit 3719481c3ad189ddd985280292f32d852b5aa7d9.

Kept: `config.use_cache = False`, `return_dict = True`, every parameter unfrozen, a plain run
that records which parameters get a non-zero gradient, then the checkpointed run from the same
seed; the checkpointed layer runs its forward more than once (counted by a forward pre-hook on
one of its children, which runs inside the recompute, where the original patches `forward` with
a mock), the same parameters get non-zero gradients, and every parameter gets a gradient.
Changed: `model.gradient_checkpointing_enable(kwargs)` becomes `actcfg.apply` on the decoder
layer class, once per route (the use_reentrant scenarios are the `full` and `reentrant` routes).
Added, as actcfg promises more: gradients equal plain's, and a forward called with
`use_cache=True` in training trains as transformers does when it checkpoints (cache forced
off with one warning, the same gradients); T5Block returns None among its outputs.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

try:
    from tests._deepspeed_env import ds_env
    from tests.peer._routes import applied, params
except ImportError:  # pytest's rootdir-relative import mode
    from _deepspeed_env import ds_env
    from peer._routes import applied, params

__all__ = ["ds_env"]


def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM, config, "LlamaDecoderLayer", "mlp"


def gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel, config, "GPT2Block", "mlp"


def t5():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration, config, "T5Block", "layer.0"


MODELS = {"llama": llama, "gpt2": gpt2, "t5": t5}


def inputs_for(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2, 7), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def build(name: str):
    model_class, config, layer, child = MODELS[name]()
    config.use_cache = False
    config.return_dict = True
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    transformers.set_seed(42)
    model = model_class(config)
    model.train()
    for p in model.parameters():  # unfreeze additional layers
        p.requires_grad_(True)
    return model, layer, child


def first_layer(model, layer: str):
    return next(m for m in model.modules() if type(m).__name__ == layer)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("route", params())
def test_training_gradient_checkpointing(route, name, request):
    model, layer, child = build(name)
    inputs = inputs_for(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    transformers.set_seed(42)
    model(**inputs).loss.backward()
    grad_expected_params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    non_zero_grads_normal = {n for n, p in grad_expected_params if p.grad.abs().sum() > 0}
    plain_grads = {n: p.grad.clone() for n, p in grad_expected_params}
    optimizer.zero_grad()

    calls = []
    hook = first_layer(model, layer).get_submodule(child).register_forward_pre_hook(lambda *_: calls.append(1))
    with applied(model, route, [layer], request):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        transformers.set_seed(42)
        model(**inputs).loss.backward()
        # the layer's insides run again in backward: checkpointing is active
        assert len(calls) > 1
        non_zero_grads_gradcp = {n for n, p in grad_expected_params if p.grad.abs().sum() > 0}
        assert non_zero_grads_gradcp == non_zero_grads_normal
        for k, v in model.named_parameters():
            assert not v.requires_grad or v.grad is not None, f"{k} in {type(model).__name__} has no gradient!"
            torch.testing.assert_close(v.grad, plain_grads[k], rtol=1e-5, atol=1e-6, msg=k)
        optimizer.step()
    hook.remove()


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("route", params())
def test_use_cache_true_in_training_is_forced_off_with_one_warning(route, name, request, caplog):
    """transformers forces use_cache off when it checkpoints; under actcfg the recompute updated
    the KV cache a second time (14 tokens for 7) and reentrant gradients came out wrong."""
    model, layer, _ = build(name)
    model.config.use_cache = True  # as loaded from the Hub
    plain = copy.deepcopy(model)
    inputs = inputs_for(name)
    transformers.set_seed(42)
    plain(**inputs, use_cache=False).loss.backward()
    with applied(model, route, [layer], request), caplog.at_level(logging.WARNING, logger="actcfg"):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            transformers.set_seed(42)
            out = model(**inputs, use_cache=True)
            out.loss.backward()
            assert out.past_key_values is None  # as transformers returns it when checkpointing
            for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
        with torch.no_grad():  # generation and evaluation keep their cache
            assert model(**inputs, use_cache=True).past_key_values is not None
    warnings = [r.getMessage() for r in caplog.records if "use_cache=True" in r.getMessage()]
    assert warnings == [
        f"actcfg: {type(model).__name__} was called with use_cache=True while training under an "
        "actcfg policy; setting use_cache=False, as transformers does when it checkpoints (the "
        "recompute would update the KV cache a second time)"]
