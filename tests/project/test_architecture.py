"""The layers of docs/architecture.md hold: no module imports from a layer above its own, and
none imports another module's private names. Read from the source with `ast` (imports inside
functions count too), so a lazy upward import is caught like a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "actcfg"

# Lowest first, as docs/architecture.md draws them; the package root (the public functions)
# and __main__ sit above everything.
LAYERS = {
    "errors": 0, "units": 0, "_version": 0,
    "backends": 1,
    "policy": 2,
    "translators": 3,
    "runtime": 4,
    "plan": 5,
    "api": 6,
    "verification": 7, "integrations": 7, "probes": 7,
    "cli": 8,
}
TOP = 9


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[:1] != ["actcfg"]:
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return TOP
    return LAYERS[parts[1]]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every actcfg import in the file, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "actcfg"]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, *([name] if name else [])])
            if name.split(".")[0] == "actcfg":
                found.append((name, [a.name for a in node.names]))
    return found


def test_every_package_has_a_layer():
    tops = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert tops - {"__init__", "__main__"} == set(LAYERS)


@pytest.mark.parametrize(("module", "path"), _modules(), ids=lambda v: str(v))
def test_no_module_imports_from_a_layer_above_it_or_a_private_name(module, path):
    mine = _layer(module)
    for target, names in _imports(path, module):
        # `from actcfg import X` names a submodule or a public function of the root
        targets = [f"actcfg.{n}" for n in names] if target == "actcfg" else [target]
        for t in targets:
            if t == "actcfg" or t.split(".")[1] in ("__init__", "__main__"):
                above = mine < TOP
            else:
                above = _layer(t) > mine
            assert not above, f"{module} imports {t}, a layer above its own"
        # a private name of another module; a package's private modules (`backends/_torch_only`)
        # are its own business, and its siblings may use them
        private = [n for n in names if n.startswith("_") and not n.startswith("__")
                   and not (PACKAGE / Path(*target.split(".")[1:]) / f"{n}.py").exists()]
        assert not private, f"{module} imports private names {private} from {target}"
