"""Read a DeepSpeed (or gpt-neox) config file as the program that uses it reads it.

- JSON: a file that is plain JSON is read as `json.load` reads it (what Hugging Face and
  Lightning hand to DeepSpeed); anything else is read with `hjson`, as DeepSpeed itself reads a
  config path (`DeepSpeedConfig`: comments, trailing commas, quoteless strings). Duplicate keys
  are findings: DeepSpeed refuses such a file (`dict_raise_error_on_duplicate_keys`).
- YAML (`.yml`, `.yaml`): read as PyYAML's `yaml.safe_load` reads it (YAML 1.1), as gpt-neox
  reads its configs.

Every object member keeps where it was written (`JsonDocument.spans`), so findings carry a line
and `--merge` can replace one section of the text and keep every other byte. Nesting, number
length and file size are bounded: a hostile file fails with `json-too-complex`, never with a
RecursionError. Imports nothing from actcfg but `errors` and `loader`.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from actcfg.policy.loader import (
    MAX_DEPTH,
    Document,
    LoadFailure,
    Problem,
    decode_text,
    read_bytes,
)

__all__ = ["MAX_DIGITS", "JsonDocument", "Span", "parse_config", "read_config"]

MAX_DIGITS = 4300
"""Longest integer read: Python's own limit for int(str) (sys.get_int_max_str_digits)."""

YAML_SUFFIXES = (".yml", ".yaml")


@dataclass(frozen=True)
class Span:
    """Where one member of a JSON object is written: offsets of its key and of its value."""

    key_start: int
    start: int
    end: int


@dataclass(frozen=True)
class JsonDocument:
    """A parsed JSON (or hjson) config: its text, its data and where each member sits."""

    name: str
    text: str
    data: Any
    syntax: str
    """`json` (plain JSON, read by json.load) or `hjson` (read as DeepSpeed reads a path)."""
    spans: Mapping[tuple[Any, ...], Span] = field(default_factory=dict)
    """Object member path -> where its key and value are written; `()` is the whole root."""
    problems: tuple[Problem, ...] = ()
    """Duplicate keys: DeepSpeed refuses the file, json.load keeps the last one."""
    line_starts: tuple[int, ...] = field(default=(0,), repr=False)
    bom: bool = False
    """The file started with a UTF-8 byte-order mark (not part of `text`)."""

    def position(self, offset: int) -> tuple[int, int]:
        """The 1-based (line, column) of a character offset."""
        return _position(self.line_starts, offset)

    def locate(self, path: tuple[Any, ...], key: bool = False) -> tuple[int, int]:
        """The (line, column) of the value at `path` (of its key when `key`), or of the deepest
        member of `path` that exists."""
        for depth in range(len(path), -1, -1):
            span = self.spans.get(tuple(path[:depth]))
            if span is not None:
                at_key = key and depth == len(path) and depth > 0
                return self.position(span.key_start if at_key else span.start)
        return 1, 1


def _line_starts(text: str) -> tuple[int, ...]:
    return (0, *(m.end() for m in re.finditer("\n", text)))


def _position(starts: tuple[int, ...], offset: int) -> tuple[int, int]:
    line = bisect.bisect_right(starts, offset)
    return line, offset - starts[line - 1] + 1


# --- recording what the decoders see ------------------------------------------------------


class _TooComplex(Exception):
    def __init__(self, offset: int, why: str) -> None:
        super().__init__(why)
        self.offset = offset
        self.why = why


class _Members:
    """An object as the decoder saw it: its pairs in order (duplicates kept) and where each
    value starts and ends."""

    __slots__ = ("open", "pairs", "values")

    def __init__(self, open_at: int, pairs: list[tuple[str, Any]],
                 values: list[tuple[int, int]]) -> None:
        self.open = open_at
        self.pairs = pairs
        self.values = values


