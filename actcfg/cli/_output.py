"""Where the CLI's text goes: standard output and error (a full disk or a closed reader is exit
2, never a traceback), and `-o` files, written whole or not at all and never over an input."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "OutputFailed",
    "Usage",
    "check_output",
    "refuse_output_over",
    "silence",
    "write_error",
    "write_output",
]


class Usage(Exception):
    """A usage error found after parsing: report it and exit 2."""


class OutputFailed(Exception):
    """Writing to stdout or stderr failed (a full disk, a closed terminal): exit 2."""

    def __init__(self, stream: str, error: OSError) -> None:
        super().__init__(f"cannot write to {stream}: {error.strerror or error}")
        self.stream = stream


def write_stream(stream: Any, name: str, text: str) -> None:
    """`text` to `stream`, flushed now; OutputFailed if the stream cannot take it."""
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
        raise OutputFailed(name, e) from None


def write_output(text: str, path: str | None = None) -> None:
    """`text` to standard output, or to the file `path` (`-o`), written whole."""
    if path is None:
        write_stream(sys.stdout, "standard output", text)
    else:
        write_file(path, text)


def write_error(text: str) -> None:
    """`text` to standard error."""
    write_stream(sys.stderr, "standard error", text)


def write_file(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a new file in the same folder, then
    renamed over `path` (os.replace), so a failed write (a full disk) leaves the old file as
    it was. A symlink is followed and kept. A descriptor of this process (`-o /dev/stdout`,
    `/dev/stderr`, `/dev/fd/N`) is written through, as the shell's redirection opened it (a
    `>> build.log` keeps appending; a pipe works), and a device or FIFO is written in place:
    there is no file to replace. A file this process may not write is refused, as the shell's
    `>` refuses it, though renaming over it would need only the folder's permission."""
    import tempfile

    fd = descriptor_named(path)
    if fd is not None:
        write_descriptor(fd, path, text)
        return
    target, info = output_target(path)
    try:
        if info is not None and not stat.S_ISREG(info.st_mode):
            with open(target, "w", encoding="utf-8") as handle:
                handle.write(text)
            return
        folder = os.path.dirname(target)
        try:
            fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.",
                                             suffix=".tmp")
        except OSError as e:
            if info is not None and e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
                # The target is there and writable, its folder takes no new file (/proc, say).
                raise Usage(f"cannot write {path}: {folder} takes no new file ({e.strerror or e}), "
                            "and actcfg writes the whole file beside its target before replacing "
                            "it; write it elsewhere, or to /dev/stdout and redirect") from None
            raise
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
        raise Usage(f"cannot write {path}: {e.strerror or e}") from None


def output_target(path: str) -> tuple[str, os.stat_result | None]:
    """(the file `-o path` writes, its stat or None if it is new), or Usage for a target that
    cannot be written: a directory, a missing or unwritable folder, a file this process may not
    write. Checked before any work that -o would lose (`actcfg plan` profiles for minutes)."""
    target = os.path.realpath(path)
    try:
        try:
            info: os.stat_result | None = os.stat(target)
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISDIR(info.st_mode):
            raise Usage(f"cannot write {path}: it is a directory")
        if info is not None and stat.S_ISREG(info.st_mode):
            # What the shell's `>` asks of the file itself (root may write anything, as there).
            os.close(os.open(target, os.O_WRONLY))
        folder = os.path.dirname(target) or "."
        if info is None and not os.path.isdir(folder):
            raise Usage(f"cannot write {path}: No such file or directory")
        if (info is None or stat.S_ISREG(info.st_mode)) and not os.access(folder, os.W_OK | os.X_OK):
            raise Usage(f"cannot write {path}: Permission denied")
    except OSError as e:
        raise Usage(f"cannot write {path}: {e.strerror or e}") from None
    return target, info


def check_output(path: str | None) -> None:
    """Usage now if `-o path` could not be written later."""
    if path is None:
        return
    fd = descriptor_named(path)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError as e:
            raise Usage(f"cannot write {path}: {e.strerror or e}") from None
        return
    output_target(path)


def descriptor_named(path: str) -> int | None:
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


def write_descriptor(fd: int, path: str, text: str) -> None:
    """`text` through descriptor `fd` of this process: stdout and stderr through their streams
    (in order with what else is printed there), another descriptor as it is."""
    for stream, name in ((sys.stdout, "standard output"), (sys.stderr, "standard error")):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream.fileno() == fd:
                write_stream(stream, name, text)
                return
    data = text.encode("utf-8")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        raise Usage(f"cannot write {path}: {e.strerror or e}") from None


def refuse_output_over(output: str | None, inputs: Sequence[str | None]) -> None:
    """-o must not name an input: the input would be gone before it was read in full."""
    if output is None:
        return
    for name in inputs:
        if name is None:
            continue
        with contextlib.suppress(OSError):
            if os.path.samefile(output, name):
                raise Usage(f"-o {output} is the input file {name}: actcfg does not write over "
                             "its input; write to another file, check it, then move it")


def silence(stream: Any) -> None:
    """Point `stream`'s descriptor at /dev/null, so that the interpreter's flush at exit
    cannot fail on it a second time (and print a traceback of its own)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
