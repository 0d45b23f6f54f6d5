"""The tests mirror the code (issue 21): each test file sits in a folder named after the actcfg
package or module it tests, so a newcomer finds a module's tests where the module is.
docs/architecture.md draws the map; this file keeps it true."""

from __future__ import annotations

from collections import Counter

from conftest import ROOT

TESTS = ROOT / "tests"
PACKAGE = ROOT / "actcfg"
# Folders that are not an actcfg package, and why they may hold tests.
OTHER_HOMES = {
    "project": "repo-wide checks: layers, docs, the public API, the tests' own helpers",
    "peer": "PyTorch's, transformers' and DeepSpeed's own checkpointing tests, ported",
    "benchmarks": "the logic of the scripts in the repository's benchmarks/ folder",
}


def _homes() -> set[str]:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    return packages | modules | set(OTHER_HOMES)


def _test_files():
    return sorted(TESTS.rglob("test_*.py"))


def test_no_test_file_is_left_at_the_top_of_tests():
    flat = [p.name for p in TESTS.glob("test_*.py")]
    assert flat == [], (f"move {flat} into the tests/ folder of the package each tests "
                        "(tests/policy/, tests/runtime/, ...; see docs/architecture.md)")


def test_every_test_folder_is_named_after_what_it_tests():
    homes = _homes()
    folders = {p.parent.relative_to(TESTS).parts[0] for p in _test_files() if p.parent != TESTS}
    assert folders, "no test folder found: is TESTS right?"
    strangers = [f"tests/{name}/" for name in sorted(folders - homes)]
    assert strangers == [], (f"{strangers} match no actcfg package or module; name the folder "
                             f"after one of {sorted(homes - set(OTHER_HOMES))}")
    # benchmarks/ holds tests only while the repository has the scripts they test
    assert (ROOT / "benchmarks").is_dir() or "benchmarks" not in folders


def test_test_folders_are_one_level_deep():
    deep = [str(p.relative_to(TESTS)) for p in _test_files() if len(p.relative_to(TESTS).parts) > 2]
    assert deep == []


def test_no_two_test_modules_share_a_basename():
    # pytest's default (prepend) import mode imports a test module by its basename when its
    # folder has no __init__.py: two equal basenames are an error at collection
    plain = [p.name for p in _test_files() if not (p.parent / "__init__.py").exists()]
    twice = sorted(name for name, n in Counter(plain).items() if n > 1)
    assert twice == []
