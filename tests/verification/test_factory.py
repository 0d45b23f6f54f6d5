"""verification.factory: loading a model factory by name and the contract it must meet."""

from __future__ import annotations

import pytest

from actcfg.errors import ActcfgError, VerifyError
from actcfg.verification import VerifyReport, load_factory


# --- the factory and inputs --------------------------------------------------------------------


def test_load_factory_finds_a_dotted_attribute():
    assert load_factory("actcfg.verification:VerifyReport.to_dict") is VerifyReport.to_dict


@pytest.mark.parametrize(("spec", "message"), [
    ("actcfg.probes", "--model 'actcfg.probes': write it as pkg.module:factory (for example "
                      "actcfg.probes:linear_chain)"),
    (":linear_chain", "--model ':linear_chain': write it as pkg.module:factory (for example "
                      "actcfg.probes:linear_chain)"),
    ("actcfg.nowhere:f", "--model 'actcfg.nowhere:f': cannot import actcfg.nowhere: No module "
                         "named 'actcfg.nowhere'"),
    ("actcfg.verification:nothing", "--model 'actcfg.verification:nothing': actcfg.verification has no attribute "
                              "'nothing'"),
    ("actcfg.verification:DEFAULT_MODEL", "--model 'actcfg.verification:DEFAULT_MODEL': DEFAULT_MODEL is a "
                                    "str, not a callable factory returning (model, "
                                    "example_inputs)"),
])
def test_load_factory_refusals(spec, message):
    with pytest.raises(VerifyError) as e:
        load_factory(spec)
    assert str(e.value) == message


def test_the_factory_contract():
    torch = pytest.importorskip("torch")
    from actcfg.runtime.step import split_inputs as _split_inputs
    from actcfg.verification.factory import build as _build

    x = torch.ones(2, 3)

    class WithAttribute(torch.nn.Linear):
        example_inputs = (x,)

    class WithMethod(torch.nn.Linear):
        def example_inputs(self):
            return {"input": x}

    model = torch.nn.Linear(3, 3)
    assert _build(lambda: (model, x)) == (model, x)
    assert _build(lambda: WithAttribute(3, 3))[1] == (x,)
    assert _build(lambda: WithMethod(3, 3))[1] == {"input": x}
    assert _split_inputs(x) == ((x,), {})
    assert _split_inputs([x, 1]) == ((x, 1), {})
    assert _split_inputs({"input": x}) == ((), {"input": x})
    with pytest.raises(VerifyError, match=r"^the model factory returned a Linear: return \(model, "
                                          r"example_inputs\), or a model with an `example_inputs` "
                                          r"attribute or method$"):
        _build(lambda: torch.nn.Linear(3, 3))
    with pytest.raises(VerifyError, match=r"^the model factory returned a str as the model, not a "
                                          r"torch.nn.Module$"):
        _build(lambda: ("model", x))
    with pytest.raises(ActcfgError, match=r"^example inputs are a int: give a tensor"):
        _split_inputs(3)
