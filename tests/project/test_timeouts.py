"""tests/_timeouts.py: ACTCFG_TEST_TIMEOUT_SCALE stretches every process limit the tests set."""

from __future__ import annotations

import pytest
from _timeouts import SCALE_VARIABLE, scaled


def test_the_scale_multiplies_and_defaults_to_one(monkeypatch):
    monkeypatch.delenv(SCALE_VARIABLE, raising=False)
    assert scaled(120) == 120
    monkeypatch.setenv(SCALE_VARIABLE, "2.5")
    assert scaled(120) == 300


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "nan"])
def test_a_scale_that_is_not_a_positive_number_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(SCALE_VARIABLE, raw)
    with pytest.raises(ValueError, match=rf"^ACTCFG_TEST_TIMEOUT_SCALE='{raw}' is not a positive number"):
        scaled(120)


def _sleeper(rank: int, out_dir: str, port: int) -> None:
    import time

    time.sleep(60)


@pytest.mark.slow
def test_ranks_past_the_scaled_limit_are_stopped_at_it(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from _multirank import run_ranks

    monkeypatch.setenv(SCALE_VARIABLE, "0.005")  # the default 600 s becomes 3 s
    with pytest.raises(pytest.fail.Exception, match=r"^the 2 ranks ran longer than 3 s and were stopped$"):
        run_ranks(_sleeper, tmp_path)
