"""Nothing leaked: apply(auto) + remove(), the profile and the plan give back every tensor they
made, three cycles in a row. On the CPU, memory is not measurable through torch, so the test
counts the storages of the tensors Python can reach (a tensor autograd keeps alive through a
reference cycle in its C++ graph still has its Python object, which gc lists); on CUDA it reads
`torch.cuda.memory_allocated()`.

The leak these guard against: a saved-tensor pack hook that returns its tensor unchanged makes
an op that saves its own output (tanh, gelu, sdpa) hold itself through its grad_fn, and a
forward never followed by backward then keeps everything it saved."""

from __future__ import annotations

import gc

import pytest
import torch

from actcfg.runtime.offload import host_loopback
from actcfg.plan import plan_model, solve
from actcfg.plan.profile import profile, saved_bytes
from actcfg.api import apply
from actcfg.policy.schema import Policy
from actcfg.verification.models import blocks

AUTO = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1GiB"}


def _live_storages() -> tuple[int, int]:
    """(storages, bytes) of every tensor Python can reach, each storage once."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:  # fake and functional tensors (earlier torch.compile tests leave some) have none
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.nbytes():
                seen[ptr] = storage.nbytes()
    return len(seen), sum(seen.values())


def _stack(device: str = "cpu"):
    torch.manual_seed(0)
    # gelu and sdpa save their own outputs: the ops that made the cycle
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return blocks(n=2, d_model=64, heads=2, ffn=128, batch=2, seq=128, dtype=dtype, device=device)


def _cycles():
    """Each thing that runs the model under actcfg's hooks without a backward, once."""
    def apply_auto(model, x):
        apply(model, AUTO, inputs=x).remove()

    def run_profile(model, x):
        prof = profile(model, ("Block",), x, apply=apply, steps=1)
        solve(prof, 2**30)

    def run_plan(model, x):
        plan_model(model, Policy.model_validate(AUTO), x, apply=apply)

    def count_saved(model, x):
        saved_bytes(model, list(model.blocks), (x,), {})

    return {"apply_auto": apply_auto, "profile": run_profile, "plan": run_plan, "saved_bytes": count_saved}


@pytest.mark.parametrize("what", ["saved_bytes", "profile", "plan", "apply_auto"])
def test_three_cycles_on_the_cpu_leave_no_tensor_alive(what):
    run = _cycles()[what]
    model, x = _stack()
    with host_loopback():  # the offload choices run too, through the real engine
        before = _live_storages()
        for cycle in range(3):
            run(model, x)
            assert _live_storages() == before, f"{what}: cycle {cycle + 1} left tensors alive"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("what", ["saved_bytes", "profile", "plan", "apply_auto"])
def test_three_cycles_on_the_gpu_give_back_every_byte(what):
    run = _cycles()[what]
    model, x = _stack("cuda")
    run(model, x)  # the first cycle may build what stays by design (cuBLAS workspaces, ...)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for cycle in range(3):
        run(model, x)
        gc.collect()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        assert abs(after - before) <= 2**20, f"{what}: cycle {cycle + 1} left {after - before} bytes"
