"""Every code block of README.md and docs/*.md runs in CI as written, or says why not (issue 19).

A block is a fenced block (```lang ... ```). An HTML comment on the line right above it says how
it is checked; without one, its language does:

- `<!-- gpu -->` or `<!-- gpu: what is checked -->`: run the same way, in the CUDA suite
  (`test_gpu_block_runs_as_written`, marked `cuda`, skipped without a GPU).
- `<!-- file: NAME -->`: written to NAME in the document's scratch directory, for the blocks
  after it (a transcript runs a command on it); a later block of the document must name it.
- `<!-- tested-by: tests/FOLDER/FILE.py::TEST -->`: that test runs the block (checked: it exists, and
  reads its block from the same document).
- `<!-- not-run: reason -->`: never run; the reason is required and becomes the skip reason.

By language, for a block without a marker (and for a `gpu` one):

- `bash`: each command runs in a scratch copy of configs/ and docs/, with `actcfg` on PATH being
  this checkout's, and must exit 0. Commands that set up an environment are checked for their
  shape instead of run (they need the network and minutes, and CI has installed what they
  install already): `python -m venv DIR` and `. DIR/bin/activate`; `python -m pip install`,
  which may install only this checkout (`-e`) with extras pyproject.toml defines, or torch at
  a version the `torch` extra allows (the CPU wheel only from PyTorch's index); and
  `python -m pytest`, the suite itself, whose `-m` may name only markers pyproject.toml declares
  (tests/project/test_init.py keeps the README's test command equal to .ci/run).
- `python`: exec'd in the scratch directory.
- `yaml`: a policy (it has `version:`) must validate with no error; anything else must parse.
- no language: a transcript. `$ COMMAND` lines run as above; the lines after one, up to the
  next, are its output (stdout and stderr as they interleave), compared exactly; a GPU
  transcript's numbers vary, so there the exit code (0) and the verdict names are compared.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from _timeouts import scaled
from conftest import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
MARKERS = {m.split(":", 1)[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\n", re.M | re.S)
_MARKER = re.compile(r"^<!-- (gpu|file|tested-by|not-run)(?:: (.*?))? -->$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and the marker above it."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str | None
    argument: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    text = path.read_text()
    out = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = _MARKER.match(above)
        if above.startswith("<!--") and not marked:
            raise ValueError(f"{path.name}:{line - 1}: unknown marker {above!r} (gpu, file, tested-by, not-run)")
        out.append(Block(path, line, match.group(1), match.group(2),
                         marked.group(1) if marked else None, marked.group(2) if marked else None))
    return out


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]
RUNNABLE = [b for b in BLOCKS if b.marker is None and b.lang in ("bash", "python", "yaml", "")]
GPU = [b for b in BLOCKS if b.marker == "gpu"]


# --- running a block ----------------------------------------------------------------------


def _scratch(tmp_path: Path, block: Block) -> Path:
    """A copy of configs/ and docs/, with the document's `file:` blocks above `block` written."""
    work = tmp_path / "work"
    for name in ("configs", "docs"):
        shutil.copytree(ROOT / name, work / name)
    for earlier in blocks_of(block.path):
        if earlier.marker == "file" and earlier.line < block.line:
            (work / earlier.argument).write_text(earlier.text)
    return work


