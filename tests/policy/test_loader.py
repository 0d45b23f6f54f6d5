"""loader: the strict YAML dialect, refusals with codes and positions, and `locate`."""

from __future__ import annotations

import codecs

import pytest

from actcfg.policy.loader import (
    MAX_BYTES,
    LoadFailure,
    parse_document,
    read_bytes,
    read_document,
)


def _fail(text: str) -> LoadFailure:
    with pytest.raises(LoadFailure) as info:
        parse_document(text, "f.yaml")
    return info.value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("yes", "yes"), ("No", "No"), ("on", "on"), ("OFF", "OFF"), ("y", "y"),
        ("true", True), ("False", False), ("TRUE", True), ("tRuE", True),
        ("012", "012"), ("0o12", "0o12"), ("1:30", "1:30"), ("1_000", "1_000"),
        ("12", 12), ("-3", -3), ("0", 0), ("0x1f", 31),
        ("1.5", 1.5), ("1e3", 1000.0), ("2001-12-14", "2001-12-14"),
        ("~", None), ("null", None), ("", None), ("=", "="),
    ],
)
def test_plain_scalars_resolve_strictly(text, value):
    data = parse_document(f"k: {text}\n", "f.yaml").data
    assert data == {"k": value} and type(data["k"]) is type(value)


def test_duplicate_key_points_at_the_second_and_names_the_first_line():
    doc = parse_document("a: 1\nb:\n  c: 1\n  c: 2\na: 3\n", "f.yaml")
    assert [(p.code, p.path, p.line, p.column) for p in doc.problems] == [
        ("yaml-duplicate-key", ("b", "c"), 4, 3),
        ("yaml-duplicate-key", ("a",), 5, 1),
    ]
    assert doc.problems[1].message == (
        "key `a` appears twice under the top level (first on line 1); "
        "YAML loaders silently keep only the last one"
    )
    assert doc.locate(("a",)) == (5, 4)  # the value the data holds: the last one


@pytest.mark.parametrize(
    ("text", "code", "line", "column"),
    [
        ("a: !!python/object/apply:os.system ['true']\n", "yaml-unsafe-tag", 1, 4),
        ("a: !!python/name:os.system\n", "yaml-unsafe-tag", 1, 4),
        ("a: !custom 1\n", "yaml-unsafe-tag", 1, 4),
        ("a: 1\n---\nb: 2\n", "yaml-multiple-documents", 2, 1),
        ("# nothing\n", "yaml-empty", 1, 1),
        ("", "yaml-empty", 1, 1),
        ("---\n...\n", "yaml-empty", 1, 1),
        ("~\n", "yaml-empty", 1, 1),
        ("- a\n", "yaml-not-mapping", 1, 1),
        ("just a string\n", "yaml-not-mapping", 1, 1),
        ("a: [1, 2\n", "yaml-syntax", 2, 1),
        ("a:\n\tb: 1\n", "yaml-syntax", 2, 1),
        ("a: \x00\n", "yaml-syntax", 1, 4),
        ("a: !!int abc\n", "yaml-syntax", 1, 4),
        ("? [a, b]\n: 1\n", "yaml-syntax", 1, 3),
        ("a: &x [*x]\n", "yaml-too-complex", 1, 4),
        ("a: " + "[" * 100 + "]" * 100 + "\n", "yaml-too-complex", 1, 67),
        ("a: *nope\n", "yaml-syntax", 1, 4),
    ],
)
def test_refusals(text, code, line, column):
    failure = _fail(text)
    assert (failure.code, failure.line, failure.column) == (code, line, column)
    assert failure.message and failure.hint


def test_unsafe_tag_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    failure = _fail(f"a: !!python/object/apply:os.system ['touch {marker}']\n")
    assert failure.code == "yaml-unsafe-tag"
    assert not marker.exists()


def test_billion_laughs_is_refused():
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    failure = _fail("\n".join(lines) + "\n")
    assert failure.code == "yaml-too-complex"
    assert "alias" in failure.message


def test_locate_key_and_value_and_sequence_items():
    doc = parse_document("version: 1\ncheckpoint:\n  modules: [A, B]\n", "f.yaml")
    assert doc.locate(("checkpoint", "modules"), key=True) == (3, 3)
    assert doc.locate(("checkpoint", "modules")) == (3, 12)
    assert doc.locate(("checkpoint", "modules", 1)) == (3, 16)
    assert doc.locate(("checkpoint", "missing")) == (3, 3)  # the mapping it would go in
    assert doc.locate(()) == (1, 1)


