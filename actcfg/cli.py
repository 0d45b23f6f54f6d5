"""`actcfg`: validate | schema | translate | import | verify | plan. Flags, wiring and exit codes only.

Exit codes (docs/architecture.md): 0 every file valid; 1 any error (or any warning under
`--strict`); 2 usage error or a file that cannot be read. No input produces a traceback.
Adding a subcommand is one `_add_<name>` function and one entry in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import io
import os
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from actcfg._version import __version__
from actcfg.policy.checker import check_document, check_file, failure_diagnostic
from actcfg.policy.diagnostics import REPORTER_BY_NAME, Diagnostic, Result, escape_controls
from actcfg.errors import ActcfgError, TranslationError, install_command
from actcfg.backends import RUNTIME_BACKENDS, Backend
from actcfg.policy.loader import LoadFailure, read_document
from actcfg.policy.schema import policy_json_schema

__all__ = ["COMMANDS", "main"]

_UNREADABLE = frozenset({"file-not-found", "file-unreadable", "json-too-complex"})
_BACKENDS = [b.value for b in Backend]
_RUNTIME_BACKENDS = [b.value for b in RUNTIME_BACKENDS]


class _Usage(Exception):
    """A usage error found after parsing: report it and exit 2."""


class _OutputFailed(Exception):
    """Writing to stdout or stderr failed (a full disk, a closed terminal): exit 2."""

    def __init__(self, stream: str, error: OSError) -> None:
        super().__init__(f"cannot write to {stream}: {error.strerror or error}")
        self.stream = stream


def _write_stream(stream: Any, name: str, text: str) -> None:
    try:
        try:
            stream.write(text)
        except UnicodeEncodeError:
            # A terminal that is not UTF-8 (PYTHONIOENCODING=ascii): the file's bytes as they are.
            stream.flush()
            stream.buffer.write(text.encode("utf-8"))
        stream.flush()  # a full disk shows at the flush, which must not wait for exit
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _OutputFailed(name, e) from None


def _out(text: str, path: str | None = None) -> None:
    if path is None:
        _write_stream(sys.stdout, "standard output", text)
    else:
        _write_file(path, text)


def _err(text: str) -> None:
    _write_stream(sys.stderr, "standard error", text)


def _write_file(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a new file in the same folder, then
    renamed over `path` (os.replace), so a failed write (a full disk) leaves the old file as
    it was. A symlink is followed and kept. A descriptor of this process (`-o /dev/stdout`,
    `/dev/stderr`, `/dev/fd/N`) is written through, as the shell's redirection opened it (a
    `>> build.log` keeps appending; a pipe works), and a device or FIFO is written in place:
    there is no file to replace. A file this process may not write is refused, as the shell's
    `>` refuses it, though renaming over it would need only the folder's permission."""
    import tempfile

    fd = _descriptor_named(path)
    if fd is not None:
        _write_descriptor(fd, path, text)
        return
    target, info = _output_target(path)
    try:
        if info is not None and not stat.S_ISREG(info.st_mode):
            with open(target, "w", encoding="utf-8") as handle:
                handle.write(text)
            return
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target),
                                         prefix=f".{os.path.basename(target)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            if info is not None:
                mode = stat.S_IMODE(info.st_mode)
            else:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.chmod(temporary, mode)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as e:
        raise _Usage(f"cannot write {path}: {e.strerror or e}") from None


def _output_target(path: str) -> tuple[str, os.stat_result | None]:
    """(the file `-o path` writes, its stat or None if it is new), or _Usage for a target that
    cannot be written: a directory, a missing or unwritable folder, a file this process may not
    write. Checked before any work that -o would lose (`actcfg plan` profiles for minutes)."""
    target = os.path.realpath(path)
    try:
        try:
            info: os.stat_result | None = os.stat(target)
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISDIR(info.st_mode):
            raise _Usage(f"cannot write {path}: it is a directory")
        if info is not None and stat.S_ISREG(info.st_mode):
            # What the shell's `>` asks of the file itself (root may write anything, as there).
            os.close(os.open(target, os.O_WRONLY))
        folder = os.path.dirname(target) or "."
        if info is None and not os.path.isdir(folder):
            raise _Usage(f"cannot write {path}: No such file or directory")
        if (info is None or stat.S_ISREG(info.st_mode)) and not os.access(folder, os.W_OK | os.X_OK):
            raise _Usage(f"cannot write {path}: Permission denied")
    except OSError as e:
        raise _Usage(f"cannot write {path}: {e.strerror or e}") from None
    return target, info


def _check_output(path: str | None) -> None:
    """_Usage now if `-o path` could not be written later."""
    if path is None:
        return
    fd = _descriptor_named(path)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError as e:
            raise _Usage(f"cannot write {path}: {e.strerror or e}") from None
        return
    _output_target(path)


def _descriptor_named(path: str) -> int | None:
    """The descriptor N when `path` names one of this process's own (`/dev/stdout`, `/dev/fd/N`,
    `/proc/self/fd/N`, through symlinks), else None. Resolving such a path to a file, as
    realpath does, would treat the shell's redirection target as a file to replace."""
    import re

    own = re.compile(rf"^/proc/(?:self|thread-self|{os.getpid()})(?:/task/\d+)?/fd/(\d+)$")
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on symlinks followed
        folder, name = os.path.split(current)
        where = os.path.join(os.path.realpath(folder), name)
        found = own.match(where)
        if found:
            return int(found.group(1))
        if not os.path.islink(where):
            return None
        current = os.path.normpath(os.path.join(os.path.dirname(where), os.readlink(where)))
    return None


