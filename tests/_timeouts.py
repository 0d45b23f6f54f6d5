"""Test timeouts that a loaded machine can stretch: every limit a test sets on a process is
`scaled(seconds)`, the seconds times ACTCFG_TEST_TIMEOUT_SCALE (default 1).

The defaults are generous already (a 2-core CI machine under load ran one case 50x slower than
an idle one); a slower machine sets e.g. ACTCFG_TEST_TIMEOUT_SCALE=4 rather than turning a
pass into a timeout error. The limits exist to end a hang, never to judge speed.
"""

from __future__ import annotations

import os

SCALE_VARIABLE = "ACTCFG_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor from ACTCFG_TEST_TIMEOUT_SCALE; a value that is not a positive number stops
    the run with the variable's name rather than running with a silent default."""
    raw = os.environ.get(SCALE_VARIABLE, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = 0.0
    if not scale > 0:
        raise ValueError(f"{SCALE_VARIABLE}={raw!r} is not a positive number (e.g. 1, 2.5, 4)")
    return scale


def scaled(seconds: float) -> float:
    """`seconds` stretched by ACTCFG_TEST_TIMEOUT_SCALE."""
    return seconds * timeout_scale()