def _environment(tmp_path: Path) -> dict[str, str]:
    """`actcfg` on PATH runs this checkout with this interpreter, as `pip install -e .` would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "actcfg"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m actcfg "$@"\n')
    shim.chmod(0o755)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    keep = {k: v for k, v in os.environ.items() if k not in ("GITHUB_ACTIONS", "PYTHONPATH")}
    return keep | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
                   "PYTHONUNBUFFERED": "1"}


def _setup_shape(command: str) -> str | None:
    """Why `command` is an environment step checked for shape (None: it is to be run). Raises
    AssertionError when it is such a step but could not work from a checkout."""
    words = shlex.split(command, comments=True)
    if words[:3] == ["python", "-m", "venv"]:
        assert len(words) == 4, command
        return "makes a virtual environment"
    if words[:1] in (["."], ["source"]):
        assert len(words) == 2 and words[1].endswith("/bin/activate"), command
        return "activates the virtual environment"
    if words[:4] == ["python", "-m", "pip", "install"]:
        _check_install(words[4:], command)
        return "installs packages"
    if words[:3] == ["python", "-m", "pytest"]:
        if "-m" in words[3:]:
            expression = words[words.index("-m", 3) + 1]
            named = set(re.findall(r"\w+", expression)) - {"not", "and", "or"}
            assert named <= MARKERS, f"{command}: {named - MARKERS} not declared in pyproject.toml"
        return "the test suite itself"
    return None


def _check_install(arguments: list[str], command: str) -> None:
    from packaging.requirements import Requirement

    editable = False
    index = None
    for i, word in enumerate(arguments):
        if word in ("-q", "-U", "--upgrade"):
            continue
        if word == "-e":
            editable = True
            continue
        if i and arguments[i - 1] == "--index-url":
            index = word
            continue
        if word == "--index-url":
            continue
        if word == "." or word.startswith(".["):
            assert editable, f"{command}: install the checkout editable (-e), as the README does"
            extras = set(word[2:-1].split(",")) if word != "." else set()
            assert extras <= set(EXTRAS), f"{command}: no extra {extras - set(EXTRAS)} in pyproject.toml"
            continue
        requirement = Requirement(word)
        assert requirement.name == "torch", f"{command}: {word} is neither this checkout nor torch"
        allowed = Requirement(EXTRAS["torch"][0]).specifier
        pinned = next(iter(requirement.specifier)).version
        assert pinned in allowed, f"{command}: torch {pinned} is outside the torch extra ({allowed})"
    assert index in (None, CPU_WHEEL_INDEX), f"{command}: unknown index {index}"


def _shell_commands(text: str) -> list[str]:
    """The commands of a bash block: each line, split at `&&` (comment lines dropped)."""
    commands = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            commands += [part.strip() for part in line.split("&&")]
    return commands


def _run_shell(block: Block, tmp_path: Path) -> None:
    runnable = [c for c in _shell_commands(block.text) if _setup_shape(c) is None]
    if not runnable:
        return
    work, env = _scratch(tmp_path, block), _environment(tmp_path)
    for command in runnable:
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=scaled(600), stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{block.id}: `{command}` exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def _transcript(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each `$ ` line of a transcript."""
    runs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        else:
            assert runs, f"a transcript starts with `$ COMMAND`, not {line!r}"
            runs[-1][1].append(line)
    return runs


def _run_transcript(block: Block, tmp_path: Path, gpu: bool) -> None:
    work, env = _scratch(tmp_path, block), _environment(tmp_path)
    for command, expected in _transcript(block.text):
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=scaled(600),
                              stdin=subprocess.DEVNULL)
        got = proc.stdout.rstrip("\n").splitlines()
        if gpu:  # measured numbers vary: the verdicts and their names must be the documented ones
            assert proc.returncode == 0, f"{block.id}: `{command}` exited {proc.returncode}:\n{proc.stdout}"
            verdicts = [" ".join(line.split()[:2]) for line in expected if line.startswith(("PASS", "FAIL"))]
            assert [" ".join(line.split()[:2]) for line in got if line.startswith(("PASS", "FAIL"))] == verdicts
        else:
            assert proc.returncode in (0, 1), f"{block.id}: `{command}` exited {proc.returncode}:\n{proc.stdout}"
            assert got == expected, f"{block.id}: `{command}` printed otherwise"


def _run_python(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_scratch(tmp_path, block))
    namespace = {"__name__": "__docs__"}
    exec(compile(block.text, str(block.path.relative_to(ROOT)), "exec"), namespace)


def _check_yaml(block: Block, tmp_path: Path) -> None:
    from actcfg.policy.checker import check_file

    data = yaml.safe_load(block.text)
    if isinstance(data, dict) and "version" in data:
        path = tmp_path / "block.yaml"
        path.write_text(block.text)
        policy, diagnostics = check_file(path)
        errors = [str(d) for d in diagnostics if d.severity == "error"]
        assert policy is not None and errors == [], f"{block.id}: {errors}"


def run_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool = False) -> None:
    """Run or check one block as its language says."""
    if block.lang == "bash":
        _run_shell(block, tmp_path)
    elif block.lang == "python":
        _run_python(block, tmp_path, monkeypatch)
    elif block.lang == "yaml":
        _check_yaml(block, tmp_path)
    elif block.lang == "":
        _run_transcript(block, tmp_path, gpu)
    else:
        raise AssertionError(f"{block.id}: no runner for ```{block.lang}; mark it")