def _write_descriptor(fd: int, path: str, text: str) -> None:
    """`text` through descriptor `fd` of this process: stdout and stderr through their streams
    (in order with what else is printed there), another descriptor as it is."""
    for stream, name in ((sys.stdout, "standard output"), (sys.stderr, "standard error")):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream.fileno() == fd:
                _write_stream(stream, name, text)
                return
    data = text.encode("utf-8")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        raise _Usage(f"cannot write {path}: {e.strerror or e}") from None


def _refuse_output_over(output: str | None, inputs: Sequence[str | None]) -> None:
    """-o must not name an input: the input would be gone before it was read in full."""
    if output is None:
        return
    for name in inputs:
        if name is None:
            continue
        with contextlib.suppress(OSError):
            if os.path.samefile(output, name):
                raise _Usage(f"-o {output} is the input file {name}: actcfg does not write over "
                             "its input; write to another file, check it, then move it")


def _exit_code(diagnostics: Sequence[Diagnostic], strict: bool = False) -> int:
    if any(d.code in _UNREADABLE for d in diagnostics):
        return 2
    if any(d.severity == "error" or strict for d in diagnostics):
        return 1
    return 0


# --- validate ----------------------------------------------------------------------------


def _validate(args: argparse.Namespace) -> int:
    name = args.format or ("github" if os.environ.get("GITHUB_ACTIONS") == "true" else "text")
    result = Result()
    backends = tuple(args.backend or ())
    for path in args.files:
        _, diagnostics = check_file(path, backends=backends, at=args.at)
        if args.at is None and any(d.severity == "error" for d in diagnostics):
            diagnostics = _deepspeed_config_instead(path) or diagnostics
        result.add(path, diagnostics)
    _out(REPORTER_BY_NAME[name].render(result, args.strict))
    if name != "json":
        summary = result.summary()
        if args.strict and result.warnings and not result.errors:
            # Exit 1 under "0 errors" needs its reason on the same line.
            summary += (f"; --strict fails on {'the warning' if len(result.warnings) == 1 else 'warnings'}")
        _err(f"actcfg: {summary}\n")
    return _exit_code(result.diagnostics, args.strict)


