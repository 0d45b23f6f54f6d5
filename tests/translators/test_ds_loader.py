"""ds_loader: ds_configs read as json.load and DeepSpeed's hjson read them, with positions."""

from __future__ import annotations

import pytest

from actcfg.translators.ds_loader import JsonDocument, parse_config, read_config
from actcfg.policy.loader import Document, LoadFailure


def _fail(text: str) -> LoadFailure:
    with pytest.raises(LoadFailure) as info:
        parse_config(text, "ds.json")
    return info.value


def test_plain_json_is_read_as_json_load_reads_it():
    doc = parse_config('{"a": 1e400, "b": 4.0, "c": "caf\\u00e9"}', "ds.json")
    assert doc.syntax == "json"
    assert doc.data == {"a": float("inf"), "b": 4.0, "c": "café"}
    assert type(doc.data["b"]) is float


def test_comments_and_trailing_commas_are_read_as_deepspeed_reads_them():
    """DeepSpeedConfig reads a config path with hjson.load (deepspeed/runtime/config.py)."""
    import hjson

    text = ('{\n  // zero\n  "zero_optimization": {"stage": 2,},\n  # hash comment\n'
            '  "activation_checkpointing": {\n    "partition_activations": true, /* c */\n  },\n}\n')
    doc = parse_config(text, "ds.json")
    assert doc.syntax == "hjson"
    assert doc.data == hjson.loads(text) == {
        "zero_optimization": {"stage": 2},
        "activation_checkpointing": {"partition_activations": True}}
    assert doc.locate(("activation_checkpointing", "partition_activations"), key=True) == (6, 5)
    assert doc.locate(("activation_checkpointing", "partition_activations")) == (6, 30)
    assert doc.locate(("activation_checkpointing", "missing")) == (5, 31)


def test_duplicate_keys_are_findings_with_both_lines():
    doc = parse_config('{\n "a": {"x": 1,\n   "x": 2},\n "a": 3\n}', "ds.json")
    assert doc.data == {"a": 3}  # as json.load keeps it
    assert [(p.code, p.path, p.line, p.column) for p in doc.problems] == [
        ("json-duplicate-key", ("a", "x"), 3, 4), ("json-duplicate-key", ("a",), 4, 2)]
    assert doc.problems[1].message == (
        "key `a` appears twice under the top level (first on line 2): DeepSpeed refuses the "
        "whole file (ValueError: Duplicate keys in DeepSpeed config), and json.load keeps only "
        "the last one")


def test_duplicates_are_found_in_hjson_too():
    doc = parse_config('{\n "a": 1, // one\n "a": 2,\n}', "ds.json")
    assert doc.syntax == "hjson" and [p.line for p in doc.problems] == [3]


@pytest.mark.parametrize(("text", "code", "line", "column", "message"), [
    ('{"a": ' + "1" * 5000 + "}", "json-too-complex", 1, 7,
     "the file is too complex to read safely: a number of 5,000 digits (the limit is 4,300, "
     "Python's own)"),
    ("[" * 500 + "]" * 500, "json-too-complex", 1, 66,
     "the file is too complex to read safely: nested deeper than 64 levels"),
    ('{"a": ' * 500 + "1" + "}" * 500, "json-too-complex", 1, 6 * 64 + 2,
     "the file is too complex to read safely: nested deeper than 64 levels"),
    ('{"a": 1,\n "b": }', "json-syntax", 2, 7, "invalid JSON: Expecting value"),
    ("{// c\n \"a\" 1}", "json-syntax", 2, 6,
     "invalid JSON, and DeepSpeed's hjson reader fails too: Expecting ':' delimiter"),
    ('{// c\n "a": 1e400}', "json-syntax", 2, 7,
     "DeepSpeed's hjson reader fails on the number 1e400 (OverflowError: it is beyond the "
     "float range)"),
], ids=["5000-digits", "500-lists", "500-objects", "syntax", "hjson-syntax", "hjson-1e400"])
def test_hostile_or_broken_json_fails_cleanly_with_a_position(text, code, line, column, message):
    failure = _fail(text)
    assert (failure.code, failure.line, failure.column, failure.message) == (code, line, column, message)


def test_yaml_configs_are_read_as_pyyaml_reads_them(tmp_path):
    path = tmp_path / "neox.yml"
    path.write_text('# gpt-neox\n{\n  "checkpoint-activations": True,\n  "partition-activations": yes,\n}\n')
    doc = read_config(path)
    assert isinstance(doc, Document)
    assert doc.data == {"checkpoint-activations": True, "partition-activations": True}
    assert doc.locate(("partition-activations",), key=True) == (4, 3)
    json_path = tmp_path / "ds.json"
    json_path.write_text("{}")
    assert isinstance(read_config(json_path), JsonDocument)


def test_a_fifo_is_refused(tmp_path):
    import os

    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    with pytest.raises(LoadFailure) as info:
        read_config(fifo)
    assert info.value.code == "file-unreadable"