def test_locate_through_merge_keys():
    doc = parse_document("base: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n", "f.yaml")
    assert doc.data["c"] == {"x": 1, "y": 2}
    assert doc.locate(("c", "x")) == (1, 14)
    assert doc.locate(("c", "y")) == (4, 6)


def test_section_keeps_whole_file_positions_and_filters_problems():
    doc = parse_document("a: 1\na: 2\nt:\n  p:\n    k: 1\n    k: 2\n", "f.yaml")
    section = doc.section("t.p")
    assert section.data == {"k": 2}
    assert section.locate(("k",)) == (6, 8)
    assert [(p.path, p.line) for p in section.problems] == [(("k",), 6)]
    with pytest.raises(LoadFailure) as info:
        doc.section("t.q")
    assert (info.value.code, info.value.line, info.value.column) == ("section-missing", 4, 3)
    assert info.value.hint == "keys there: `p`"


def _read_fail(path) -> LoadFailure:
    with pytest.raises(LoadFailure) as info:
        read_document(path)
    return info.value


def test_read_refuses_big_files_by_size(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(MAX_BYTES + 1)
    failure = _read_fail(path)
    assert failure.code == "file-too-large" and failure.line is None


def test_read_encodings(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(codecs.BOM_UTF8 + b"version: 1\n")
    assert read_document(path).data == {"version": 1}
    path.write_bytes("version: 1\n".encode("utf-16"))
    failure = _read_fail(path)
    assert (failure.code, failure.line) == ("file-encoding", None)
    assert "UTF-16" in failure.message and "iconv -f UTF-16 -t UTF-8" in failure.hint
    path.write_bytes(b"version: 1\nname: caf\xe9\n")
    failure = _read_fail(path)
    assert (failure.code, failure.line, failure.column) == ("file-encoding", 2, 10)
    assert failure.message == "byte 0xe9 is not UTF-8; the file is probably Latin-1 or Windows-1252"


def test_read_file_errors(tmp_path):
    assert _read_fail(tmp_path / "missing.yaml").code == "file-not-found"
    assert _read_fail(tmp_path).code == "file-unreadable"
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    failure = _read_fail(loop)
    assert failure.code == "file-unreadable" and "symbolic links" in failure.message


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_anything_but_a_regular_file_is_refused_before_it_is_read(tmp_path, kind):
    # A FIFO with no writer would block open() and read() forever; /dev/zero never ends.
    import os
    import threading

    if kind == "fifo":
        path = tmp_path / "pipe.yaml"
        os.mkfifo(path)
    elif kind == "directory":
        path = tmp_path
    else:
        path = "/dev/zero"
        if not os.path.exists(path):
            pytest.skip("no /dev/zero")
    outcome: list[LoadFailure] = []
    reader = threading.Thread(target=lambda: outcome.append(_read_fail(path)), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "read_document blocked"
    [failure] = outcome
    what = {"fifo": "a FIFO (named pipe)", "directory": "a directory", "device": "a character device"}
    assert (failure.code, failure.message) == ("file-unreadable", f"this is {what[kind]}, not a regular file")


def test_read_bytes_returns_the_file(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b'{"a": 1}')
    assert read_bytes(path) == b'{"a": 1}'


def test_yaml11_reads_as_pyyaml_does_and_keys_are_listed_as_written():
    doc = parse_document("a: yes\nb: 012\n~: 1\ntrue: 2\n", "f.yml", yaml11=True)
    assert doc.data == {"a": True, "b": 10, None: 1, True: 2}
    assert doc.keys_at(()) == [("a", "a", 1, 1), ("b", "b", 2, 1), ("~", None, 3, 1), ("true", True, 4, 1)]
    strict = parse_document("a: yes\nb: 012\n", "f.yaml")
    assert strict.data == {"a": "yes", "b": "012"}
    assert strict.keys_at(("a",)) == [] and strict.keys_at(("missing",)) == []


def test_explicit_standard_tags_are_plain_data():
    doc = parse_document("a: !!float 1\nb: !!str 12\nc: !!int 0x10\nd: !!bool true\n", "f.yaml")
    assert doc.data == {"a": 1.0, "b": "12", "c": 16, "d": True}
    assert type(doc.data["a"]) is float
