"""verify without a GPU: its refusals and the `actcfg verify` CLI (exit codes, output). The
judge, the reports, the factory and the measurement each have their own file in
tests/verification/; the measurement on a GPU is in test_verify_cuda.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from actcfg.errors import ActcfgError, VerifyError
from actcfg.verification import VerifyReport, verify
from actcfg.verification.render import render_text

from _verify_cases import GROWING, OFFLOAD, ROOT, measured, report


# --- refusals ------------------------------------------------------------------------------------


def test_verify_refuses_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(VerifyError, match=r"^actcfg verify measures GPU memory and needs a CUDA "
                                          r"GPU, but torch.cuda.is_available\(\) is False here: "
                                          r"run it on a GPU machine$"):
        verify(lambda: None, OFFLOAD)


def test_verify_refuses_zero_steps():
    with pytest.raises(VerifyError, match=r"^steps must be at least 1, got 0$"):
        verify(lambda: None, OFFLOAD, steps=0)


def test_verify_refuses_an_unknown_backend_with_the_choices():
    with pytest.raises(ActcfgError, match=r"^unknown backend 'deepsped': choose one of "
                                          r"deepspeed, hf, lightning, torch$"):
        verify(lambda: None, OFFLOAD, backend="deepsped")


def test_judging_and_rendering_import_no_torch():
    code = ("import sys, actcfg.verification, actcfg.verification.render, actcfg.verification.judge, actcfg.verification.report; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "False\n"


# --- the CLI: exit codes and output --------------------------------------------------------------

SEED_CONFIG = str(ROOT / "configs" / "seed-linear-offload.yaml")
BAD_MODE = str(ROOT / "tests" / "data" / "invalid" / "bad-mode.yaml")


@pytest.fixture
def measured_as(monkeypatch):
    """Replace the GPU measurement (only it) with a synthetic report, to pin the CLI's mapping."""
    import actcfg.verification as module

    def use(rep: VerifyReport) -> list[dict]:
        calls: list[dict] = []

        def fake_verify(factory, cfg, **kwargs):
            calls.append({"factory": factory, "cfg": cfg, **kwargs})
            return rep

        monkeypatch.setattr(module, "require_cuda", lambda: None)
        monkeypatch.setattr(module, "verify", fake_verify)
        return calls

    return use


def test_cli_exit_0_when_every_promise_holds(run_cli, measured_as):
    calls = measured_as(report())
    done = run_cli("verify", SEED_CONFIG, "--steps", "5")
    assert (done.code, done.out, done.err) == (0, render_text(report()), "")
    (call,) = calls
    from actcfg.probes import linear_chain

    assert call["factory"] is linear_chain
    assert call["cfg"] == OFFLOAD
    assert (call["steps"], call["backend"]) == (5, None)


def test_cli_exit_1_when_a_promise_fails_and_json_says_why(run_cli, measured_as):
    failing = report(OFFLOAD, measured(GROWING))
    measured_as(failing)
    done = run_cli("verify", SEED_CONFIG, "--format", "json", "--model", "actcfg.probes:blocks")
    assert done.code == 1
    assert json.loads(done.out)["verdicts"][0] == {
        "promise": "cpu_checkpointing", "ok": False,
        "message": "cpu_checkpointing is on but GPU memory grew by 0.26 GB per block, the size of "
                   "one block input: the offload did not take effect"}


def test_cli_writes_the_plot(run_cli, measured_as, tmp_path):
    pytest.importorskip("matplotlib")
    measured_as(report())
    done = run_cli("verify", SEED_CONFIG, "--plot", tmp_path / "memory.png")
    assert done.code == 0
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plot_without_matplotlib_is_refused_before_measuring(run_cli, measured_as, monkeypatch):
    calls = measured_as(report())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    done = run_cli("verify", SEED_CONFIG, "--plot", "memory.png")
    assert (done.code, done.err) == (2, "actcfg: error: --plot needs matplotlib, which is not installed: "
                                        "python -m pip install -e '.[plot]' in the actcfg checkout\n")
    assert calls == []


@pytest.mark.parametrize(("argv", "err"), [
    (["--model", "actcfg.probes"], "actcfg: error: --model 'actcfg.probes': write it as "
                                   "pkg.module:factory (for example actcfg.probes:linear_chain)\n"),
    (["--steps", "0"], "actcfg: error: --steps must be at least 1, got 0\n"),
])
def test_cli_usage_errors_exit_2(run_cli, measured_as, argv, err):
    calls = measured_as(report())
    done = run_cli("verify", SEED_CONFIG, *argv)
    assert (done.code, done.out, done.err) == (2, "", err)
    assert calls == []


def test_cli_invalid_config_prints_the_validate_diagnostics_and_exits_1(run_cli, measured_as):
    # STYLE rule 8: an invalid policy is 1, as `validate` and `translate` say; it was 2.
    calls = measured_as(report())
    done = run_cli("verify", BAD_MODE)
    assert (done.code, done.out) == (1, "")
    assert done.err.startswith(f"{BAD_MODE}:3:9: error bad-choice: ")
    assert calls == []


def test_cli_unreadable_config_exits_2(run_cli, measured_as, tmp_path):
    calls = measured_as(report())
    done = run_cli("verify", tmp_path / "missing.yaml")
    assert (done.code, done.out) == (2, "")
    assert done.err.startswith(f"{tmp_path / 'missing.yaml'}:") and " error file-not-found: " in done.err
    assert calls == []


@pytest.mark.parametrize(("m", "code"), [(None, 2), (measured(GROWING), 1)])
def test_cli_plot_write_error_does_not_hide_a_failed_verify(run_cli, measured_as, tmp_path, m, code):
    # The plot is written after the verdicts: a failed promise still exits 1, only a passing
    # run exits 2 for the write error.
    pytest.importorskip("matplotlib")
    rep = report(OFFLOAD, m)
    measured_as(rep)
    where = tmp_path / "no-such-dir" / "memory.png"
    done = run_cli("verify", SEED_CONFIG, "--plot", where)
    assert (done.code, done.out) == (code, render_text(rep))
    assert done.err == (f"actcfg: error: --plot: cannot write {where}: No such file or "
                        "directory\n")


@pytest.mark.parametrize(("argv", "started"), [
    ([SEED_CONFIG], False),
    ([SEED_CONFIG, "--backend", "deepspeed"], True),
    ([str(ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml")], True),
    ([str(ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"), "--backend", "torch"], False),
])
def test_cli_starts_a_process_group_only_for_the_deepspeed_backend(
        run_cli, measured_as, monkeypatch, argv, started):
    """The CLI scopes the measurement in `process_group(backend)`, which starts a one-process
    group for the deepspeed backend only (here it records instead of starting NCCL)."""
    import contextlib

    import actcfg.cli.verify as cli

    measured_as(report())
    backends: list[str] = []

    @contextlib.contextmanager
    def recorded(backend):
        backends.append(backend)
        yield

    real = cli.process_group
    monkeypatch.setattr(cli, "process_group", recorded)
    done = run_cli("verify", *argv)
    assert done.code == 0
    assert backends == ["deepspeed" if started else "torch"]
    import torch.distributed as dist

    before = dist.is_initialized()
    with real(cli.Backend.TORCH):  # the torch backend starts nothing
        assert dist.is_initialized() == before


def test_cli_without_a_gpu_exits_2_with_the_reason():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "actcfg", "verify", SEED_CONFIG],
                          capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("actcfg: error: actcfg verify measures GPU memory and needs a CUDA "
                           "GPU, but torch.cuda.is_available() is False here: run it on a GPU "
                           "machine\n")
