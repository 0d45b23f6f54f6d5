"""One bound on pinned host memory for every local rank of a job: `pin_budget_per_node`.

Pinned (page-locked) memory cannot be swapped; eight ranks of one node that each pin up to a
per-process `pin_budget` can lock eight times that, and a host out of lockable memory takes the
whole node down (pytorch/pytorch#86097 asks how much may be pinned at all; neither torch nor
DeepSpeed bounds it per node). The ranks therefore keep one ledger per node and job:

* A directory in /dev/shm (node-local, memory-backed, gone at reboot), named by the user and the
  job: torchrun's TORCHELASTIC_RUN_ID with MASTER_ADDR and MASTER_PORT, which every rank of one
  launch shares and no other launch does. ACTCFG_HOST_LEDGER_DIR moves it (containers that do
  not share /dev/shm must share a directory of the node instead).
* Each engine's pool owns one file there, holding the bytes it has pinned, and holds an
  exclusive `flock` on that file for as long as it lives. Every change goes through a second,
  directory-wide lock, under which a pool reserves only when the bytes of every live file plus
  its request stay within the budget.
* A crashed rank (SIGKILL, OOM killer, a segfault) cannot release its reservation, but the
  kernel releases its flock when the process dies, along with its pinned memory. A pool that
  can take another file's flock knows that file's owner is dead: it deletes the file and its
  bytes return to the node. No PID check (PIDs are reused, and differ across PID namespaces),
  no timeout (a slow rank is not a dead one).

Why a ledger and not an even split by LOCAL_WORLD_SIZE: the ledger bounds the sum exactly
whatever each rank believes (an elastic restart overlapping dying ranks, a wrong
LOCAL_WORLD_SIZE), and it lets ranks whose needs differ share one budget: pipeline stages hold
different numbers of micro-batches (the first stage of a 1F1B schedule holds as many as there
are stages, the last one). Its cost: first come, first served. Pools only grow and are reused
step after step, so the first steps decide who holds what; ranks that run in lockstep (data
parallel) grow alike. Where the ledger cannot be opened (no /dev/shm, no flock), each rank
falls back to the even split, and says so.

Pure Python, no torch: the offload engine calls `reserve` before it pins and `release` when it
unpins.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator

from actcfg.units import memory_size

__all__ = ["LEDGER_DIR_ENV", "NodeBudget", "job_key", "ledger_root", "local_ranks"]

LEDGER_DIR_ENV = "ACTCFG_HOST_LEDGER_DIR"
"""Environment variable naming the directory the ledgers live in (default /dev/shm)."""

_LOG = logging.getLogger("actcfg.runtime.host_budget")
_PREFIX = "held."


def ledger_root() -> str:
    """Where the ledgers of this node live: $ACTCFG_HOST_LEDGER_DIR, /dev/shm, or the temp dir."""
    explicit = os.environ.get(LEDGER_DIR_ENV)
    if explicit:
        return explicit
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def job_key() -> str | None:
    """What the ranks of one launch share and no other launch has, from the launcher's
    environment; None outside a launcher (the process is then its node's only rank)."""
    parts = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")]
    if not any(parts):
        return None
    return "|".join(parts)


def local_ranks() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as the launcher set them; (0, 1) outside one."""
    def read(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return read("LOCAL_RANK", 0), max(1, read("LOCAL_WORLD_SIZE", 1))


class NodeBudget:
    """This process's account in its node's ledger: `reserve` before pinning, `release` after
    unpinning, `close` at the end (a crash is reclaimed by the next rank that reserves)."""

    def __init__(self, budget: int, *, key: str | None = None, root: str | None = None) -> None:
        self.budget = budget
        """Most bytes all local ranks of the job may hold pinned together."""
        self.held = 0
        """Bytes this process holds in the ledger."""
        self.local_rank, self.local_world = local_ranks()
        self.reclaimed = 0
        """Bytes of dead ranks this process found in the ledger and returned to the node."""
        key = key if key is not None else job_key()
        self.shared = key is not None
        if key is None:
            key = f"pid{os.getpid()}"  # no launcher: nothing to share with
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = os.path.join(root or ledger_root(), f"actcfg-pin-{os.getuid()}-{digest}")
        self.split: int | None = None
        """Set when the ledger could not be opened: this rank's even share of the budget."""
        self.why_split = ""
        """Why the ledger could not be opened (with `split`)."""
        self._dir_fd = self._own_fd = -1
        self._own = ""
        try:
            self._open()
        except OSError as e:  # no /dev/shm, read-only, no flock on this filesystem, ...
            self._abandon()
            self.split = budget // self.local_world
            self.why_split = f"the node's ledger at {self.path} cannot be used ({e})"
        _LOG.info(self.share_line())

    # --- the ledger --------------------------------------------------------------------------

    def _open(self) -> None:
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._dir_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            self._own = os.path.join(self.path, f"{_PREFIX}{os.getpid()}.{uuid.uuid4().hex[:8]}")
            # Created and locked while the directory lock is held: no scan ever sees it unlocked.
            # (A child forked later shares this open file, and so keeps the lock while it
            # lives: a DataLoader worker keeps its parent's reservation a little longer, which
            # errs on the safe side.)
            self._own_fd = os.open(self._own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self._own_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._write()

    def _abandon(self) -> None:
        """Close what a failed `_open` left open."""
        for fd in (self._own_fd, self._dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._own:
            with contextlib.suppress(OSError):
                os.unlink(self._own)
        self._own_fd = self._dir_fd = -1
        self._own = ""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._dir_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._dir_fd, fcntl.LOCK_UN)

    def _write(self) -> None:
        data = str(self.held).encode()
        os.ftruncate(self._own_fd, 0)
        os.pwrite(self._own_fd, data, 0)

    def _others(self) -> tuple[int, int]:
        """(bytes, ranks) the other live accounts hold; dead ones are deleted on the way.
        Called with the directory lock held."""
        total = ranks = 0
        for name in sorted(os.listdir(self.path)):
            path = os.path.join(self.path, name)
            if not name.startswith(_PREFIX) or path == self._own:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                held = int(os.pread(fd, 32, 0) or b"0")
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    total += held  # its owner holds the lock: alive
                    ranks += 1
                    continue
                # Nobody holds it: its owner died without closing. The kernel unpinned its
                # memory with it; its bytes go back to the node.
                os.unlink(path)
                self.reclaimed += held
                _LOG.warning("actcfg offload: a rank of this job died holding %s of "
                             "pin_budget_per_node; returned to the node (%s)", memory_size(held), path)
            finally:
                os.close(fd)
        return total, ranks

    # --- what the pool calls -------------------------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        """Take `nbytes` of the node's budget for pinning; False (nothing taken) when the
        ranks together would go over it."""
        if self.split is not None:
            if self.held + nbytes > self.split:
                return False
            self.held += nbytes
            return True
        with self._locked():
            others, _ = self._others()
            if others + self.held + nbytes > self.budget:
                return False
            self.held += nbytes
            self._write()
        return True

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` this process had reserved (it unpinned them)."""
        self.held = max(0, self.held - nbytes)
        if self.split is None and self._own_fd >= 0:
            with self._locked():
                self._write()

    def node_held(self) -> tuple[int, int]:
        """(bytes, ranks) the live accounts of this job hold on this node, this one included."""
        if self.split is not None:
            return self.held, 1
        with self._locked():
            others, ranks = self._others()
        return others + self.held, ranks + 1

    def close(self) -> None:
        """Leave the ledger: this process holds nothing pinned any more."""
        self.held = 0
        if self._own_fd < 0:
            return
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own)
        os.close(self._own_fd)
        os.close(self._dir_fd)
        self._own_fd = self._dir_fd = -1
        # The directory and its lock file stay (a few bytes in /dev/shm): deleting a lock file
        # other processes may be opening races with them.

    def share_line(self) -> str:
        """The one log line that says what this rank may pin."""
        who = (f"local rank {self.local_rank} of {self.local_world}" if self.shared
               else "this process (no launcher: the node's only rank)")
        if self.split is not None:
            return (f"actcfg offload: {who} pins at most {memory_size(self.split)}, an even share of "
                    f"pin_budget_per_node {memory_size(self.budget)}: {self.why_split}")
        held, ranks = self.node_held()
        return (f"actcfg offload: {who} shares pin_budget_per_node {memory_size(self.budget)} with the "
                f"job's other ranks on this node, first come first served (an even share would be "
                f"{memory_size(self.budget // self.local_world)}; {ranks} ranks hold {memory_size(held)} now; "
                f"ledger {self.path})")
