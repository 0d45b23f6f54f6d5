"""actcfg/policy/_descriptions.py is the field docstrings of actcfg/policy/schema.py, and nothing else.

The docstring under each field is the one source of its description (STYLE.md rule 4).
Pydantic's `use_attribute_docstrings=True` re-reads schema.py's source on every import,
which cost `actcfg validate` about 9 ms cold; instead the descriptions are derived here,
with `ast` and `inspect.cleandoc` as Pydantic does, and written to actcfg/policy/_descriptions.py,
which schema.py passes as `Field(description=...)`. These tests fail when a docstring and
the generated file disagree. To regenerate after editing a docstring:

    python tests/policy/test_descriptions.py
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "actcfg" / "policy" / "schema.py"
GENERATED = ROOT / "actcfg" / "policy" / "_descriptions.py"
REGENERATE = "python tests/policy/test_descriptions.py"

_HEADER = f'''"""Field descriptions for `actcfg schema`: the docstring under each field in schema.py.

Generated; do not edit. After changing a field docstring in schema.py, run
`{REGENERATE}` (tests/policy/test_descriptions.py fails until then).
"""

'''


def derive(source: str) -> dict[str, str]:
    """`Class.field` -> cleaned docstring, for every annotated class attribute followed by a
    string literal (the rule of Pydantic's `use_attribute_docstrings`)."""
    out: dict[str, str] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node, after in zip(cls.body, cls.body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                out[f"{cls.name}.{node.target.id}"] = inspect.cleandoc(after.value.value)
    return out


def render(descriptions: dict[str, str]) -> str:
    """The text of actcfg/policy/_descriptions.py for `descriptions`."""
    lines = [f"    {key!r}: {text!r},\n" for key, text in descriptions.items()]
    return _HEADER + "DESCRIPTIONS: dict[str, str] = {\n" + "".join(lines) + "}\n"


def _expected() -> str:
    return render(derive(SCHEMA.read_text(encoding="utf-8")))


def test_generated_descriptions_match_the_docstrings():
    assert GENERATED.read_text(encoding="utf-8") == _expected(), (
        f"actcfg/policy/_descriptions.py is out of date with the field docstrings in schema.py: run `{REGENERATE}`"
    )


def test_every_field_is_described_by_its_own_docstring():
    from pydantic import BaseModel

    from actcfg.policy import schema

    docstrings = derive(SCHEMA.read_text(encoding="utf-8"))
    models = [m for m in vars(schema).values()
              if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == schema.__name__]
    assert {m.__name__ for m in models} >= {"NoCheckpoint", "FullCheckpoint", "SelectiveCheckpoint", "Policy"}
    for model in models:
        for name, info in model.model_fields.items():
            owner = next(c for c in model.__mro__ if name in c.__dict__.get("__annotations__", {}))
            key = f"{owner.__name__}.{name}"
            assert key in docstrings, f"{key} has no docstring (STYLE.md rule 4)"
            assert info.description == docstrings[key], (
                f"{model.__name__}.{name} is not described by the docstring of {key}: "
                f"pass description=_DOC[{key!r}] in schema.py"
            )


def test_every_docstring_is_used():
    from actcfg.policy import schema

    for key in derive(SCHEMA.read_text(encoding="utf-8")):
        cls, _, field = key.partition(".")
        assert field in getattr(schema, cls).model_fields, f"{key}: a docstring under no field"


if __name__ == "__main__":
    GENERATED.write_text(_expected(), encoding="utf-8")
    sys.stdout.write(f"wrote {GENERATED.relative_to(ROOT)}\n")
