"""`actcfg`: validate | schema | translate | import | verify. Flags, wiring and exit codes only.

Exit codes (docs/architecture.md): 0 every file valid; 1 any error (or any warning under
`--strict`); 2 usage error or a file that cannot be read. No input produces a traceback.
Adding a subcommand is one `_add_<name>` function and one entry in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from actcfg._version import __version__
from actcfg.checker import check_document, check_file, failure_diagnostic
from actcfg.diagnostics import REPORTER_BY_NAME, Diagnostic, Result
from actcfg.errors import ActcfgError, TranslationError
from actcfg.loader import LoadFailure, read_document, read_json
from actcfg.backends import RUNTIME_BACKENDS, Backend
from actcfg.schema import policy_json_schema

__all__ = ["COMMANDS", "main"]

_UNREADABLE = frozenset({"file-not-found", "file-unreadable"})
_BACKENDS = [b.value for b in Backend]
_RUNTIME_BACKENDS = [b.value for b in RUNTIME_BACKENDS]


class _Usage(Exception):
    """A usage error found after parsing: report it and exit 2."""


def _out(text: str, path: str | None = None) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as e:
        raise _Usage(f"cannot write {path}: {e.strerror or e}") from None


def _err(text: str) -> None:
    sys.stderr.write(text)


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
        result.add(path, diagnostics)
    _out(REPORTER_BY_NAME[name].render(result, args.strict))
    if name != "json":
        _err(f"actcfg: {result.summary()}\n")
    return _exit_code(result.diagnostics, args.strict)


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
    _err("".join(f"{d}\n" for d in diagnostics))


def _read_json(path: str) -> tuple[Any, list[Diagnostic]]:
    try:
        data = read_json(path)
    except LoadFailure as e:
        return None, [failure_diagnostic(path, e)]
    if not isinstance(data, dict):
        return None, [Diagnostic(path, 1, 1, "bad-value", "error",
                                 "a ds_config is a JSON object", "pass the ds_config.json file")]
    return data, []


def _translate(args: argparse.Namespace) -> int:
    import json

    from actcfg.translate import merge_ds_config, translate

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
    try:
        out = translate(policy, backend)
    except TranslationError as e:
        line, column = doc.section(args.at).locate(tuple(e.field.split(".")))
        _report([Diagnostic(args.file, line, column, "unsupported-on-backend", "error",
                            str(e), f"remove `{e.field}`, or choose another backend")])
        return 1
    if args.merge:
        ds_config, problems = _read_json(args.merge)
        if problems:
            _report(problems)
            return _exit_code(problems)
        try:
            out = merge_ds_config(ds_config, out["activation_checkpointing"])
        except TranslationError as e:
            _report([Diagnostic(args.merge, None, None, "ds-config-conflict", "error", str(e),
                                "edit the ds_config or the policy so they agree")])
            return 1
    _out(json.dumps(out, indent=2) + "\n", args.output)
    return 0


def _add_translate(sub: Any) -> None:
    p = sub.add_parser("translate", help="print the backend's names for a policy, as JSON")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--backend", choices=_BACKENDS, help="default: the policy's `backend`")
    p.add_argument("--merge", metavar="DS_CONFIG",
                   help="print this ds_config.json with the activation_checkpointing section merged in")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    p.add_argument("--at", metavar="KEY", help="dotted key of the policy inside a larger YAML")
    p.set_defaults(run=_translate)


def _import(args: argparse.Namespace) -> int:
    if args.backend in (Backend.HF, Backend.LIGHTNING):
        return _import_trainer(args)
    from actcfg.translate import import_ds_config

    ds_config, problems = _read_json(args.file)
    if problems:
        _report(problems)
        return _exit_code(problems)
    try:
        imported = import_ds_config(ds_config)
    except TranslationError as e:
        _report([Diagnostic(args.file, None, None, "unsupported-on-backend", "error", str(e),
                            "fix the ds_config's activation_checkpointing section")])
        return 1
    _report([Diagnostic(args.file, None, None, "ignored-key", "warning",
                        f"`{key}`: {why}", "DeepSpeed would ignore it; it was not imported")
             for key, why in imported.ignored])
    _out(imported.yaml, args.output)
    return 0


def _import_trainer(args: argparse.Namespace) -> int:
    """`actcfg import --backend hf|lightning`: TrainingArguments or DeepSpeedStrategy keywords,
    as YAML or JSON, back to a policy."""
    from actcfg.translate.trainer_import import import_strategy_keywords, import_training_arguments

    hf = args.backend == Backend.HF
    trainer = "transformers" if hf else "Lightning"
    what = "TrainingArguments keywords" if hf else "DeepSpeedStrategy keywords"
    try:
        doc = read_document(args.file)
    except LoadFailure as e:
        failure = [failure_diagnostic(args.file, e)]
        if e.code == "yaml-not-mapping":  # the loader's hint speaks of policies
            failure = [Diagnostic(args.file, e.line, e.column, e.code, "error",
                                  f"{what} are a mapping of `name: value` lines",
                                  f"write the {what} as a YAML or JSON mapping")]
        _report(failure)
        return _exit_code(failure)
    try:
        imported = (import_training_arguments if hf else import_strategy_keywords)(doc.data)
    except TranslationError as e:
        _report([Diagnostic(args.file, None, None, "unsupported-on-backend", "error", str(e),
                            f"pass {what}")])
        return 1

    def where(key: str) -> tuple[int | None, int | None]:
        return doc.locate(tuple(key.split(".")), key=True) if key.split(".")[0] in doc.data else (None, None)

    _report([Diagnostic(args.file, *where(key), "ignored-key", "warning", f"`{key}`: {why}",
                        "not imported")
             for key, why in imported.ignored]
            + [Diagnostic(args.file, None, None, "dropped-by-backend", "warning", f"`{key}`: {why}",
                          f"imported: the policy keeps what {trainer} would lose")
               for key, why in imported.dropped])
    _out(imported.yaml, args.output)
    return 0


def _add_import(sub: Any) -> None:
    p = sub.add_parser("import", help="print the actcfg policy equivalent to a ds_config.json, "
                                      "TrainingArguments or DeepSpeedStrategy keywords")
    p.add_argument("file", metavar="FILE",
                   help="a ds_config.json; with --backend hf, TrainingArguments keywords (YAML or "
                        "JSON); with --backend lightning, DeepSpeedStrategy keywords (YAML or JSON)")
    p.add_argument("--backend", choices=[Backend.DEEPSPEED.value, Backend.HF.value, Backend.LIGHTNING.value],
                   default=Backend.DEEPSPEED.value, help="what FILE holds (default: deepspeed)")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    p.set_defaults(run=_import)


# --- verify --------------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    # Imported here, not above: verify measures with torch, and validate must never load it.
    from actcfg.verify import DEFAULT_MODEL, load_factory, require_cuda, verify
    from actcfg.verify.render import REPORTER_BY_NAME as RENDERERS
    from actcfg.verify.render import plot_memory, require_plotting

    policy, diagnostics = check_file(args.config, backends=(args.backend,) if args.backend else ())
    _report(diagnostics)
    if policy is None:
        return _exit_code(diagnostics) or 1  # an invalid policy is 1, as in validate; unreadable 2
    if args.steps < 1:
        raise _Usage(f"--steps must be at least 1, got {args.steps}")
    backend = Backend.parse(args.backend) if args.backend else policy.backend
    try:  # what would stop the run is found before the GPU work, and is a usage error
        factory = load_factory(args.model or DEFAULT_MODEL)
        require_cuda()
        if args.plot:
            require_plotting()
    except ActcfgError as e:
        raise _Usage(str(e)) from None
    with _process_group(backend):
        report = verify(factory, policy, steps=args.steps, backend=args.backend)
    _out(RENDERERS[args.format](report))
    if args.plot:
        try:
            plot_memory(report, args.plot)
        except ActcfgError as e:
            _err(f"actcfg: error: {e}\n")
            # The verdicts are already out: a failed promise (1) must not read as an I/O error (2).
            return 2 if report.ok else 1
    return 0 if report.ok else 1


@contextlib.contextmanager
def _process_group(backend: Backend) -> Iterator[None]:
    """A one-process NCCL group for a DeepSpeed policy when no launcher started one, destroyed
    after: DeepSpeed's `configure` asks torch.distributed for the rank even on one GPU. Under
    a launcher (WORLD_SIZE set) or with a group already up, nothing is started or stopped."""
    if backend is not Backend.DEEPSPEED:
        yield
        return
    import socket

    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ:
        yield
        return
    try:
        import deepspeed
    except ImportError:
        raise _Usage("this policy's backend is deepspeed: pip install actcfg[deepspeed]") from None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deepspeed.init_distributed(dist_backend="nccl", dist_init_required=True)
        yield
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


# --- wiring --------------------------------------------------------------------------------

COMMANDS: dict[str, Callable[[Any], None]] = {
    "validate": _add_validate,
    "schema": _add_schema,
    "translate": _add_translate,
    "import": _add_import,
    "verify": _add_verify,
}
"""Each subcommand's parser builder; a builder sets `run` (args -> exit code) as default."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actcfg",
        description="Declarative, checked activation-memory policies for PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"actcfg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
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
            args = _parser().parse_args(argv)
        except SystemExit as e:  # argparse: --help and --version exit 0, usage errors 2
            return e.code if isinstance(e.code, int) else 2
        return args.run(args)
    except _Usage as e:
        _err(f"actcfg: error: {e}\n")
        return 2
    except ActcfgError as e:
        _err(f"actcfg: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        _err("actcfg: interrupted\n")
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): silence the flush at exit, as the Python docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 2
    except Exception as e:  # last resort: never a traceback
        _err(f"actcfg: internal error, please report: {type(e).__name__}: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