class _Recorder:
    """Wraps a decoder's object and array parsers: records member positions and bounds depth."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.depth = 0

    def _enter(self, offset: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _TooComplex(offset, f"nested deeper than {MAX_DEPTH} levels")

    def objects(self, real: Callable[..., Any], scan_index: int, hook_index: int) -> Callable[..., Any]:
        def parse(*args: Any) -> tuple[_Members, int]:
            call = list(args)
            open_at = call[0][1]
            inner = call[scan_index]
            values: list[tuple[int, int]] = []

            def scan(text: str, index: int) -> tuple[Any, int]:
                value, end = inner(text, index)
                values.append((index, end))
                return value, end

            call[scan_index] = scan
            call[hook_index] = list  # the pairs themselves, duplicates included
            self._enter(open_at)
            try:
                pairs, end = real(*call)
            finally:
                self.depth -= 1
            return _Members(open_at, pairs, values), end

        return parse

    def arrays(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def parse(state: tuple[str, int], *rest: Any) -> tuple[list[Any], int]:
            self._enter(state[1])
            try:
                return real(state, *rest)
            finally:
                self.depth -= 1

        return parse

    def integer(self, digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise _TooComplex(max(self.text.find(digits), 0),
                              f"a number of {len(digits.lstrip('-')):,} digits (the limit is "
                              f"{MAX_DIGITS:,}, Python's own)")
        return int(digits)


def _json_decoder(recorder: _Recorder) -> Any:
    import json.decoder
    import json.scanner

    decoder = json.JSONDecoder(parse_int=recorder.integer)
    decoder.parse_object = recorder.objects(json.decoder.JSONObject, 2, 4)
    decoder.parse_array = recorder.arrays(json.decoder.JSONArray)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # the C scanner ignores the hooks
    return decoder


def _hjson_decoder(recorder: _Recorder) -> Any:
    import hjson.decoder

    decoder = hjson.HjsonDecoder(parse_int=recorder.integer)
    decoder.parse_object = recorder.objects(hjson.decoder.JSONObject, 3, 5)
    decoder.parse_array = recorder.arrays(hjson.decoder.JSONArray)
    decoder.scan_once, decoder.scan_object_once = hjson.decoder.make_scanner(decoder)
    return decoder


_BLANK = re.compile(r"(?:\s|,)*")
_HUGE_NUMBER = re.compile(r"-?\d+(?:\.\d+)?[eE]\+?\d{3,}")
_HJSON_BLANK = re.compile(r"(?:\s|,|#[^\n]*|//[^\n]*|/\*.*?(?:\*/|$))*", re.DOTALL)


def _build(members: Any, text: str, hjson: bool, name: str) -> tuple[Any, dict, list[Problem]]:
    """Plain data (last duplicate wins, as json.load and hjson keep it), every member's span and
    every duplicate key."""
    blank = _HJSON_BLANK if hjson else _BLANK
    spans: dict[tuple[Any, ...], Span] = {}
    problems: list[Problem] = []
    starts = _line_starts(text)

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, list):
            return [walk(item, (*path, i)) for i, item in enumerate(value)]
        if not isinstance(value, _Members):
            return value
        out: dict[str, Any] = {}
        first: dict[str, int] = {}
        previous_end = value.open
        for (key, item), (start, end) in zip(value.pairs, value.values):
            # The key is the first thing after the previous member (or the brace): blanks,
            # commas and, in hjson, comments come before it.
            key_start = blank.match(text, previous_end).end()
            previous_end = end
            line, column = _position(starts, key_start)
            if key in first:
                where = ".".join(str(p) for p in path) or "the top level"
                problems.append(Problem(
                    "json-duplicate-key", (*path, key), line, column,
                    f"key `{key}` appears twice under {where} (first on line {first[key]}): "
                    "DeepSpeed refuses the whole file (ValueError: Duplicate keys in DeepSpeed "
                    "config), and json.load keeps only the last one",
                    "delete one of the two",
                ))
            else:
                first[key] = line
            out[key] = walk(item, (*path, key))
            spans[(*path, key)] = Span(key_start, start, end)
        return out

    return walk(members, ()), spans, problems


def _failure(text: str, offset: int, code: str, message: str, hint: str) -> LoadFailure:
    return LoadFailure(code, message, hint, *_position(_line_starts(text), offset))


def _decode(text: str, hjson: bool) -> tuple[Any, int, int]:
    recorder = _Recorder(text)
    decoder = _hjson_decoder(recorder) if hjson else _json_decoder(recorder)
    start = (_HJSON_BLANK if hjson else _BLANK).match(text, 0).end() if text else 0
    value = decoder.decode(text)
    return value, start, len(text.rstrip())


def parse_config(text: str, name: str) -> JsonDocument:
    """Parse JSON (else hjson) `text` from file `name`, or raise `LoadFailure`."""
    import json

    try:
        value, start, end = _decode(text, hjson=False)
        syntax = "json"
    except json.JSONDecodeError as json_error:
        try:
            import hjson  # noqa: F401  (DeepSpeed's own dependency)
        except ImportError:
            raise LoadFailure(
                "json-syntax", f"invalid JSON: {json_error.msg}",
                "fix the JSON at this position (DeepSpeed reads comments and trailing commas "
                "with hjson: `pip install hjson` lets actcfg read them too)",
                json_error.lineno, json_error.colno,
            ) from None
        try:
            value, start, end = _decode(text, hjson=True)
            syntax = "hjson"
        except _TooComplex as e:
            raise _too_complex(text, e) from None
        except Exception as hjson_error:  # noqa: BLE001  (hjson raises ValueError, IndexError, ...)
            # Report the error of the reader that got further: a comment stops json.load at
            # once, while hjson reads past it to the real mistake.
            position = getattr(hjson_error, "pos", None)
            huge = _HUGE_NUMBER.search(text)
            if isinstance(hjson_error, OverflowError) and huge is not None:
                raise _failure(
                    text, huge.start(), "json-syntax",
                    f"DeepSpeed's hjson reader fails on the number {huge.group()} "
                    "(OverflowError: it is beyond the float range)",
                    "write a number DeepSpeed can read, such as 1e308",
                ) from None
            if isinstance(position, int) and position > json_error.pos:
                raise _failure(
                    text, position, "json-syntax",
                    f"invalid JSON, and DeepSpeed's hjson reader fails too: {hjson_error.msg}",
                    "fix the config at this position",
                ) from None
            if not isinstance(position, int):
                raise _failure(
                    text, json_error.pos, "json-syntax",
                    f"invalid JSON ({json_error.msg}), and DeepSpeed's hjson reader fails too "
                    f"({type(hjson_error).__name__}: {hjson_error})",
                    "fix the config; DeepSpeed cannot read it either",
                ) from None
            raise LoadFailure(
                "json-syntax", f"invalid JSON: {json_error.msg}", "fix the JSON at this position",
                json_error.lineno, json_error.colno,
            ) from None
    except _TooComplex as e:
        raise _too_complex(text, e) from None
    except RecursionError:
        raise LoadFailure("json-too-complex", "the file is nested too deeply to read safely",
                          "write the config out plainly", 1, 1) from None
    data, spans, problems = _build(value, text, syntax == "hjson", name)
    spans[()] = Span(start, start, end)
    return JsonDocument(name, text, data, syntax, spans, tuple(problems), _line_starts(text))


def _too_complex(text: str, e: _TooComplex) -> LoadFailure:
    return _failure(text, e.offset, "json-too-complex",
                    f"the file is too complex to read safely: {e.why}",
                    "write the config out plainly; DeepSpeed's readers would fail on it too")


def read_config(path: str | os.PathLike[str]) -> JsonDocument | Document:
    """Read the config file at `path`: YAML 1.1 for `.yml`/`.yaml` (gpt-neox), JSON or hjson
    otherwise. Raises `LoadFailure`."""
    from actcfg.policy.loader import parse_document

    import codecs
    import dataclasses

    name = os.fspath(path)
    raw = read_bytes(name)
    text = decode_text(raw)
    if name.lower().endswith(YAML_SUFFIXES):
        return parse_document(text, name, yaml11=True)
    return dataclasses.replace(parse_config(text, name), bom=raw.startswith(codecs.BOM_UTF8))
