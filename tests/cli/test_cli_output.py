"""cli: where `-o` writes (issue 20's adversarial pass). The shell's redirection target behind
`/dev/stdout` is written through, never replaced; a file the shell's `>` could not write is
refused; `actcfg plan` checks its target before it profiles; a factory's failure is a sentence.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import actcfg.cli
from actcfg.cli._launch import build_model
from actcfg.cli._output import Usage
from conftest import ROOT

DS_CPU = ROOT / "configs" / "deepspeed-cpu-checkpointing.yaml"
BUDGET = ROOT / "configs" / "torch-memory-budget.yaml"


def _translate_json() -> str:
    proc = _actcfg("translate", str(DS_CPU))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _actcfg(*argv: str, **streams) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.run([sys.executable, "-m", "actcfg", *argv], cwd=ROOT, env=env, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, **options)


# --- -o /dev/stdout, /dev/stderr, /dev/fd/N: through the stream ------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/stdout"), reason="no /dev/stdout")
def test_dev_stdout_appended_to_a_log_keeps_the_log(tmp_path):
    # `actcfg translate p.yaml -o /dev/stdout >> build.log` replaced build.log (issue 20).
    log = tmp_path / "build.log"
    log.write_text("earlier build output\n")
    with open(log, "a") as appended:  # what the shell's `>>` opens
        proc = _actcfg("translate", str(DS_CPU), "-o", "/dev/stdout", stdout=appended)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert log.read_text() == "earlier build output\n" + _translate_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.log"]  # no temporary left


@pytest.mark.skipif(not os.path.exists("/dev/stderr"), reason="no /dev/stderr")
def test_dev_stderr_appended_to_a_log_keeps_the_log(tmp_path):
    log = tmp_path / "err.log"
    log.write_text("earlier\n")
    with open(log, "a") as appended:
        proc = _actcfg("translate", str(DS_CPU), "-o", "/dev/stderr", stderr=appended)
    assert (proc.returncode, proc.stdout) == (0, "")
    assert log.read_text() == "earlier\n" + _translate_json()


@pytest.mark.skipif(not os.path.exists("/dev/stdout"), reason="no /dev/stdout")
def test_dev_stdout_through_a_pipe():
    # realpath gave /proc/<pid>/fd/pipe:[N], which does not exist: "No such file or directory".
    proc = _actcfg("translate", str(DS_CPU), "-o", "/dev/stdout")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert json.loads(proc.stdout)["activation_checkpointing"]["cpu_checkpointing"] is True


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="no /dev/fd")
def test_another_descriptor_is_written_through(tmp_path):
    log = tmp_path / "three.log"
    log.write_text("kept\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        proc = _actcfg("translate", str(DS_CPU), "-o", f"/dev/fd/{fd}", pass_fds=(fd,))
    finally:
        os.close(fd)
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")
    assert log.read_text() == "kept\n" + _translate_json()


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="no /dev/fd")
def test_a_descriptor_that_is_not_open_is_a_usage_error(run_cli):
    fd = os.open(os.devnull, os.O_WRONLY)
    os.close(fd)  # a number that is certainly closed now
    result = run_cli("translate", DS_CPU, "-o", f"/dev/fd/{fd}")
    assert (result.code, result.out) == (2, "")
    assert result.err == f"actcfg: error: cannot write /dev/fd/{fd}: Bad file descriptor\n"


# --- a read-only file: refused as the shell's `>` refuses it ---------------------------------


def _unprivileged(run) -> int:
    """`run()` (an exit code) as an unprivileged user: root writes a read-only file anyway,
    as the shell's `>` does for it. Forked, so nothing is imported as that user."""
    if os.geteuid() != 0:
        return run()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 99
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = run()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_read_only_file_is_refused_and_kept(tmp_path):
    # os.replace needs only the folder's permission: the file was replaced (issue 20).
    actcfg.cli.main(["translate", str(DS_CPU), "-o", str(tmp_path / "warm.json")])  # imports done
    folder = tempfile.mkdtemp(prefix="actcfg-ro-")
    # The unprivileged user must read the policy: the checkout may sit in a folder only root
    # reads (a `mktemp -d` clone), so it reads a copy from a folder everyone may read.
    readable = tempfile.mkdtemp(prefix="actcfg-policy-")
    os.chmod(readable, 0o755)
    policy = os.path.join(readable, DS_CPU.name)
    with open(policy, "w") as f:
        f.write(DS_CPU.read_text())
    os.chmod(policy, 0o644)
    try:
        os.chmod(folder, 0o777)  # the folder allows the rename; the file does not allow writing
        target = os.path.join(folder, "out.json")
        with open(target, "w") as f:
            f.write("the user's read-only file\n")
        os.chmod(target, 0o444)
        err = os.path.join(folder, "stderr.txt")

        def run() -> int:
            with open(err, "w") as stream, contextlib.redirect_stderr(stream):
                return actcfg.cli.main(["translate", policy, "-o", target])

        assert _unprivileged(run) == 2
        with open(err) as f:
            assert f.read() == f"actcfg: error: cannot write {target}: Permission denied\n"
        with open(target) as f:
            assert f.read() == "the user's read-only file\n"
        assert sorted(os.listdir(folder)) == ["out.json", "stderr.txt"]
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
        os.unlink(policy)
        os.rmdir(readable)