def _deepspeed_config_instead(path: str) -> list[Diagnostic]:
    """For a file that failed validation: when it is a DeepSpeed (or gpt-neox) config, read as
    DeepSpeed reads it (hjson: comments, trailing commas), the one error that says so and
    points at `actcfg import`; else nothing. Only on failure: valid policies never pay for it."""
    from actcfg.translators.ds_loader import read_config
    from actcfg.translators.ds_config import deepspeed_keys

    try:
        doc = read_config(path)
    except LoadFailure:
        return []
    keys = deepspeed_keys(doc.data)
    if not keys:
        return []
    line, column = doc.locate((keys[0],), key=True)
    named = ", ".join(f"`{k}`" for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
    return [Diagnostic(path, line, column, "deepspeed-config", "error",
                       f"this is a DeepSpeed config ({named}), not an actcfg policy",
                       f"`actcfg import {path}` writes the policy for what DeepSpeed runs from it; "
                       "validate that policy")]


def _add_validate(sub: Any) -> None:
    p = sub.add_parser("validate", help="check policy files; exit 1 on any error")
    p.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files")
    p.add_argument("--backend", action="append", choices=_BACKENDS,
                   help="also check the rules of this backend (repeatable)")
    p.add_argument("--format", choices=sorted(REPORTER_BY_NAME),
                   help="output format (default: text; github under GITHUB_ACTIONS=true)")
    p.add_argument("--strict", action="store_true", help="treat warnings as errors")
    p.add_argument("--at", metavar="KEY", help="dotted key of the policy inside a larger YAML")
    p.set_defaults(run=_validate)


# --- schema ------------------------------------------------------------------------------


def _schema(args: argparse.Namespace) -> int:
    import json  # json is imported by the commands that print it, not by validate

    _out(json.dumps(policy_json_schema(), indent=2) + "\n", args.output)
    return 0


def _add_schema(sub: Any) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a policy file")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    p.set_defaults(run=_schema)


# --- translate and import ------------------------------------------------------------------


def _report(diagnostics: Sequence[Diagnostic]) -> None:
    if diagnostics:
        _err("".join(f"{d}\n" for d in diagnostics))


def _located(doc: Any, name: str, findings: Sequence[Any]) -> list[Diagnostic]:
    """Findings (path in the config file) as diagnostics at the key each path names."""
    out = []
    for f in findings:
        line, column = doc.locate(tuple(f.path), key=True)
        out.append(Diagnostic(name, line, column, f.code, f.severity, f.message, f.hint))
    return out


def _problems(doc: Any, name: str) -> list[Diagnostic]:
    return [Diagnostic(name, p.line, p.column, p.code, "error", p.message, p.hint)
            for p in doc.problems]


def _in_file_order(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    return sorted(diagnostics, key=lambda d: (d.line or 0, d.column or 0))


def _read_config(path: str) -> tuple[Any, list[Diagnostic]]:
    from actcfg.translators.ds_loader import read_config

    try:
        return read_config(path), []
    except LoadFailure as e:
        return None, [failure_diagnostic(path, e)]


def _merge(args: argparse.Namespace, section: dict[str, Any]) -> tuple[str | None, int]:
    """The ds_config's text with `section` spliced in, or None and the exit code."""
    import dataclasses

    from actcfg.backends.deepspeed import SECTION
    from actcfg.translators.ds_loader import JsonDocument, parse_config
    from actcfg.translators.ds_config import merge_conflicts, splice_section

    doc, failed = _read_config(args.merge)
    if failed:
        _report(failed)
        return None, _exit_code(failed)
    if not isinstance(doc, JsonDocument):
        raise _Usage(f"--merge edits a DeepSpeed JSON config, and {args.merge} is YAML")
    if not isinstance(doc.data, dict):
        _report([Diagnostic(args.merge, 1, 1, "bad-value", "error", "a ds_config is a JSON object",
                            "pass the ds_config.json file")])
        return None, 1
    conflicts = merge_conflicts(doc.data, section, replace=args.replace)
    conflicts = [dataclasses.replace(f, hint=f"{f.hint}; or pass --replace to take the policy's section")
                 if f.code == "ds-config-conflict" and f.path[:1] == (SECTION,) else f for f in conflicts]
    diagnostics = _in_file_order(_problems(doc, args.merge) + _located(doc, args.merge, conflicts))
    _report(diagnostics)
    if any(d.severity == "error" for d in diagnostics):
        return None, 1
    try:
        text = splice_section(doc.text, doc.spans, section)
    except TranslationError as e:
        _report([Diagnostic(args.merge, 1, 1, "ds-config-conflict", "error", str(e),
                            "add the section by hand")])
        return None, 1
    # The splice touched one member: check that the result reads back as the merge says.
    expected = {**doc.data, "activation_checkpointing": section}
    if parse_config(text, args.merge).data != expected:
        raise ActcfgError(f"--merge: splicing the section into {args.merge} changed other "
                          "values; nothing was written (please report this)")
    return ("\ufeff" if doc.bom else "") + text, 0


def _translate(args: argparse.Namespace) -> int:
    import json

    from actcfg.translators import translate

    _refuse_output_over(args.output, [args.file, args.merge])
    try:
        doc = read_document(args.file)
    except LoadFailure as e:
        failure = [failure_diagnostic(args.file, e)]
        _report(failure)
        return _exit_code(failure)
    backends = (args.backend,) if args.backend else ()
    policy, diagnostics = check_document(doc, backends=backends, at=args.at)
    _report(diagnostics)
    if policy is None:
        return 1
    backend = Backend.parse(args.backend) if args.backend else policy.backend
    if args.merge and backend is not Backend.DEEPSPEED:
        raise _Usage("--merge needs the deepspeed backend (it edits a ds_config)")
    if args.replace and not args.merge:
        raise _Usage("--replace goes with --merge DS_CONFIG (it replaces that file's section)")
    try:
        out = translate(policy, backend)
    except TranslationError as e:
        line, column = doc.section(args.at).locate(tuple(e.field.split(".")))
        _report([Diagnostic(args.file, line, column, "unsupported-on-backend", "error",
                            str(e), f"remove `{e.field}`, or choose another backend")])
        return 1
    if args.merge:
        text, code = _merge(args, out["activation_checkpointing"])
        if text is None:
            return code
        _out(text, args.output)
        return 0
    _out(json.dumps(out, indent=2) + "\n", args.output)
    return 0


def _add_translate(sub: Any) -> None:
    p = sub.add_parser("translate", help="print the backend's names for a policy, as JSON")
    p.add_argument("file", metavar="FILE", help="the policy YAML file to translate")
    p.add_argument("--backend", choices=_BACKENDS, help="default: the policy's `backend`")
    p.add_argument("--merge", metavar="DS_CONFIG",
                   help="print this ds_config.json with the policy's activation_checkpointing "
                        "section in it (every other byte kept as written); keys the file's "
                        "section already has must agree with the policy, or it exits 1 naming "
                        "each one")
    p.add_argument("--replace", action="store_true",
                   help="with --merge: replace a section that disagrees, with a warning naming "
                        "each old value")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write here instead of stdout (never over an input)")
    p.add_argument("--at", metavar="KEY", help="dotted key of the policy inside a larger YAML")
    p.set_defaults(run=_translate)


def _import(args: argparse.Namespace) -> int:
    if args.backend in (Backend.HF, Backend.LIGHTNING):
        return _import_trainer(args)
    import dataclasses

    from actcfg.translators import import_ds_config

    _refuse_output_over(args.output, [args.file])
    doc, failed = _read_config(args.file)
    if failed:
        _report(failed)
        return _exit_code(failed)
    if args.num_checkpoints is not None and args.num_checkpoints < 1:
        raise _Usage(f"--num-checkpoints must be at least 1, got {args.num_checkpoints}")
    if doc.data == {}:  # `{}`: not yet written, or the wrong file; DeepSpeed would not start
        empty = [Diagnostic(args.file, 1, 1, "bad-value", "error",
                            "the ds_config is an empty object: DeepSpeed refuses it (`Either "
                            "train_batch_size or train_micro_batch_size_per_gpu needs to be "
                            "provided`), and it says nothing about activation checkpointing",
                            "pass the ds_config your training runs with")]
        _report(empty)
        return 1
    imported = import_ds_config(doc.data, modules=args.modules, external=args.external,
                                num_checkpoints=args.num_checkpoints)
    diagnostics = _in_file_order(_problems(doc, args.file)
                                 + _located(doc, args.file, imported.findings))
    diagnostics = [dataclasses.replace(d, hint=d.hint.replace("FILE", args.file))
                   if d.code == "not-a-ds-config" else d for d in diagnostics]
    _report(diagnostics)
    if imported.yaml is None or any(d.severity == "error" for d in diagnostics):
        return 1
    _out(imported.yaml, args.output)
    return 0


def _import_trainer(args: argparse.Namespace) -> int:
    """`actcfg import --backend hf|lightning`: TrainingArguments or DeepSpeedStrategy keywords,
    as YAML or JSON, back to a policy."""
    from actcfg.translators.trainer_import import import_strategy_keywords, import_training_arguments

    hf = args.backend == Backend.HF
    trainer = "transformers" if hf else "Lightning"
    what = "TrainingArguments keywords" if hf else "DeepSpeedStrategy keywords"
    if hf and args.num_checkpoints is not None:
        raise _Usage("--num-checkpoints sizes DeepSpeed's contiguous buffers: it is for --backend "
                     "deepspeed or lightning, not hf")
    if args.num_checkpoints is not None and args.num_checkpoints < 1:
        raise _Usage(f"--num-checkpoints must be at least 1, got {args.num_checkpoints}")
    _refuse_output_over(args.output, [args.file])
    try:
        # As transformers reads the file: HfArgumentParser.parse_yaml_file is yaml.safe_load
        # (YAML 1.1: `gradient_checkpointing: yes` is true). Lightning's keywords come from
        # Python or its CLI, not one YAML reader: actcfg's own (only true/false are booleans).
        doc = read_document(args.file, yaml11=hf)
    except LoadFailure as e:
        failure = [failure_diagnostic(args.file, e)]
        if e.code == "yaml-not-mapping":  # the loader's hint speaks of policies
            failure = [Diagnostic(args.file, e.line, e.column, e.code, "error",
                                  f"{what} are a mapping of `name: value` lines",
                                  f"write the {what} as a YAML or JSON mapping")]
        _report(failure)
        return _exit_code(failure)
    problems = _problems(doc, args.file)
    if problems:  # duplicate keys: which one the trainer keeps is its parser's accident
        _report(problems)
        return 1
    try:
        if hf:
            imported = import_training_arguments(doc.data, modules=args.modules, external=args.external)
        else:
            imported = import_strategy_keywords(doc.data, modules=args.modules, external=args.external,
                                                num_checkpoints=args.num_checkpoints)
    except TranslationError as e:
        _report([Diagnostic(args.file, None, None, "unsupported-on-backend", "error", str(e),
                            f"pass {what}")])
        return 1

    def where(key: str) -> tuple[int | None, int | None]:
        return doc.locate(tuple(key.split(".")), key=True) if key.split(".")[0] in doc.data else (None, None)

    # Each reason says what became of the key when it is more than "not imported" (a truthy
    # "false" is imported as on): the hint never contradicts it.
    _report([Diagnostic(args.file, *where(key), "ignored-key", "warning", f"`{key}`: {why}",
                        "" if "imported" in why or "not used" in why else "not imported")
             for key, why in imported.ignored]
            + [Diagnostic(args.file, None, None, "dropped-by-backend", "warning", f"`{key}`: {why}",
                          f"imported: the policy keeps what {trainer} would lose")
               for key, why in imported.dropped]
            + ([_placeholder_diagnostic(args.file, what, hf)] if imported.placeholder else []))
    _out(imported.yaml, args.output)
    return 0


def _placeholder_diagnostic(name: str, what: str, hf: bool) -> Diagnostic:
    from actcfg.translators.ds_config import placeholder_finding

    f = placeholder_finding(f"the {what}", (), "to keep transformers' own checkpointing "
                            "(`mode: external`)" if hf else "if the model calls "
                            "deepspeed.checkpointing.checkpoint itself")
    return Diagnostic(name, None, None, f.code, f.severity, f.message, f.hint)


def _add_import(sub: Any) -> None:
    p = sub.add_parser("import", help="print the actcfg policy for what a ds_config.json (or a "
                                      "gpt-neox config), TrainingArguments or DeepSpeedStrategy "
                                      "keywords run")
    p.add_argument("file", metavar="FILE",
                   help="a ds_config (JSON or hjson) or gpt-neox config (.yml); with --backend hf, "
                        "TrainingArguments keywords (YAML or JSON); with --backend lightning, "
                        "DeepSpeedStrategy keywords (YAML or JSON)")
    p.add_argument("--backend", choices=[Backend.DEEPSPEED.value, Backend.HF.value, Backend.LIGHTNING.value],
                   default=Backend.DEEPSPEED.value, help="what FILE holds (default: deepspeed)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--modules", nargs="+", metavar="NAME",
                       help="class names (or patterns) of the modules to checkpoint, which no "
                            "ds_config or trainer keyword can say (without it or --external, the "
                            "policy holds CHANGE_ME, which validate refuses)")
    which.add_argument("--external", action="store_true",
                       help="the model checkpoints itself: it calls deepspeed.checkpointing."
                            "checkpoint (Megatron, gpt-neox), or with --backend hf transformers "
                            "keeps its own checkpointing; write `checkpoint: {mode: external}`")
    p.add_argument("--num-checkpoints", type=int, metavar="N",
                   help="checkpointed calls per step, as the program passes num_checkpoints to "
                        "configure() itself (Megatron: its --num-layers); needed for contiguous "
                        "buffers with --external when the file has no number_checkpoints "
                        "(deepspeed and lightning)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write here instead of stdout (never over the input)")
    p.set_defaults(run=_import)


# --- verify --------------------------------------------------------------------------------


def _refuse_verify(args: argparse.Namespace, code: int, message: str | None,
                   diagnostics: Sequence[Diagnostic] = (), status: str | None = None) -> int:
    """Report why verify (or plan) measured nothing, in the format asked for; return `code`."""
    if args.format == "json":
        import json
        from dataclasses import asdict

        status = status or {1: "invalid", 2: "unreadable" if diagnostics else "usage-error"}[code]
        body = {"ok": False, "status": status, "message": message,
                "errors": [asdict(d) for d in diagnostics]}
        _out(json.dumps(body, indent=2) + "\n")
        return code
    if diagnostics:
        _report(diagnostics)
    if message is not None:
        _err(f"actcfg: error: {escape_controls(message)}\n")
    return code


def _launched_rank() -> int:
    """This process's rank under a launcher that starts several (torchrun sets RANK and
    WORLD_SIZE); 0 otherwise."""
    try:
        return int(os.environ.get("RANK", "0")) if _launched_world() > 1 else 0
    except ValueError:
        return 0


def _launched_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _verify(args: argparse.Namespace) -> int:
    """Under torchrun every rank measures and judges alike; only rank 0 writes (the report, the
    plot, the errors), and every rank returns the exit code of the same verdicts."""
    return _rank_zero_writes(_verify_here, args)


def _rank_zero_writes(command: Callable[..., int], args: argparse.Namespace) -> int:
    """Run `command` on every rank; rank 0 (or a process torchrun did not start) writes, the
    others run it silenced and return the same exit code."""
    if _launched_rank() == 0:
        return command(args)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            return command(args, write=False)
        except _Usage:
            return 2
        except ActcfgError:
            return 1


def _require_torch(command: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ActcfgError(f"{command} needs torch, which is not installed: "
                          f"{install_command('torch')}") from None


def _verify_here(args: argparse.Namespace, write: bool = True) -> int:
    # Imported here, not above: verify measures with torch, and validate must never load it.
    from actcfg.verification import DEFAULT_MODEL, load_factory, require_cuda, verify
    from actcfg.verification.render import REPORTER_BY_NAME as RENDERERS
    from actcfg.verification.render import plot_memory, require_plotting

    policy, diagnostics = check_file(args.config, backends=(args.backend,) if args.backend else ())
    if policy is None:  # an invalid policy is 1, as in validate; unreadable 2
        return _refuse_verify(args, _exit_code(diagnostics) or 1, None, diagnostics)
    _report(diagnostics)
    if args.steps < 1:
        return _refuse_verify(args, 2, f"--steps must be at least 1, got {args.steps}")
    backend = Backend.parse(args.backend) if args.backend else policy.backend
    try:  # what would stop the run is found before the GPU work, and is a usage error
        _require_torch("actcfg verify")  # before the model: the default probe model needs it too
        factory = load_factory(args.model or DEFAULT_MODEL)
        require_cuda()
        if args.plot:
            require_plotting()
    except ActcfgError as e:
        return _refuse_verify(args, 2, str(e))
    with contextlib.ExitStack() as stack:
        try:
            group = stack.enter_context(_process_group(backend))
        except _Usage as e:
            return _refuse_verify(args, 2, str(e))
        options: dict[str, Any] = {}
        if group is not None and backend is Backend.DEEPSPEED:
            # The ranks torchrun started hold the same model, as tensor-parallel ranks do:
            # they are the model-parallel group DeepSpeed partitions across.
            options["mpu"] = group
        report = verify(factory, policy, steps=args.steps, backend=args.backend, **options)
    if not write:
        return 0 if report.ok else 1
    _out(RENDERERS[args.format](report))
    if args.plot:
        try:
            plot_memory(report, args.plot)
        except ActcfgError as e:
            _err(f"actcfg: error: {escape_controls(str(e))}\n")
            # The verdicts are already out: a failed promise (1) must not read as an I/O error (2).
            return 2 if report.ok else 1
    return 0 if report.ok else 1


@contextlib.contextmanager
def _process_group(backend: Backend) -> Iterator[Any]:
    """The process group verify runs in, destroyed after if started here; yields the group of
    all ranks when a launcher started several, else None.

    Under a launcher (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)
    the group is started from its environment, one GPU per rank (LOCAL_RANK): the ranks gather
    their measurements through it. Without one, a DeepSpeed policy gets a one-process group
    (DeepSpeed's `configure` asks torch.distributed for the rank even on one GPU) and a torch
    policy none. A group already up is used as it is and left up.
    """
    import torch.distributed as dist

    launched = "WORLD_SIZE" in os.environ
    if dist.is_available() and dist.is_initialized():
        yield dist.group.WORLD if dist.get_world_size() > 1 else None
        return
    if backend is not Backend.DEEPSPEED and _launched_world() <= 1:
        yield None
        return
    if not dist.is_available():
        raise _Usage("verify on several ranks needs torch.distributed, which this torch lacks")
    deepspeed = None
    if backend is Backend.DEEPSPEED:
        try:
            # DeepSpeed logs to stdout (its logger's handler takes sys.stdout when first
            # imported; its op builder prints): stdout is for the report (`--format json`).
            with contextlib.redirect_stdout(sys.stderr):
                import deepspeed
        except ImportError:
            raise _Usage("this policy's backend is deepspeed, and DeepSpeed is not installed: "
                         f"{install_command('deepspeed')}") from None
    import torch

    before: dict[str, str | None] = {}
    if not launched:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
    # NCCL wants one GPU per rank, chosen before the group starts; without CUDA (verify's own
    # check refuses that later), gloo.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        name = "nccl"
    else:
        name = "gloo"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if deepspeed is not None:
                deepspeed.init_distributed(dist_backend=name, dist_init_required=True)
            else:
                dist.init_process_group(name)
        yield dist.group.WORLD if dist.get_world_size() > 1 else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _add_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="run a model plain and with the policy on the GPU; exit 1 "
                                      "if a promise of the policy does not hold")
    p.add_argument("config", metavar="CONFIG", help="policy YAML file")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="factory returning (model, example_inputs), or a model with an "
                        "example_inputs attribute or method (default: actcfg.probes:linear_chain)")
    p.add_argument("--backend", choices=_RUNTIME_BACKENDS, help="default: the policy's `backend`")
    p.add_argument("--steps", type=int, default=3, help="forward+backward steps per run (default 3)")
    p.add_argument("--format", choices=["json", "text"], default="text", help="output format")
    p.add_argument("--plot", metavar="PNG", help="also write memory per block, plain vs policy")
    p.set_defaults(run=_verify)


# --- plan --------------------------------------------------------------------------------


def _to_device(value: Any, device: Any) -> Any:
    """The example inputs with every tensor on the model's device."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _with_compile(args: argparse.Namespace, policy: Any) -> Any:
    """`policy` with --compile and --compile-backend over its `compile:` (None: a backend given
    with nothing to compile)."""
    from actcfg.policy.schema import Compile

    given = policy.compile.model_dump(exclude_unset=True) if policy.compile is not None else {}
    if args.compile is not None:
        given["scope"] = args.compile
    if args.compile_backend is not None:
        given["backend"] = args.compile_backend
    if "scope" not in given:
        return None
    return policy.model_copy(update={"compile": Compile(**given)})


def _plan(args: argparse.Namespace) -> int:
    """Under torchrun every rank profiles, the ranks plan from their profiles reduced to the
    worst case (actcfg.plan.consensus) and all apply the same plan; only rank 0 writes (the
    plan file, the report, the errors), and every rank returns the exit code of the slowest."""
    return _rank_zero_writes(_plan_here, args)


def _plan_here(args: argparse.Namespace, write: bool = True) -> int:
    """Profile, solve, write the rules policy, apply it and measure: exit 0 when the measured
    peak is within the budget, 1 when it is not or no plan fits, 2 for usage."""
    from actcfg.policy.schema import parse_size

    _refuse_output_over(args.output, [args.config])
    try:  # before the minutes of profiling that a target -o cannot write would lose
        _check_output(args.output)
    except _Usage as e:
        return _refuse_verify(args, 2, str(e))
    policy, diagnostics = check_file(args.config)
    if policy is None:
        return _refuse_verify(args, _exit_code(diagnostics) or 1, None, diagnostics)
    _report(diagnostics)
    if policy.checkpoint.mode != "auto":
        return _refuse_verify(args, 2, (
            f"actcfg plan plans for a policy that asks for one (`checkpoint: {{mode: auto, "
            f"modules: [...]}}` with `memory_budget`), and {args.config} has checkpoint.mode "
            f"{policy.checkpoint.mode}; write mode auto with the modules to plan over"))
    if args.budget is not None:
        try:
            budget = parse_size(args.budget)
        except ValueError as e:
            return _refuse_verify(args, 2, f"--budget {args.budget!r}: {e}")
        if budget == 0:  # the file's memory_budget is refused at 0 by the schema; so is this
            return _refuse_verify(args, 2, f"--budget {args.budget!r}: a budget of 0 bytes leaves "
                                           "no room for a training step")
        policy = policy.model_copy(update={"memory_budget": budget})
    if args.compile is not None or args.compile_backend is not None:
        try:
            policy = _with_compile(args, policy)
        except ValueError as e:  # pydantic's ValidationError: an empty backend name
            return _refuse_verify(args, 2, f"--compile-backend {args.compile_backend!r}: "
                                           f"{e.errors()[0]['msg'] if hasattr(e, 'errors') else e}")
        if policy is None:
            return _refuse_verify(args, 2, "--compile-backend names torch.compile's backend for "
                                           "--compile (or the file's `compile:`), and neither is "
                                           "given: add --compile blocks|model")
    if args.steps < 1:
        return _refuse_verify(args, 2, f"--steps must be at least 1, got {args.steps}")
    from actcfg.verification import load_factory

    try:
        factory = load_factory(args.model)
        try:
            import torch
        except ImportError:
            raise ActcfgError(f"actcfg plan needs torch, which is not installed: {install_command('torch')}") from None
        if not torch.cuda.is_available():
            raise ActcfgError("actcfg plan profiles a training step on the GPU and needs a CUDA "
                              "GPU, but torch.cuda.is_available() is False here: run it on a GPU "
                              "machine")
    except ActcfgError as e:
        return _refuse_verify(args, 2, str(e))
    from actcfg.errors import PlanError
    from actcfg.plan import plan_model
    from actcfg.plan.consensus import slowest_rank
    from actcfg.plan.profile import measure_steps
    from actcfg.api import apply
    from actcfg.verification.measure import BUILD_SEED

    with contextlib.ExitStack() as stack:
        try:  # under torchrun, the group the ranks plan together in (one GPU each)
            stack.enter_context(_process_group(Backend.TORCH))
        except _Usage as e:
            return _refuse_verify(args, 2, str(e))
        torch.manual_seed(BUILD_SEED)
        try:
            model, inputs = _build(factory, args.model)
        except _Usage as e:
            return _refuse_verify(args, 2, str(e))
        if any(t.device.type != "cuda" for t in [*model.parameters(), *model.buffers()]):
            model.cuda()
        inputs = _to_device(inputs, next(model.parameters()).device)
        try:
            planned = plan_model(model, policy, inputs, apply=apply, origin=args.config)
        except PlanError as e:
            return _refuse_verify(args, 1, str(e), status="no-plan-fits")
        with apply(model, planned.policy):
            if planned.policy.compile is not None:  # its graphs built before the timed steps
                measure_steps(model, inputs, steps=2)
            step_ms, peak = measure_steps(model, inputs, steps=args.steps)
        step_ms, peak = slowest_rank(step_ms, peak)  # the plan holds only if it holds on each
    report, budget = planned.report, planned.plan.budget
    ok = peak <= budget
    unwritten = None
    if args.output and write:  # one file, from rank 0
        try:
            _out(report.policy_yaml, args.output)
        except _Usage as e:
            # Checked before profiling, failed now (a full disk, /dev/full): the plan is printed
            # below as without -o, so that the minutes spent on it are not lost.
            unwritten, args.output = str(e), None
    if args.format == "json":
        import json

        body = {
            "ok": ok, "config": args.config, "written": args.output, **report.plan_json(),
            "measured": {"step_time_ms": step_ms, "peak": peak, "steps": args.steps},
            "profile": planned.profile.to_json(), "copy_windows": planned.profile.copy_windows(),
        }
        _out(json.dumps(body, indent=2) + "\n")
    else:
        _out(_render_plan(args, planned, step_ms, peak, ok))
    if unwritten is not None:
        _err(f"actcfg: error: {escape_controls(unwritten)}; the plan is printed on standard "
             "output instead\n")
        return 2
    return 0 if ok else 1


def _build(factory: Callable[[], Any], spec: str) -> tuple[Any, Any]:
    """The factory's (model, example_inputs), or _Usage with a sentence: the factory raised, or
    returned something that is not a model with its inputs."""
    from actcfg.verification.factory import build

    try:
        return build(factory)
    except ActcfgError as e:
        raise _Usage(f"--model {spec}: {e}") from None
    except Exception as e:  # the user's code: say what it raised, never "internal error"
        raise _Usage(f"--model {spec}: the model factory raised {type(e).__name__}: {e}") from None


def _render_plan(args: argparse.Namespace, planned: Any, step_ms: float, peak: int, ok: bool) -> str:
    report, budget = planned.report, planned.plan.budget

    from actcfg.plan import OFFLOADS
    from actcfg.units import memory_size

    def off(measured: float, predicted: float) -> str:
        return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"

    width = max(len(m) for m, _ in report.choices)
    lines = [f"actcfg plan: {len(report.choices)} modules, memory_budget {memory_size(budget)}, "
             f"profiled on {report.device}", ""]
    lines += [f"{m.ljust(width)}  {c}" for m, c in report.choices]
    lines += [
        "",
        f"step time  predicted {report.predicted_step_time_ms:.1f} ms, measured {step_ms:.1f} ms "
        f"(median of {args.steps}; prediction {off(step_ms, report.predicted_step_time_ms)})",
        f"peak       predicted {memory_size(report.predicted_peak)}, measured {memory_size(peak)} "
        f"(prediction {off(peak, report.predicted_peak)})",
        f"plain      {report.plain_step_time_ms:.1f} ms, {memory_size(report.plain_peak)}",
        f"planning   {report.profile_ms / 1000:.1f} s profiling"
        + (f" + {report.compile_ms / 1000:.1f} s compiling ({report.compiled})" if report.compiled
           else ""),
        ("offload    none" if not any(c in OFFLOADS for _, c in report.choices) else
         f"offload    max_inflight {report.max_inflight}; {report.kept_at_turn} modules after the "
         "last offloaded one stay on the GPU at the turn"),
        "",
        (f"PASS  memory_budget  the measured peak {memory_size(peak)} is within {memory_size(budget)}" if ok else
         f"FAIL  memory_budget  the measured peak {memory_size(peak)} is above {memory_size(budget)}: the "
         "profile did not predict this step; lower memory_budget, or profile with the batch you "
         "train with"),
    ]
    text = "\n".join(lines) + "\n"
    if args.output:
        return text + f"wrote {args.output}\n"
    return text + "\n" + report.policy_yaml


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="profile a training step on the GPU and write the fastest "
                                    "per-module policy whose peak fits memory_budget")
    p.add_argument("config", metavar="CONFIG",
                   help="policy YAML with `checkpoint: {mode: auto, modules: [...]}` and memory_budget")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY", required=True,
                   help="factory returning (model, example_inputs), as for actcfg verify")
    p.add_argument("--budget", metavar="SIZE", help="overrides the file's memory_budget (16GiB, ...)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the plan (a `checkpoint.mode: rules` policy) here (never over CONFIG)")
    p.add_argument("--steps", type=int, default=3,
                   help="steps measured under the plan after one warm-up (default 3)")
    p.add_argument("--compile", choices=["blocks", "model"],
                   help="plan for a compiled model (overrides the file's `compile.scope`): "
                        "profile each block, or the whole model, under torch.compile; the plan "
                        "written says so and actcfg.apply compiles it the same way")
    p.add_argument("--compile-backend", metavar="NAME",
                   help="torch.compile backend for --compile (default: the file's, else inductor)")
    p.add_argument("--format", choices=["json", "text"], default="text", help="output format")
    p.set_defaults(run=_plan)


# --- wiring --------------------------------------------------------------------------------

COMMANDS: dict[str, Callable[[Any], None]] = {
    "validate": _add_validate,
    "schema": _add_schema,
    "translate": _add_translate,
    "import": _add_import,
    "verify": _add_verify,
    "plan": _add_plan,
}
"""Each subcommand's parser builder; a builder sets `run` (args -> exit code) as default."""


EPILOGS: dict[str, str] = {
    "actcfg": """examples:
  actcfg validate configs/*.yaml
  actcfg translate configs/deepspeed-cpu-checkpointing.yaml --backend deepspeed
  actcfg import ds_config.json --modules Block -o policy.yaml
  actcfg verify configs/seed-linear-offload.yaml --plot memory.png      (GPU)

exit codes: 0 success; 1 invalid input, or a check that failed; 2 usage error or unreadable
file. `actcfg COMMAND --help` gives each command's.""",
    "validate": """examples:
  actcfg validate configs/*.yaml
  actcfg validate --backend deepspeed --strict policy.yaml
  actcfg validate --at training.memory train.yaml --format json

exit codes: 0 every file valid; 1 any error (or any warning with --strict); 2 usage error or
unreadable file.""",
    "schema": """examples:
  actcfg schema -o actcfg.schema.json

exit codes: 0; 2 when OUT cannot be written.""",
    "translate": """examples:
  actcfg translate configs/deepspeed-cpu-checkpointing.yaml --backend deepspeed
  actcfg translate configs/torch-selective.yaml --backend torch
  actcfg translate policy.yaml --merge ds_config.json -o ds_config.merged.json
  actcfg translate policy.yaml --merge ds_config.json --replace -o ds_config.merged.json

exit codes: 0 translated; 1 invalid policy, a field the backend cannot express, or a
ds_config section that disagrees (without --replace); 2 usage error or unreadable file.""",
    "import": """examples:
  actcfg import ds_config.json --modules Block -o policy.yaml
  actcfg import neox.yml --external
  actcfg import training_args.json --backend hf --modules LlamaDecoderLayer
  actcfg import strategy.yaml --backend lightning --modules Block

exit codes: 0 imported (warnings say what the file does not do as written); 1 the file cannot
become a policy; 2 usage error or unreadable file.""",
    "verify": """examples (on a CUDA GPU):
  actcfg verify configs/seed-linear-offload.yaml --plot memory.png
  actcfg verify configs/torch-checkpoint-offload.yaml --model actcfg.probes:blocks --format json
  torchrun --nproc-per-node 2 -m actcfg verify configs/deepspeed-partition-model-parallel.yaml --model actcfg.probes:blocks

exit codes: 0 every promise held; 1 invalid policy, or a promise that did not hold; 2 usage
error (no torch, no CUDA GPU, a --model that cannot be loaded) or unreadable file.""",
    "plan": """examples (on a CUDA GPU):
  actcfg plan configs/torch-memory-budget.yaml --model actcfg.probes:blocks -o plan.yaml
  actcfg plan configs/torch-memory-budget.yaml --model actcfg.probes:blocks --budget 4GiB --format json

exit codes: 0 the measured peak is within the budget; 1 above it, no plan fits, or an invalid
policy; 2 usage error (no torch, no CUDA GPU) or unreadable file.""",
}
"""`--help`'s examples and exit codes: the program's, then each command's."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actcfg",
        description="Declarative, checked activation-memory policies for PyTorch training.",
        epilog=EPILOGS["actcfg"], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"actcfg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    for name, command in sub.choices.items():
        command.epilog = EPILOGS[name]
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with `argv` (default: sys.argv[1:]); returns the exit code."""
    if argv is None:
        # Run as the `actcfg` program, so the process ends after this call. Freezing the heap at
        # exit spares the interpreter's final garbage collections over the ~30k objects that
        # Pydantic and typing leave: ~25 ms of a ~200 ms cold `actcfg validate`. Only what is
        # left at exit is affected (cycles are not finalized; the OS frees the memory), and the
        # in-process callers that pass `argv`, such as the tests, are not affected at all.
        atexit.register(gc.freeze)
    try:
        try:
            try:
                args = _parser().parse_args(argv)
            except SystemExit as e:  # argparse: --help and --version exit 0, usage errors 2
                return e.code if isinstance(e.code, int) else 2
            return args.run(args)
        except _Usage as e:
            _err(f"actcfg: error: {escape_controls(str(e))}\n")
            return 2
        except ActcfgError as e:
            _err(f"actcfg: error: {escape_controls(str(e))}\n")
            return 1
        except KeyboardInterrupt:
            _err("actcfg: interrupted\n")
            return 2
        except (_OutputFailed, BrokenPipeError):
            raise
        except Exception as e:  # last resort: never a traceback
            what = escape_controls(f"{type(e).__name__}: {e}")
            _err(f"actcfg: internal error, please report: {what}\n")
            return 2
    except BrokenPipeError:
        # The reader went away (`| head`): silence the flush at exit, as the Python docs advise.
        _silence(sys.stdout)
        return 2
    except _OutputFailed as e:
        if e.stream == "standard output":
            with contextlib.suppress(OSError, _OutputFailed):
                _err(f"actcfg: error: {e}\n")
        _silence(sys.stdout)
        _silence(sys.stderr)
        return 2


def _silence(stream: Any) -> None:
    """Point `stream`'s descriptor at /dev/null, so that the interpreter's flush at exit
    cannot fail on it a second time (and print a traceback of its own)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
