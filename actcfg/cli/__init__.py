"""`actcfg`: validate | schema | translate | import | verify | plan. Flags, wiring and exit codes only.

Exit codes (docs/architecture.md): 0 every file valid; 1 any error (or any warning under
`--strict`); 2 usage error or a file that cannot be read. No input produces a traceback.
Each command is one module of this package (`validate.py`, `translate.py`, ...) with
`add_parser(sub)`, which defines its flags and sets `run` (args -> exit code); only the module
of the command given is imported, so `actcfg validate` loads no other command's imports.
Adding a subcommand is one module, one entry in `COMMANDS` and one in `EPILOGS` (`_help.py`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import sys
from collections.abc import Sequence

from actcfg._version import __version__
from actcfg.cli._help import EPILOGS
from actcfg.cli._output import OutputFailed, Usage, silence, write_error
from actcfg.errors import ActcfgError
from actcfg.policy.diagnostics import escape_controls

__all__ = ["COMMANDS", "EPILOGS", "main"]

COMMANDS: dict[str, str] = {
    "validate": "actcfg.cli.validate",
    "schema": "actcfg.cli.schema",
    "translate": "actcfg.cli.translate",
    "import": "actcfg.cli.import_",
    "verify": "actcfg.cli.verify",
    "plan": "actcfg.cli.plan",
}
"""Each subcommand's module, in the order `--help` lists them; the module's `add_parser(sub)`
adds the subcommand and sets `run` (args -> exit code) as its default."""


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser for `argv`. When its first word names a command, only that command's parser
    is built (and its module imported): whatever follows goes to that parser alone, and the
    program's own usage line names no command, so help and errors read as with all of them.
    Otherwise (`--help`, a mistyped command) every command is there, as its list needs."""
    parser = argparse.ArgumentParser(
        prog="actcfg",
        description="Declarative, checked activation-memory policies for PyTorch training.",
        epilog=EPILOGS["actcfg"], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"actcfg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    for name in named:
        importlib.import_module(COMMANDS[name]).add_parser(sub)
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
                argv = sys.argv[1:] if argv is None else list(argv)
                args = _parser(argv).parse_args(argv)
            except SystemExit as e:  # argparse: --help and --version exit 0, usage errors 2
                return e.code if isinstance(e.code, int) else 2
            return args.run(args)
        except Usage as e:
            write_error(f"actcfg: error: {escape_controls(str(e))}\n")
            return 2
        except ActcfgError as e:
            write_error(f"actcfg: error: {escape_controls(str(e))}\n")
            return 1
        except KeyboardInterrupt:
            write_error("actcfg: interrupted\n")
            return 2
        except (OutputFailed, BrokenPipeError):
            raise
        except Exception as e:  # last resort: never a traceback
            what = escape_controls(f"{type(e).__name__}: {e}")
            write_error(f"actcfg: internal error, please report: {what}\n")
            return 2
    except BrokenPipeError:
        # The reader went away (`| head`): silence the flush at exit, as the Python docs advise.
        silence(sys.stdout)
        return 2
    except OutputFailed as e:
        if e.stream == "standard output":
            with contextlib.suppress(OSError, OutputFailed):
                write_error(f"actcfg: error: {e}\n")
        silence(sys.stdout)
        silence(sys.stderr)
        return 2