# --- the tests ------------------------------------------------------------------------------


def test_every_block_is_run_or_marked_with_a_reason():
    assert len(BLOCKS) >= 15  # the extractor sees the blocks (README and docs/keys.md)
    for block in BLOCKS:
        if block.marker in ("not-run", "file", "tested-by"):
            assert block.argument, f"{block.id}: <!-- {block.marker}: ... --> needs its argument"
        if block.marker is None:
            assert block.lang in ("bash", "python", "yaml", ""), f"{block.id}: ```{block.lang} has no runner"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_as_written(block, tmp_path, monkeypatch):
    run_block(block, tmp_path, monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize("block", GPU, ids=[b.id for b in GPU])
def test_gpu_block_runs_as_written(block, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_block(block, tmp_path, monkeypatch, gpu=True)


GPU_SHELL = [b for b in GPU if b.lang == "bash"]


@pytest.mark.parametrize("block", GPU_SHELL, ids=[b.id for b in GPU_SHELL])
def test_gpu_shell_blocks_install_what_exists_and_run_actcfg(block):
    """On the CPU, what a GPU block installs is still checked: extras that exist, from the checkout."""
    commands = _shell_commands(block.text)
    shapes = [_setup_shape(c) for c in commands]  # raises for an install that cannot work
    assert all(c.startswith("actcfg ") for c, shape in zip(commands, shapes) if shape is None), block.id


SKIPPED = [b for b in BLOCKS if b.marker == "not-run"]


@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.skip(reason=b.argument or "no reason"))
                                   for b in SKIPPED], ids=[b.id for b in SKIPPED])
def test_not_run_block(block):
    raise AssertionError("never runs: the skip reason is the block's")


FILES = [b for b in BLOCKS if b.marker == "file"]


@pytest.mark.parametrize("block", FILES, ids=[b.id for b in FILES])
def test_a_file_block_is_used_by_a_later_block(block):
    later = [b for b in blocks_of(block.path) if b.line > block.line]
    assert any(block.argument in b.text for b in later), f"{block.id}: nothing after it reads {block.argument}"


TESTED_BY = [b for b in BLOCKS if b.marker == "tested-by"]


@pytest.mark.parametrize("block", TESTED_BY, ids=[b.id for b in TESTED_BY])
def test_a_tested_by_block_names_a_test_that_reads_its_document(block):
    file, name = block.argument.split("::")
    source = (ROOT / file).read_text()
    assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{block.id}: no test {block.argument}"
    assert block.path.name in source, f"{file} never reads {block.path.name}"


def test_the_readme_starts_with_the_two_commands_of_a_fresh_machine():
    """Set up and run the main job on configs/, then the tests: the first block, two commands,
    with the virtual environment made and the CPU wheel advised before torch is installed."""
    first = BLOCKS[0]
    assert (first.path.name, first.lang, first.marker) == ("README.md", "bash", None)
    lines = first.text.splitlines()
    commands = [line for line in lines if line and not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].startswith("python -m venv .venv && . .venv/bin/activate && python -m pip install -e . && ")
    assert "actcfg validate configs/*.yaml" in commands[0]
    cpu_wheel = next(i for i, line in enumerate(lines) if CPU_WHEEL_INDEX in line)
    installs_torch = next(i for i, line in enumerate(lines) if "'torch==" in line and not line.startswith("#"))
    assert cpu_wheel < installs_torch


def test_the_shape_check_refuses_what_cannot_work_from_a_checkout():
    for command in ("python -m pip install actcfg", "python -m pip install '.[nope]'",
                    "python -m pip install -e '.[nope]'", "python -m pip install torch==1.0",
                    "python -m pip install torch==2.13.0 --index-url https://example.invalid/simple",
                    'python -m pytest -m "not fast"'):
        with pytest.raises(AssertionError):
            _setup_shape(command)
    assert _setup_shape("python -m pip install -e '.[torch,plot]'") == "installs packages"
    assert _setup_shape(f"python -m pip install torch==2.13.0 --index-url {CPU_WHEEL_INDEX}") == "installs packages"
    assert _setup_shape("actcfg validate configs/*.yaml") is None
