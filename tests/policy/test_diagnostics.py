"""diagnostics: the exact text, JSON and GitHub renderings."""

from __future__ import annotations

import json

from actcfg.policy.diagnostics import REPORTER_BY_NAME, Diagnostic, Result

ERR = Diagnostic("p.yaml", 3, 5, "unknown-key", "error", "unknown key `x`", "did you mean `y`?")
WARN = Diagnostic("p.yaml", 4, 1, "unused-setting", "warning", "50% of it, a,b: c", "line1\nline2\r")
FILE = Diagnostic("gone.yaml", None, None, "file-not-found", "error", "no such file", "check the path")


def _result(*diagnostics: Diagnostic) -> Result:
    result = Result()
    for d in diagnostics:
        result.add(d.file, [d])
    return result


def test_text_lines():
    assert REPORTER_BY_NAME["text"].render(_result(ERR, FILE)) == (
        "p.yaml:3:5: error unknown-key: unknown key `x` (did you mean `y`?)\n"
        "gone.yaml: error file-not-found: no such file (check the path)\n"
    )


def test_json_object_has_status_and_every_finding():
    body = json.loads(REPORTER_BY_NAME["json"].render(_result(ERR, WARN)))
    assert body == {
        "status": "invalid",
        "errors": [
            {"file": "p.yaml", "line": 3, "column": 5, "code": "unknown-key", "severity": "error",
             "message": "unknown key `x`", "hint": "did you mean `y`?"},
            {"file": "p.yaml", "line": 4, "column": 1, "code": "unused-setting", "severity": "warning",
             "message": "50% of it, a,b: c", "hint": "line1\nline2\r"},
        ],
    }
    assert json.loads(REPORTER_BY_NAME["json"].render(_result(WARN)))["status"] == "ok"
    assert json.loads(REPORTER_BY_NAME["json"].render(_result(WARN), strict=True))["status"] == "invalid"
    assert json.loads(REPORTER_BY_NAME["json"].render(Result())) == {"status": "ok", "errors": []}


def test_github_annotations_escape_and_are_followed_by_text():
    out = REPORTER_BY_NAME["github"].render(_result(ERR, WARN, FILE))
    assert out.splitlines() == [
        "::error file=p.yaml,line=3,col=5,title=actcfg unknown-key::unknown key `x` (did you mean `y`?)",
        "::warning file=p.yaml,line=4,col=1,title=actcfg unused-setting::50%25 of it, a,b: c (line1%0Aline2%0D)",
        "::error file=gone.yaml,title=actcfg file-not-found::no such file (check the path)",
        "p.yaml:3:5: error unknown-key: unknown key `x` (did you mean `y`?)",
        "p.yaml:4:1: warning unused-setting: 50% of it, a,b: c (line1\\nline2\\r)",
        "gone.yaml: error file-not-found: no such file (check the path)",
    ]


def test_github_escapes_properties():
    d = Diagnostic("a,b:c%.yaml", 1, 1, "x", "error", "m", "")
    assert REPORTER_BY_NAME["github"].render(_result(d)).splitlines()[0] == (
        "::error file=a%2Cb%3Ac%25.yaml,line=1,col=1,title=actcfg x::m"
    )


def test_result_success_and_summary():
    assert _result(WARN).success() and not _result(WARN).success(strict=True)
    assert not _result(ERR).success()
    assert _result(ERR, WARN, FILE).summary() == "3 files checked: 2 errors, 1 warning"
    assert Result().summary() == "0 files checked: 0 errors, 0 warnings"
