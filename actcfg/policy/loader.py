"""Read a policy file safely: bytes -> text -> YAML node tree -> plain Python data.

Only plain data comes out (mappings, lists, strings, integers, floats, booleans, null);
nothing is executed. The composed node tree is kept, so any data path can be mapped back
to a 1-based (line, column) in the whole file, also when the policy is a section of a
larger training YAML (`Document.section`).

Deliberate departures from `yaml.safe_load`, each a silent-misread that bit someone:
- duplicate keys are errors (PyYAML keeps the last one silently);
- only `true`/`false` (any case) are booleans: YAML 1.1's `yes`/`no`/`on`/`off` stay
  strings, so `partition: yes` fails as a wrong type instead of guessing;
- only plain decimal and `0x` hex are integers: `012` (YAML 1.1 octal, 10) and `1:30`
  (sexagesimal, 90) stay strings; dates stay strings;
- alias bombs, deep nesting and recursive aliases are refused within fixed bounds.

Imports nothing from actcfg but `errors`.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
import stat
from typing import Any, NamedTuple

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import StreamEndEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import BaseResolver, Resolver
from yaml.scanner import Scanner

from actcfg.errors import ConfigLoadError

__all__ = [
    "Document",
    "LoadFailure",
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_EXPANDED_NODES",
    "Problem",
    "YAML11_BOOLS",
    "decode_text",
    "kind_of",
    "parse_document",
    "read_bytes",
    "read_document",
]

MAX_BYTES = 4 * 2**20
"""Largest file actcfg reads; checked on the file's size before a byte is parsed."""

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists; a policy needs 3, a training YAML rarely 10."""

MAX_EXPANDED_NODES = 100_000
"""Most nodes the document may have once every alias is expanded (billion laughs: 10**9)."""

_TAG = "tag:yaml.org,2002:"
_ALLOWED_TAGS = frozenset(
    _TAG + name for name in ("str", "int", "float", "bool", "null", "seq", "map", "merge")
)
YAML11_BOOLS = frozenset({"yes", "no", "on", "off", "y", "n"})
"""Plain scalars YAML 1.1 reads as booleans and this loader keeps as strings (any case)."""


# --- failures ------------------------------------------------------------------------------


class LoadFailure(ConfigLoadError):
    """A file that cannot be turned into data, with the stable code and position to report."""

    def __init__(
        self, code: str, message: str, hint: str, line: int | None = None, column: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        self.line = line
        self.column = column


class Problem(NamedTuple):
    """A non-fatal finding made while loading (a duplicate key): the data is still usable.

    `Problem` and `Document` are NamedTuples, not frozen dataclasses, as immutable: a frozen
    dataclass compiles six methods when it is defined (~1 ms each class), on every start of
    `actcfg validate` (issue 19)."""

    code: str
    path: tuple[Any, ...]
    line: int
    column: int
    message: str
    hint: str


# --- the YAML dialect ----------------------------------------------------------------------


class _StrictResolver(BaseResolver):
    """YAML 1.2-like plain scalars: only true/false are booleans, no octal, no sexagesimal."""

    yaml_implicit_resolvers: dict = {}


_StrictResolver.add_implicit_resolver(
    _TAG + "bool", re.compile(r"^(?i:true|false)$"), list("tTfF")
)
_StrictResolver.add_implicit_resolver(
    _TAG + "int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_StrictResolver.add_implicit_resolver(
    _TAG + "float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9]*)?\.[0-9]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
_StrictResolver.add_implicit_resolver(
    _TAG + "null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)
_StrictResolver.add_implicit_resolver(_TAG + "merge", re.compile(r"^<<$"), ["<"])

def _scalar_forms(resolver: type[BaseResolver]) -> dict[str, re.Pattern[str]]:
    """What an explicitly tagged scalar (`!!int 12`) must look like under `resolver`: the
    implicit forms, and for floats also plain integers (`!!float 1`)."""

    def implicit(tag: str, first: str) -> re.Pattern[str]:
        return next(regex for t, regex in resolver.yaml_implicit_resolvers[first] if t == _TAG + tag)

    forms = {_TAG + tag: implicit(tag, first)
             for tag, first in (("bool", "t"), ("int", "1"), ("null", "~"))}
    forms[_TAG + "float"] = re.compile(
        "|".join(f"(?:{regex.pattern})" for t, regex in resolver.yaml_implicit_resolvers["1"]
                 if t in (_TAG + "float", _TAG + "int")),
        re.X,
    )
    return forms


_SCALAR_FORMS = _scalar_forms(_StrictResolver)


class _TooComplex(Exception):
    def __init__(self, mark: yaml.Mark | None, why: str) -> None:
        super().__init__(why)
        self.mark = mark
        self.why = why


class _BoundedComposer(Composer):
    """A composer that refuses nesting deeper than MAX_DEPTH (PyYAML recurses per level)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooComplex(self.peek_event().start_mark, f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _StrictLoader(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, _StrictResolver):
    """A SafeLoader with the strict resolver and a nesting bound while composing."""

    def __init__(self, text: str) -> None:
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        _StrictResolver.__init__(self)


@functools.cache
def _yaml11_forms() -> dict[str, re.Pattern[str]]:
    """`_scalar_forms(Resolver)`, compiled when a YAML 1.1 file is first read (gpt-neox configs,
    TrainingArguments): its patterns are long, and `actcfg validate` never reads YAML 1.1."""
    return _scalar_forms(Resolver)


class _Yaml11Loader(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):
    """PyYAML's own YAML 1.1 reading (`yes` is true, `012` is 10), as programs that call
    `yaml.load` read their files (gpt-neox's configs), with the same bounds."""

    def __init__(self, text: str) -> None:
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


# --- the document ----------------------------------------------------------------------


def _scalar_value(node: ScalarNode) -> Any:
    """The Python value of a scalar key node, as the constructor would make it."""
    if node.tag == _TAG + "bool":
        return node.value.lower() in ("true", "yes", "on", "y")
    if node.tag == _TAG + "null":
        return None
    if node.tag == _TAG + "int":
        try:
            return int(node.value, 0)
        except ValueError:
            return node.value
    return node.value


def _pairs(node: MappingNode) -> list[tuple[Node, Node]]:
    """The key/value pairs of a mapping, own keys first, then those from `<<` merges."""
    own = [(k, v) for k, v in node.value if k.tag != _TAG + "merge"]
    for key, value in node.value:
        if key.tag == _TAG + "merge":
            sources = value.value if isinstance(value, SequenceNode) else [value]
            for source in sources:
                if isinstance(source, MappingNode):
                    own.extend(_pairs(source))
    return own


def _child(node: MappingNode, part: Any) -> tuple[Node | None, Node | None]:
    """The key and value nodes for `part`: the last own key wins (as in the data),
    and own keys beat merged ones."""
    pairs = _pairs(node)
    n_own = sum(1 for k, _ in node.value if k.tag != _TAG + "merge")
    for key, value in [*reversed(pairs[:n_own]), *pairs[n_own:]]:
        if isinstance(key, ScalarNode) and (_scalar_value(key) == part or key.value == str(part)):
            return key, value
    return None, None


def _position(node: Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


class Document(NamedTuple):
    """A parsed YAML document: its data, its node tree, and where the data came from."""

    name: str
    data: Any
    node: Node
    at: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = ()

    def locate(self, path: tuple[Any, ...], key: bool = False) -> tuple[int, int]:
        """The 1-based (line, column) of the value at `path`, or of its key when `key` is set.

        A path that leaves the tree (a missing key) resolves to the deepest node it reached.
        """
        node = self.node
        key_node: Node | None = None
        for part in path:
            child = None
            if isinstance(node, MappingNode):
                key_node, child = _child(node, part)
            elif isinstance(node, SequenceNode) and isinstance(part, int):
                if 0 <= part < len(node.value):
                    key_node = child = node.value[part]
            if child is None:
                return _position(node)
            node = child
        return _position(key_node if key and key_node is not None else node)

    def keys_at(self, path: tuple[Any, ...]) -> list[tuple[str, Any, int, int]]:
        """The keys of the mapping at `path` as written: (text, value, line, column) each, in
        file order; empty when `path` is not a mapping."""
        node = self.node
        for part in path:
            if isinstance(node, MappingNode):
                node = _child(node, part)[1]
            elif (isinstance(node, SequenceNode) and isinstance(part, int)
                  and 0 <= part < len(node.value)):
                node = node.value[part]
            else:
                return []
        if not isinstance(node, MappingNode):
            return []
        return [(key.value, _scalar_value(key), *_position(key))
                for key, _ in _pairs(node) if isinstance(key, ScalarNode)]

    def section(self, at: str | tuple[str, ...] | None) -> Document:
        """The sub-document at dotted key `at`; positions stay those of the whole file."""
        parts = tuple(p for p in at.split(".")) if isinstance(at, str) else tuple(at or ())
        if not parts:
            return self
        node, data = self.node, self.data
        for depth, part in enumerate(parts):
            if not isinstance(data, dict) or part not in data:
                where = f"`{'.'.join(parts[:depth])}`" if depth else "the top level"
                names = [f"`{k}`" for k in data] if isinstance(data, dict) else []
                keys = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
                line, column = _position(node)
                raise LoadFailure(
                    "section-missing",
                    f"no key `{part}` under {where} (looking for section `{'.'.join(parts)}`)",
                    f"keys there: {keys}" if keys else "check the --at path",
                    line,
                    column,
                )
            data = data[part]
            node = _child(node, part)[1]
        if not isinstance(data, dict):
            line, column = _position(node)
            raise LoadFailure(
                "yaml-not-mapping",
                f"section `{'.'.join(parts)}` is a {kind_of(data)}, not a mapping of policy keys",
                "point --at at the mapping that holds `version: 1`",
                line,
                column,
            )
        width = len(parts)
        problems = tuple(
            Problem(p.code, p.path[width:], p.line, p.column, p.message, p.hint)
            for p in self.problems
            if p.path[:width] == parts
        )
        return Document(self.name, data, node, self.at + parts, problems)


def kind_of(value: Any) -> str:
    """A YAML user's word for the type of `value`."""
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        type(None): "null",
        list: "list",
        dict: "mapping",
    }.get(type(value), type(value).__name__)


# --- checks on the node tree --------------------------------------------------------------


def _check_tree(root: Node, forms: dict[str, re.Pattern[str]] = _SCALAR_FORMS) -> list[Problem]:
    """Refuse unsafe tags, bad explicit scalars, non-scalar keys and alias bombs; return
    duplicate-key problems. Each node is visited once, however often it is aliased."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    problems: list[Problem] = []

    def visit(node: Node, path: tuple[Any, ...]) -> int:
        ident = id(node)
        if ident in sizes:
            return sizes[ident]
        if ident in in_progress:
            raise _TooComplex(node.start_mark, "an alias refers to a node that contains it (a cycle)")
        if node.tag not in _ALLOWED_TAGS:
            tag = node.tag.replace(_TAG, "!!")
            line, column = _position(node)
            raise LoadFailure(
                "yaml-unsafe-tag",
                f"tag `{tag}` is not allowed: actcfg reads plain YAML data only, "
                "and nothing in the file was executed or constructed",
                "remove the tag and write the value as plain YAML",
                line,
                column,
            )
        in_progress.add(ident)
        size = 1
        if isinstance(node, ScalarNode):
            form = forms.get(node.tag)
            if form is not None and not form.match(node.value):
                line, column = _position(node)
                tag = node.tag.replace(_TAG, "!!")
                raise LoadFailure(
                    "yaml-syntax",
                    f"`{node.value}` is not a valid `{tag}`",
                    "remove the tag, or write a value of that type",
                    line,
                    column,
                )
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                size += visit(item, (*path, index))
        elif isinstance(node, MappingNode):
            first_line: dict[Any, int] = {}
            for key, value in node.value:
                if not isinstance(key, ScalarNode):
                    line, column = _position(key)
                    raise LoadFailure(
                        "yaml-syntax",
                        "a key must be a plain scalar, not a list or mapping",
                        "write the key as a plain name",
                        line,
                        column,
                    )
                size += visit(key, path)
                if key.tag == _TAG + "merge":
                    size += visit(value, path)
                    continue
                name = _scalar_value(key)
                line, column = _position(key)
                if name in first_line:
                    where = ".".join(str(p) for p in path) or "the top level"
                    problems.append(Problem(
                        "yaml-duplicate-key",
                        (*path, name),
                        line,
                        column,
                        f"key `{name}` appears twice under {where} (first on line "
                        f"{first_line[name]}); YAML loaders silently keep only the last one",
                        "delete one of the two",
                    ))
                else:
                    first_line[name] = line
                size += visit(value, (*path, name))
        in_progress.discard(ident)
        if size > MAX_EXPANDED_NODES:
            raise _TooComplex(
                node.start_mark,
                f"aliases expand to more than {MAX_EXPANDED_NODES:,} nodes (an alias bomb?)",
            )
        sizes[ident] = size
        return size

    visit(root, ())
    return problems


# --- entry points -----------------------------------------------------------------------


def _mark_position(mark: yaml.Mark | None) -> tuple[int | None, int | None]:
    if mark is None:
        return None, None
    return mark.line + 1, mark.column + 1


def _code_point(character: int | str) -> int:
    return character if isinstance(character, int) else ord(character)


def parse_document(text: str, name: str, *, yaml11: bool = False) -> Document:
    """Parse YAML `text` (from file `name`) into a `Document`, or raise `LoadFailure`.

    `yaml11` reads plain scalars as PyYAML's `yaml.safe_load` does (YAML 1.1: `yes` is true),
    for files written for a program that reads them that way; the default is actcfg's dialect.
    """
    loader: _StrictLoader | _Yaml11Loader | None = None
    try:
        try:
            loader = (_Yaml11Loader if yaml11 else _StrictLoader)(text)  # refuses control characters
            loader.get_event()  # StreamStartEvent
            if loader.check_event(StreamEndEvent):
                raise LoadFailure(
                    "yaml-empty", "the file holds no YAML document", "start it with `version: 1`", 1, 1
                )
            root = loader.compose_document()
            if not loader.check_event(StreamEndEvent):
                line, column = _mark_position(loader.get_event().start_mark)
                raise LoadFailure(
                    "yaml-multiple-documents",
                    "the file holds more than one YAML document (a second `---`)",
                    "keep one policy per file, or remove the extra `---`",
                    line,
                    column,
                )
            problems = _check_tree(root, _yaml11_forms() if yaml11 else _SCALAR_FORMS)
            data = loader.construct_document(root)
        finally:
            if loader is not None:
                loader.dispose()
    except LoadFailure:
        raise
    except _TooComplex as e:
        line, column = _mark_position(e.mark)
        raise LoadFailure(
            "yaml-too-complex",
            f"the document is too complex to read safely: {e.why}",
            "write the policy out plainly, without deep nesting or nested aliases",
            line or 1,
            column or 1,
        ) from None
    except RecursionError:
        raise LoadFailure(
            "yaml-too-complex",
            "the document is nested too deeply to read safely",
            "write the policy out plainly, without deep nesting",
            1,
            1,
        ) from None
    except yaml.MarkedYAMLError as e:
        line, column = _mark_position(e.problem_mark or e.context_mark)
        what = " ".join(str(part) for part in (e.context, e.problem) if part)
        raise LoadFailure(
            "yaml-syntax",
            f"invalid YAML: {what}",
            "fix the YAML syntax at this position (indent with spaces, not tabs)"
            if "'\\t'" in what
            else "fix the YAML syntax at this position",
            line or 1,
            column or 1,
        ) from None
    except yaml.reader.ReaderError as e:
        before = text[: e.position]
        line = before.count("\n") + 1
        column = e.position - (before.rfind("\n") + 1) + 1
        raise LoadFailure(
            "yaml-syntax",
            f"invalid YAML: character U+{_code_point(e.character):04X} is not allowed in a YAML file",
            "remove the character; is this a binary file?",
            line,
            column,
        ) from None
    except yaml.YAMLError as e:
        raise LoadFailure("yaml-syntax", f"invalid YAML: {e}", "fix the YAML syntax", 1, 1) from None
    if data is None:
        raise LoadFailure(
            "yaml-empty", "the document is empty (null)", "start it with `version: 1`", 1, 1
        )
    if not isinstance(data, dict):
        line, column = _position(root)
        raise LoadFailure(
            "yaml-not-mapping",
            f"the top level is a {kind_of(data)}, not a mapping of policy keys",
            "write `key: value` lines, starting with `version: 1`",
            line,
            column,
        )
    return Document(name, data, root, (), tuple(problems))


def decode_text(raw: bytes) -> str:
    """`raw` as UTF-8 text (a UTF-8 byte-order mark is dropped), or `LoadFailure` naming the
    encoding it probably is and the position of the first bad byte."""
    for bom, encoding in (
        (codecs.BOM_UTF32_LE, "UTF-32"),
        (codecs.BOM_UTF32_BE, "UTF-32"),
        (codecs.BOM_UTF16_LE, "UTF-16"),
        (codecs.BOM_UTF16_BE, "UTF-16"),
    ):
        if raw.startswith(bom):
            raise LoadFailure(
                "file-encoding",
                f"the file is {encoding} (it starts with a {encoding} byte-order mark); "
                "actcfg reads UTF-8",
                f"save it as UTF-8, e.g. `iconv -f {encoding} -t UTF-8 FILE > FILE.new`",
            )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        before = raw[: e.start]
        line = before.count(b"\n") + 1
        column = len(before) - (before.rfind(b"\n") + 1) + 1
        if raw[1::2].count(0) > len(raw) // 4:
            likely = "UTF-16 without a byte-order mark"
        else:
            likely = "Latin-1 or Windows-1252"
        raise LoadFailure(
            "file-encoding",
            f"byte 0x{raw[e.start]:02x} is not UTF-8; the file is probably {likely}",
            "save it as UTF-8, e.g. `iconv -f LATIN1 -t UTF-8 FILE > FILE.new`",
            line,
            column,
        ) from None


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory", "name the files inside it"),
    (stat.S_ISFIFO, "a FIFO (named pipe)",
     "actcfg reads regular files only (a pipe could block it forever): save the content to a "
     "file and name that"),
    (stat.S_ISCHR, "a character device", "name a regular file"),
    (stat.S_ISBLK, "a block device", "name a regular file"),
    (stat.S_ISSOCK, "a socket", "name a regular file"),
)


def _refuse_unless_regular(mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    what, hint = "not a regular file", "name a regular file"
    for test, kind, fix in _NOT_REGULAR:
        if test(mode):
            what, hint = kind, fix
            break
    raise LoadFailure("file-unreadable", f"this is {what}, not a regular file", hint)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file at `path`, or `LoadFailure` (`file-not-found`,
    `file-unreadable`, `file-too-large`).

    Anything but a regular file is refused before it is read: a FIFO blocks its reader until a
    writer comes, and a device such as /dev/zero never ends. The path is checked with stat
    first, then opened without blocking and checked again on the open descriptor, so a file
    swapped for a FIFO in between cannot hang actcfg either.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        _refuse_unless_regular(os.stat(name).st_mode)
        fd = os.open(name, flags | getattr(os, "O_CLOEXEC", 0))
        try:
            info = os.fstat(fd)
            _refuse_unless_regular(info.st_mode)
            if info.st_size > MAX_BYTES:
                raise LoadFailure(
                    "file-too-large",
                    f"the file is {info.st_size:,} bytes; actcfg reads files up to {MAX_BYTES:,} bytes",
                    "point actcfg at the policy or config file itself (or its section with --at)",
                )
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as handle:
                raw = handle.read(MAX_BYTES + 1)  # the file may have grown since fstat
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise LoadFailure(
            "file-not-found", "no such file", "check the path; a broken symlink also reads as missing"
        ) from None
    except PermissionError:
        raise LoadFailure(
            "file-unreadable", "permission denied", "make the file readable by this user"
        ) from None
    except OSError as e:
        raise LoadFailure(
            "file-unreadable", f"cannot read the file: {e.strerror or e}", "check the path"
        ) from None
    if len(raw) > MAX_BYTES:
        raise LoadFailure(
            "file-too-large",
            f"the file holds more than {MAX_BYTES:,} bytes",
            "point actcfg at the policy or config file itself",
        )
    return raw


def read_document(path: str | os.PathLike[str], *, yaml11: bool = False) -> Document:
    """Read and parse the YAML file at `path` (see `parse_document`), or raise `LoadFailure`."""
    name = os.fspath(path)
    return parse_document(decode_text(read_bytes(name)), name, yaml11=yaml11)
