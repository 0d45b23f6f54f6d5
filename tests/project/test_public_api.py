"""The public API is a set of functions that stay functions (issue 19, item 1): each public
function, called twice in the README's order, after `apply` and after `apply` with
`checkpoint.mode: auto`, on the CPU. A submodule that shares a public function's name replaces
it on the package once imported (`actcfg.translate(...)` -> "'module' object is not callable")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import actcfg  # noqa: E402
from actcfg.probes import BlockStack, blocks  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on the CPU verify refuses at once; the CUDA suite runs verify itself")

AUTO = {"version": 1, "checkpoint": {"mode": "auto", "modules": ["Block"]}, "memory_budget": "1TiB"}


@pytest.mark.parametrize("auto", [False, True], ids=["apply", "apply-auto"])
def test_every_public_function_stays_a_function_in_the_readmes_order(auto):
    model = BlockStack(n=2, d_model=16, heads=2, ffn=32)
    batch = torch.randn(2, 8, 16)
    deepspeed_policy = actcfg.load("configs/deepspeed-cpu-checkpointing.yaml")
    for _ in range(2):
        policy = actcfg.load(AUTO if auto else "configs/torch-selective.yaml")
        with actcfg.apply(model, policy, inputs=batch if auto else None) as applied:
            model(batch).square().mean().backward()
            assert auto or applied.report()["effect"]["checkpoint"]["calls"] > 0
        for _ in range(2):
            assert actcfg.translate(deepspeed_policy, "deepspeed")["activation_checkpointing"][
                "cpu_checkpointing"] is True
            with pytest.raises(actcfg.VerifyError, match="needs a CUDA GPU"):
                actcfg.verify(blocks, policy)
    assert [callable(getattr(actcfg, name)) for name in ("load", "translate", "apply", "verify")] == [True] * 4