def test_a_file_in_a_folder_that_takes_no_new_file_is_refused_saying_so(run_cli):
    # /proc/version exists and root may open it for writing, but /proc takes no new file: the
    # temporary beside it failed, and the message said the target did not exist.
    target = "/proc/version"
    try:
        os.close(os.open(target, os.O_WRONLY))
    except OSError:
        pytest.skip("this process may not open /proc/version for writing (not root)")
    before = Path(target).read_text()
    done = run_cli("schema", "-o", target)
    assert (done.code, done.err) == (2, (
        "actcfg: error: cannot write /proc/version: /proc takes no new file (No such file or "
        "directory), and actcfg writes the whole file beside its target before replacing it; "
        "write it elsewhere, or to /dev/stdout and redirect\n"))
    assert Path(target).read_text() == before


# --- actcfg plan: the target checked before any GPU work; the factory's failure ------------------


@pytest.mark.parametrize("target", ["{tmp}", "{tmp}/missing/plan.yaml"])
def test_plan_checks_its_output_before_profiling(run_cli, tmp_path, target):
    # -o DIR was found after 14 s of profiling and measuring, and the plan was lost.
    out = target.format(tmp=tmp_path)
    result = run_cli("plan", BUDGET, "--model", "actcfg.probes:blocks", "-o", out)
    reason = "it is a directory" if out == str(tmp_path) else "No such file or directory"
    assert (result.code, result.out, result.err) == (2, "", f"actcfg: error: cannot write {out}: {reason}\n")
    result = run_cli("plan", BUDGET, "--model", "actcfg.probes:blocks", "-o", out, "--format", "json")
    assert (result.code, result.err) == (2, "")
    assert json.loads(result.out)["message"] == f"cannot write {out}: {reason}"


def test_plan_refuses_a_zero_budget(run_cli):
    result = run_cli("plan", BUDGET, "--model", "actcfg.probes:blocks", "--budget", "0GiB")
    assert (result.code, result.out) == (2, "")
    assert result.err == ("actcfg: error: --budget '0GiB': a budget of 0 bytes leaves no room for "
                          "a training step\n")


def _raises():
    raise RuntimeError("CUDA error: out of cheese")


def _not_a_model():
    return 42


@pytest.mark.parametrize(("factory", "message"), [
    (_raises, "--model tests:factory: the model factory raised RuntimeError: CUDA error: out of cheese"),
    (_not_a_model, "--model tests:factory: the model factory returned a int: return (model, "
                   "example_inputs), or a model with an `example_inputs` attribute or method"),
])
def test_a_factory_that_fails_is_a_usage_sentence(factory, message):
    # "internal error, please report" (raised) and exit 1, the "no plan fits" code (wrong type).
    with pytest.raises(Usage) as info:
        build_model(factory, "tests:factory")
    assert str(info.value) == message


def test_plan_sizes_print_in_a_unit_that_shows_them():
    from actcfg.units import memory_size

    # A 1 KiB budget printed as "0.0 MiB".
    assert [memory_size(n) for n in (1024, 512, 3 * 2**20 // 2, 5 * 2**30 // 2)] == [
        "1.0 KiB", "512 B", "1.5 MiB", "2.50 GiB"]


# --- on the GPU machine: the CLI paths that run past the CUDA check ---------------------------


@pytest.fixture
def gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")


def small_blocks():
    """A factory for `actcfg plan --model test_cli_output:small_blocks`: four small blocks."""
    import torch

    from actcfg.verification.models import blocks

    torch.manual_seed(0)
    return blocks(n=4, d_model=256, heads=4, ffn=1024, batch=4, seq=256)


@pytest.mark.cuda
@pytest.mark.parametrize(("factory", "message"), [
    ("_raises", "the model factory raised RuntimeError: CUDA error: out of cheese"),
    ("_not_a_model", "the model factory returned a int: return (model, example_inputs), or a "
                     "model with an `example_inputs` attribute or method"),
])
def test_plan_with_a_failing_factory_exits_2_with_a_sentence(run_cli, gpu, factory, message):
    result = run_cli("plan", BUDGET, "--model", f"test_cli_output:{factory}")
    assert (result.code, result.out) == (2, "")
    assert result.err == f"actcfg: error: --model test_cli_output:{factory}: {message}\n"


@pytest.mark.cuda
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_plan_that_cannot_be_written_after_profiling_is_printed_not_lost(run_cli, gpu, tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text("version: 1\ncheckpoint: {mode: auto, modules: [Block]}\nmemory_budget: 1GiB\n")
    result = run_cli("plan", config, "--model", "test_cli_output:small_blocks", "-o", "/dev/full")
    assert result.code == 2
    assert result.err.endswith("actcfg: error: cannot write /dev/full: No space left on device; "
                               "the plan is printed on standard output instead\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(result.out[result.out.index("# Written by actcfg plan"):])
    assert run_cli("validate", plan).code == 0
